"""The GPU check's plan: its parts, each with its own time budget, run one after the other as subprocesses.

    python scripts/gpu_check_parts.py [--wheelhouse DIR] [--output_dir DIR] [--full] [--dry_run] [--only NAME ...]

(``scripts/gpu_check.sh`` runs this.) By default it fits ten minutes on one GPU: the offline install from a
wheelhouse (with its opt-in DeepSpeed wheels where it holds them), the four runs of scripts/gpu_check.py (GRPO
β = 0.04 and ARMOR, full and LoRA, 4 optimizer steps each), ZeRO-2 / ZeRO-3 / ZeRO-3 + LoRA and FSDP2 + LoRA
under ``accelerate launch`` (ARMOR with resets, a save and a resume), ``armor-trl train`` under ZeRO-2 + LoRA with a reward a
random-weight model can satisfy, and the M = 16 pair (GRPO β = 0.04 vs ARMOR with online anchors, 16 optimizer
steps per rollout batch). Each part is stopped at its budget, so one slow part cannot starve the others; the budgets
are derived from the step times of the first GPU run (:data:`STEP_S`) and add up to at most :data:`TOTAL_LIMIT_S`.
``--full`` also runs the bench's whole gpu preset (hours at those step times), without a budget, and, where vllm is
installed, tests/test_vllm_gpu.py and (with 3 GPUs) scripts/gpu_check.py's reference-server check.

Results: ``gpu_check.json`` (every part: status, seconds, budget, what it measured) and ``gpu_check.md`` (one
table) in ``--output_dir``. ``--dry_run`` prints the plan with its budgets and runs nothing. Standard library only:
it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Median seconds per optimizer step of scripts/gpu_check.py's runs (random-weight 0.5B Qwen2 shape, bf16, gradient
# checkpointing, batch 16, G = 8, 128 new tokens, transformers generation, one optimizer step per rollout batch) on
# one H200, 2026-12-04, main at 18dee8d (docs/performance.md, "On a GPU").
STEP_S = {"grpo_beta0.04": 5.61, "armor": 6.67, "grpo_beta0.04_lora": 6.73, "armor_lora": 7.72}
STEPS = 4  # optimizer steps of each of the four runs (the first two are warm-up; the median is over the last two)
TOTAL_LIMIT_S = 9 * 60  # the budgets of the default parts add up to at most this: ten minutes with room to spare
START_S = 15  # a run's start: Python, torch, the model from local disk to the GPU, the trainer built
LAUNCH_S = 25  # `accelerate launch` with DeepSpeed: the launcher, DeepSpeed's import and engine set-up
FSDP_LAUNCH_S = 15  # `accelerate launch` with FSDP2: the launcher and fully_shard (estimated, not measured on a GPU)
OUTPUT_DIR = os.environ.get("OUT", "results/gpu_check")


@dataclass
class Part:
    name: str
    what: str
    budget_s: float | None  # None: no limit (--full only)
    command: list[str]
    how_budget: str  # how the budget was derived
    env: dict = field(default_factory=dict)
    result_file: str | None = None  # a JSON file the part writes in its folder


def accelerate(config: str, *command: str) -> list[str]:
    """``accelerate launch`` on one GPU with one of the repository's configs (bf16, one process)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/{config}",
            "--num_processes", "1", "--mixed_precision", "bf16", *command]


