"""GPU check: ARMOR vs GRPO (β = 0.04) on a ~0.5B model built locally, full and LoRA, bf16.

Reports median step time and peak GPU memory side by side. Needs CUDA; no hub access (the model
has random weights and the character tokenizer of armor_trl.tiny, with Qwen2.5-0.5B's shapes).
Run: scripts/gpu_check.sh [--steps N] [--vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from armor_trl import ArmorConfig, ArmorGRPOTrainer
from armor_trl.tiny import build_tokenizer


def build_half_billion(path: str) -> str:
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def digit_share(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)


def run(name, model_path, tokenizer, steps, lora, vllm, output_root):
    common = dict(
        output_dir=os.path.join(output_root, name), per_device_train_batch_size=16, num_generations=8,
        max_completion_length=128, max_steps=steps, learning_rate=1e-6, bf16=True, report_to="none",
        logging_steps=1, save_strategy="no", gradient_checkpointing=True, seed=0,
        use_vllm=vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
    )
    dataset = Dataset.from_dict({"prompt": [f"{i}+{i * 7}=" for i in range(256)]})
    peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if lora else None
    if name.startswith("grpo"):
        trainer = GRPOTrainer(model=model_path, reward_funcs=digit_share, args=GRPOConfig(beta=0.04, **common),
                              train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)
    else:
        trainer = ArmorGRPOTrainer(model=model_path, reward_funcs=digit_share,
                                   args=ArmorConfig(anchor_reward_threshold=0.2, ref_reset_steps=2, **common),
                                   train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)
    timer = StepTimer()
    trainer.add_callback(timer)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    warm = timer.times[2:] or timer.times
    result = {"run": name, "median_step_s": statistics.median(warm), "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30}
    found = [h["armor/anchor_found_frac"] for h in trainer.state.log_history if "armor/anchor_found_frac" in h]
    if found:
        result["anchor_found_frac"] = statistics.mean(found)
    del trainer
    torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--vllm", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "results/gpu_check"))
    cli = parser.parse_args()
    assert torch.cuda.is_available(), "the GPU check needs CUDA"
    os.makedirs(cli.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = build_half_billion(os.path.join(tmp, "model"))
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        results = []
        for lora in (False, True):
            for method in ("grpo_beta0.04", "armor"):
                name = f"{method}{'_lora' if lora else ''}"
                results.append(run(name, model_path, tokenizer, cli.steps, lora, cli.vllm, tmp))
                print(json.dumps(results[-1]), flush=True)
    print(f"\n| run | median s/step | peak GPU GiB | ratio to GRPO (same LoRA setting) |\n|---|---|---|---|")
    for r in results:
        base = next(b for b in results if b["run"] == ("grpo_beta0.04_lora" if "lora" in r["run"] else "grpo_beta0.04"))
        print(f"| {r['run']} | {r['median_step_s']:.3f} | {r['peak_gpu_gib']:.2f} | "
              f"{r['median_step_s'] / base['median_step_s']:.2f}× time, {r['peak_gpu_gib'] / base['peak_gpu_gib']:.2f}× mem |")
    with open(os.path.join(cli.out, "gpu_check.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "vllm": cli.vllm, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
