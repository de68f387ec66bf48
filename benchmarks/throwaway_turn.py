"""What the throw-away turns cost: ARMOR on the bench's tool agent in two ZeRO-3 processes (DeepSpeed on the CPU,
gloo), where a process whose tool loop has ended joins the other's generate calls with throw-away turns (one row, one
token: armor_trl.rollout.tool_turns). The turns each process makes depend on what its rows say, so they differ
between processes as in a real run; each process times its throw-away turns against its training's wall time.

    python -m benchmarks.throwaway_turn build --out results/throwaway_turn      # the bench's tool agent, once
    accelerate launch --config_file configs/accelerate/zero3.yaml --num_processes 2 --mixed_precision no \\
        -m benchmarks.throwaway_turn run --out results/throwaway_turn           # OUT/rank{R}.json
    python -m benchmarks.throwaway_turn report --out results/throwaway_turn     # OUT/throwaway_turn.json, a line

``make bench-throwaway`` runs the three (docs/performance.md, "The throw-away turns under ZeRO-3").
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

HIDDEN, LAYERS, SEED = 128, 3, 0  # the bench's tiny model (bench.yaml's full preset)
THRESHOLD = 0.128  # the bench's calibrated anchor threshold for that model (its logs); it sets how many anchors pass


def build(out: Path) -> None:
    """The bench's tool agent (150 warm-start steps), written next to this folder's model path, once: before the
    processes start, so that they do not both build it."""
    from benchmarks import workload

    print("the tool agent:", workload.tool_agent({"model_path": str(out / "model"), "seed": SEED, "hidden": HIDDEN,
                                                  "layers": LAYERS, "threads": 1}))


def run(out: Path, steps: int, rows: int, g: int) -> None:
    import deepspeed.ops
    import torch

    from armor_trl.integration import trl_generation
    from benchmarks import config, workload

    # DeepSpeed's CPU build compiles a shared-memory all-reduce op only tensor-parallel inference uses; ZeRO reduces
    # through torch.distributed (gloo), so the op is marked unavailable rather than compiled (tests/scripts/
    # mp_train_script.py's skip_deepspeed_shm_comm_op)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    bench = config.load()
    rank_file = out / f"rank{int(os.environ.get('RANK', 0))}.json"
    rank_file.unlink(missing_ok=True)  # a failed run leaves no earlier run's record to report
    # the bench's own trainer for armor_tools (its tool agent, prompts, reward and tools), in ZeRO-3 processes
    task = {"model_path": str(out / "model"), "output_dir": str(out / "trainer"), "batch": rows, "g": g,
            "completion": workload.TOOL_COMPLETION, "steps": steps, "lr": 1e-5, "seed": SEED, "k": 4,
            "threshold": THRESHOLD, "prompts": 64, "hidden": HIDDEN, "layers": LAYERS, "threads": 1,
            "training": {"use_cpu": False, "ddp_backend": "gloo"}}
    trainer, _ = workload.build_trainer(task, bench.variants["armor_tools"], bench)
    timed = {"turns": 0, "seconds": 0.0}
    throwaway = trl_generation.throwaway_turn

    def timed_throwaway(*turn_args, **turn_kwargs):
        start = time.perf_counter()
        throwaway(*turn_args, **turn_kwargs)
        timed["seconds"] += time.perf_counter() - start
        timed["turns"] += 1

    trl_generation.throwaway_turn = timed_throwaway
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    record = {"rank": trainer.accelerator.process_index, "steps": trainer.state.global_step, "train_s": train_s,
              "rows": rows, "num_generations": g,
              "throwaway_turns": timed["turns"], "throwaway_s": timed["seconds"],
              "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage,
              "tool_calls": [entry.get("tools/call_frequency") for entry in trainer.state.log_history]}
    rank_file.write_text(json.dumps(record, indent=1))
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def report(out: Path) -> dict:
    from benchmarks.cli import cpu_model, git_commit

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    result = {"commit": git_commit(), "cpu_model": cpu_model(), "cpus": os.cpu_count(), "ranks": ranks,
              "throwaway_share": [r["throwaway_s"] / r["train_s"] for r in ranks],
              "throwaway_ms": [1e3 * r["throwaway_s"] / r["throwaway_turns"] if r["throwaway_turns"] else None
                               for r in ranks]}
    (out / "throwaway_turn.json").write_text(json.dumps(result, indent=1))
    for r, share, ms in zip(ranks, result["throwaway_share"], result["throwaway_ms"]):
        print(f"rank {r['rank']}: {r['throwaway_turns']} throw-away turns in {r['steps']} steps of {r.get('rows')} rows, "
              f"{r['throwaway_s']:.2f} s of {r['train_s']:.1f} s training ({100 * share:.1f}%)"
              + ("" if ms is None else f", {ms:.0f} ms each"))
    return result


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("build", "run", "report"))
    parser.add_argument("--out", default="results/throwaway_turn", help="the folder of the agent and the results")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps of the run")
    # one group per process: the fewer a process's rows, the likelier its loop ends before another's
    parser.add_argument("--rows", type=int, default=4, help="rows per process and optimizer step")
    parser.add_argument("--g", type=int, default=4, help="num_generations")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    {"build": lambda: build(out), "run": lambda: run(out, args.steps, args.rows, args.g), "report": lambda: report(out)}[args.command]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