def plan(output_dir: str, wheelhouse: str | None, full: bool) -> list[Part]:
    out = Path(output_dir)
    model, small = str(out / "model"), str(out / "model_small")
    check = [sys.executable, "scripts/gpu_check.py"]
    parts = []
    if wheelhouse:
        parts.append(Part("install", f"pip install --no-index from {wheelhouse} (armor-trl, and deepspeed where the "
                          "wheelhouse holds it)", 40, [sys.executable, "scripts/wheelhouse.py", "install", wheelhouse],
                          "measured ~20 s for 10 wheels (3.3 MiB), x2"))
    parts.append(Part("models", "build the random-weight models once: the 0.5B Qwen2 shape (24 layers) and a 4-layer "
                      "one for the launcher parts", 30, [*check, "--build_models", model, small],
                      "random init and a bf16 save of ~1 GB"))
    for name, seconds in STEP_S.items():
        lora = name.endswith("_lora")
        parts.append(Part(name, f"{'LoRA ' if lora else ''}{'ARMOR' if name.startswith('armor') else 'GRPO β=0.04'}, "
                          f"{STEPS} optimizer steps", math.ceil(START_S + STEPS * seconds),
                          [*check, "--run", name, "--model", model, "--steps", str(STEPS), "--output_dir",
                           str(out / name)], f"{START_S} s start + {STEPS} x {seconds} s/step",
                          result_file=f"{name}/{name}.json"))
    for name, config, lora in (("zero2", "zero2.yaml", False), ("zero3", "zero3.yaml", False),
                               ("zero3_lora", "zero3.yaml", True)):
        parts.append(Part(name, f"ARMOR under accelerate launch + {config}{' + LoRA' if lora else ''}: resets every "
                          "2 steps, a save at step 2, a new trainer resumes it to step 4", 45,
                          accelerate(config, "scripts/gpu_check.py", "--launcher_part", name, "--model", small,
                                     "--output_dir", str(out / name)),
                          f"{LAUNCH_S} s launch + 4 steps of the 4-layer model, a save and a load",
                          result_file=f"{name}/{name}.json"))
    # one process runs FSDP2's wrapping, sharded π_ref (a 1-process mesh) and full-state-dict saves all the same
    parts.append(Part("fsdp2_lora", "ARMOR under accelerate launch + fsdp2.yaml + LoRA: resets every 2 steps, a save "
                      "at step 2, a new trainer resumes it to step 4", 35,
                      accelerate("fsdp2.yaml", "scripts/gpu_check.py", "--launcher_part", "fsdp2_lora", "--model",
                                 small, "--output_dir", str(out / "fsdp2_lora")),
                      f"{FSDP_LAUNCH_S} s launch + 4 steps of the 4-layer model, a save and a load",
                      result_file="fsdp2_lora/fsdp2_lora.json"))
    parts.append(Part("cli_zero2_lora", "armor-trl train --config configs/tiny_demo.yaml under accelerate launch + "
                      "zero2.yaml + LoRA, 2 steps, reward gpu_check_rewards:has_digit", 40,
                      accelerate("zero2.yaml", "-m", "armor_trl", "train", "--config", "configs/tiny_demo.yaml",
                                 "--model_name_or_path", small, "--use_peft", "true", "--max_steps", "2",
                                 "--reward_funcs", "gpu_check_rewards:has_digit", "--output_dir",
                                 str(out / "cli_zero2_lora")),
                      f"{LAUNCH_S} s launch + 2 steps of the 4-layer model",
                      env={"PYTHONPATH": os.pathsep.join([str(REPO / "scripts"), str(REPO)])}))
    parts.append(Part("pair_m16", "GRPO β=0.04 vs ARMOR (online anchors) at M = 16: one rollout batch of 128 rows, "
                      "16 optimizer steps of 8 rows each", 60,
                      [*check, "--pair_m16", "--model", model, "--output_dir", str(out / "pair_m16")],
                      f"2 x ({START_S} s start + one generation (~{STEP_S['armor']:.0f} s) + 16 small steps)",
                      result_file="pair_m16/pair_m16.json"))
    if full:
        parts.append(Part("bench", "the bench's whole gpu preset (13 variants, the regime at M = 1, 4, 16; hours)",
                          None, [sys.executable, "-m", "benchmarks", "--preset", "gpu", "--out", str(out / "bench")],
                          "none: --full runs it to the end"))
        if importlib.util.find_spec("vllm") is not None:
            parts.append(Part("bench_vllm", "the bench's gpu preset with TRL's colocated vLLM engine", None,
                              [sys.executable, "-m", "benchmarks", "--preset", "gpu", "--vllm", "--out",
                               str(out / "bench_vllm")], "none: --full runs it to the end"))
            parts.append(Part("vllm_gpu_test", "tests/test_vllm_gpu.py", None,
                              [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_vllm_gpu.py"],
                              "none: --full runs it to the end"))
            if gpu_count() >= 3:  # trainer, policy server, reference server: NCCL cannot pair two ranks on one GPU
                parts.append(Part("reference_server", "ARMOR with the reference on its own trl vllm-serve", None,
                                  [*check, "--reference_server", "--output_dir", str(out / "reference_server")],
                                  "none: --full runs it to the end",
                                  result_file="reference_server/reference_server.json"))
    return parts


def gpu_count() -> int:
    """GPUs nvidia-smi lists (0 without it)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


def total_budget(parts: list[Part]) -> float:
    return sum(part.budget_s for part in parts if part.budget_s is not None)


def describe(parts: list[Part]) -> str:
    lines = ["| part | budget s | how | what |", "|---|---|---|---|"]
    for part in parts:
        budget = "none" if part.budget_s is None else f"{part.budget_s:g}"
        lines.append(f"| {part.name} | {budget} | {part.how_budget} | {part.what} |")
    lines.append(f"| total | {total_budget(parts):g} | limit {TOTAL_LIMIT_S} s ({TOTAL_LIMIT_S // 60} min) | |")
    return "\n".join(lines)


def run_part(part: Part, output_dir: Path, log_dir: Path) -> dict:
    """Run one part within its budget; its status, seconds and what it wrote."""
    log = log_dir / f"{part.name}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **part.env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (part.env.get("PYTHONPATH", str(REPO)),
                                                    os.environ.get("PYTHONPATH", "")) if p)
    start = time.monotonic()
    with open(log, "w") as f:
        process = subprocess.Popen(part.command, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=part.budget_s)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 15)  # the part's own process group: launcher, workers, servers
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()
            status = f"over budget (stopped at {part.budget_s:g} s)"
    entry = {"part": part.name, "status": status, "seconds": round(time.monotonic() - start, 1),
             "budget_s": part.budget_s, "what": part.what, "log": str(log)}
    if part.result_file and (output_dir / part.result_file).is_file():
        entry["result"] = json.loads((output_dir / part.result_file).read_text())
    if status != "ok":
        entry["log_tail"] = log.read_text()[-2000:]
    print(f"gpu_check: {part.name}: {status} in {entry['seconds']} s (budget {part.budget_s})", flush=True)
    return entry


def summary(entry: dict) -> str:
    """One cell: what a part measured."""
    result = entry.get("result") or {}
    keys = ("median_step_s", "peak_gpu_gib", "grpo_beta0.04_per_step_s", "armor_per_step_s", "ratio_step",
            "anchor_found_frac", "resumed_to_step", "reference_resets", "losses_finite")
    shown = [f"{k} {result[k]:.3g}" if isinstance(result.get(k), float) else f"{k} {result[k]}"
             for k in keys if k in result]
    return ", ".join(shown)


def table(entries: list[dict]) -> str:
    lines = ["| part | status | seconds | budget s | measured |", "|---|---|---|---|---|"]
    for e in entries:
        budget = "none" if e["budget_s"] is None else f"{e['budget_s']:g}"
        lines.append(f"| {e['part']} | {e['status']} | {e['seconds']:g} | {budget} | {summary(e)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--wheelhouse", default=os.environ.get("ARMOR_WHEELHOUSE") or None,
                        help="install armor-trl (and deepspeed, when its wheels are there) from this folder, no index")
    parser.add_argument("--output_dir", default=OUTPUT_DIR)
    parser.add_argument("--full", action="store_true", help="also the bench's whole gpu preset (hours), no budget")
    parser.add_argument("--dry_run", action="store_true", help="print the plan and its budgets; run nothing")
    parser.add_argument("--only", nargs="+", default=None, help="run only these parts (names as in the plan)")
    args = parser.parse_args(argv)
    parts = plan(args.output_dir, args.wheelhouse, args.full)
    if args.only:
        unknown = sorted(set(args.only) - {p.name for p in parts})
        if unknown:
            parser.error(f"--only {' '.join(unknown)}: no such part; the parts: {', '.join(p.name for p in parts)}")
        parts = [p for p in parts if p.name in args.only]
    print(describe(parts), flush=True)
    if args.dry_run:
        return 0
    if shutil.which("nvidia-smi") is None:
        print("gpu_check: error: no GPU here (nvidia-smi not found); --dry_run prints the plan", file=sys.stderr)
        return 2
    if not args.wheelhouse:  # nothing to install from: every module must be importable already
        missing = subprocess.run([sys.executable, "scripts/wheelhouse.py", "missing"], cwd=REPO)
        if missing.returncode != 0:
            print("gpu_check: error: modules are missing (above); build a wheelhouse with `make wheelhouse` on a "
                  "machine with network, copy it with the repository and pass --wheelhouse wheelhouse", file=sys.stderr)
            return 2
    out = Path(args.output_dir)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    entries = [run_part(part, out, logs) for part in parts]
    (out / "gpu_check.json").write_text(json.dumps({"parts": entries, "total_budget_s": total_budget(parts)},
                                                   indent=2))
    (out / "gpu_check.md").write_text(table(entries) + "\n")
    print("\n" + table(entries))
    return 0 if all(e["status"] == "ok" for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
