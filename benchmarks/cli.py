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

from benchmarks import config, regime, report, summary  # noqa: E402
from benchmarks.run import run_variant  # noqa: E402
from benchmarks.workload import build_and_calibrate, pregenerate_anchors  # noqa: E402

PRELOAD = [
    "torch", "transformers", "transformers.models.llama.modeling_llama", "datasets", "peft", "trl",
    "trl.trainer.grpo_trainer", "armor_trl", "armor_trl.trainer", "benchmarks.run",
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
    parser.add_argument("--no-regime", action="store_true", help="skip the regime runs")
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
    if args.whatif_repeats is None:
        args.whatif_repeats = bench.presets[args.preset]["whatif_repeats"]
    mini_batches = [int(m) for m in args.mini_batches.split(",") if m.strip()] if not args.no_regime else []
    args.regime = regime.plan(bench, bench.presets[args.preset], args.variants, mini_batches, args.shape, args.g)
    return args


def rerender(source: Path, out: Path, bench: config.BenchConfig) -> int:
    """Summary, targets and tables again from the raw runs of a saved bench.json (no training)."""
    result = json.loads(source.read_text())
    result["summary"] = summary.summarize(result["runs"], result["meta"]["warmup"], bench)
    result["targets"] = summary.check_targets(result["summary"], bench)
    if "regime" in result:
        result["regime"]["summary"] = regime.summarize(result["regime"]["runs"], bench)
    print(report.write(result, out, bench))
    return 0


def _rotated(items: list, rep: int) -> list:
    """The schedule of repetition ``rep``: rotated, so that no run is always first."""
    return items[rep % len(items):] + items[: rep % len(items)]


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
                    layers=shape["layers"], completion=shape["completion"], prompts=shape["prompts"])
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
        for rep in range(shape["reps"]):
            for position, name in enumerate(_rotated(args.variants, rep)):
                run = submit(run_variant, {
                    **base, "batch": shape["batch"], "steps": shape["steps"], "variant": bench.variants[name],
                    "bench": bench, "rep": rep, "order": position, "model_path": calibration["model_path"],
                    "threshold": calibration["threshold"], "output_dir": os.path.join(tmp, f"{name}-{rep}"),
                    "lr": args.lr, "lr_lora": args.lr_lora, "reset_repeats": args.reset_repeats,
                    "whatif_repeats": args.whatif_repeats, "log": str(logs / f"{name}-{rep}.log"),
                    "anchors_path": pregeneration and pregeneration["path"],
                })
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
            run = submit(run_variant, {
                **base, "batch": plan["batch"], "steps": steps, "mini_batches": m, "warmup_steps": warmup_steps,
                "variant": bench.variants[name], "bench": bench, "rep": rep, "order": position,
                "model_path": calibration["model_path"], "threshold": calibration["threshold"],
                "output_dir": os.path.join(tmp, f"regime-{name}-{m}-{rep}"), "lr": args.lr, "lr_lora": args.lr_lora,
                "log": str(logs / f"regime-{name}-M{m}-{rep}.log"), "anchors_path": anchors and anchors["path"],
            })
            cost = statistics.mean(s["step_s"] for s in run["steps"][warmup_steps:])
            print(f"regime rep {rep + 1}/{plan['reps']} {name:15s} M={m:<3d} {cost:.3f} s per optimizer step, "
                  f"peak RSS {run['peak_rss_mb']:.0f} MB, load {os.getloadavg()[0]:.2f}", flush=True)
            runs.append(run)
    return {"meta": {**plan, "pregeneration": anchors}, "runs": runs}


def main(argv: list | None = None) -> int:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--bench-config", default=str(config.CONFIG_FILE))
    bench = config.load(first.parse_known_args(argv)[0].bench_config)
    args = parse_args(argv, bench)
    if args.from_json:
        return rerender(Path(args.from_json), Path(args.out), bench)
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    started, load_before = time.perf_counter(), list(os.getloadavg())
    measured = measure(args, bench, out / "logs")
    calibration, pregeneration, shape = measured["calibration"], measured["pregeneration"], args.shape
    result_summary = summary.summarize(measured["runs"], shape["warmup"], bench)
    import torch
    import transformers
    import trl

    result = {
        "meta": {
            "mode": args.preset, **shape, "g": args.g, "k": args.k, "seed": args.seed,
            "threads": args.threads, "threshold": calibration["threshold"],
            "calibration_found_frac": calibration["calibration_found_frac"], "configs": args.variants,
            "load_before": load_before, "load_after": list(os.getloadavg()), "cpus": os.cpu_count(),
            "wall_s": time.perf_counter() - started, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "baseline": bench.baseline,
            "lora_baseline": bench.lora_baseline, "pregeneration": pregeneration,
            "anchor_break_even": summary.anchor_break_even(
                result_summary, pregeneration, shape["batch"], args.g, shape["prompts"]),
        },
        "summary": result_summary,
        "targets": summary.check_targets(result_summary, bench),
        "runs": measured["runs"],
    }
    if measured["regime_runs"]:
        regime_runs = measured["regime_runs"]
        result["regime"] = {**regime_runs, "summary": regime.summarize(regime_runs["runs"], bench)}
    text = report.write(result, out, bench)
    print()
    print(text)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    return 0
