"""The tool-use testbed's stored curves and every number its evidence page reports (docs/evidence.md, "Agents that
lose their tool"; docs/evidence/tool_use_pilot.md).

    python scripts/tool_use_evidence.py export results/tool_use_pilot/study docs/evidence/tool_use_pilot/study.csv
    python scripts/tool_use_evidence.py report docs/evidence/tool_use_pilot/*.csv

``export`` keeps, from each run's metrics file (``metrics/<run>.jsonl`` of an ``armor-trl study`` folder, or a JSONL
of the same records), the columns the page uses, one row per logged step: a small CSV anyone can recompute from.
``report`` reads such CSVs and prints, per run: held-out avg@4 and tool-call rate at step 0 and at the end, the area
under the held-out curve, the training reward's mean over the first and the last 20 steps, the anchors' and the
on-policy rows' tool-calling shares (ARMOR runs, averaged over the rounds that had such rows), and the pilot's
criterion (GRPO lost the tool: held-out tool-call rate at the end below half its start, held-out accuracy below its
start, training reward up).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from pathlib import Path

COLUMNS = ("reward", "armor/policy_reward_mean", "val/avg@4", "val/tool_call_rate", "val/tool_calls", "val/mode/tool",
           "val/train/avg@4", "val/train/tool_call_rate", "val/train/mode/tool", "armor/anchor_mode/tool",
           "armor/policy_mode/tool", "armor/anchor_mode/1_digit/tool", "armor/policy_mode/1_digit/tool",
           "armor/anchor_found_frac", "armor/anchor_tool_call_frequency", "armor/policy_tool_call_frequency",
           "tools/call_frequency", "tools/failure_frequency", "kl")
TAGS = ("run", "arm", "warmup_seed", "seed")
WINDOW = 20  # steps: the training reward's first and last means


def export(folder: Path, out: Path) -> None:
    files = sorted((folder / "metrics").glob("*.jsonl")) if folder.is_dir() else [folder]
    rows = []
    for path in files:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            kept = {k: record[k] for k in COLUMNS if isinstance(record.get(k), (int, float))}
            if kept:
                rows.append({**{k: record.get(k, path.stem if k == "run" else "") for k in TAGS},
                             "step": record["step"], **kept})
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*TAGS, "step", *COLUMNS])
        writer.writeheader()
        writer.writerows(rows)
    print(f"{out}: {len(rows)} rows of {len(files)} runs")


def read_runs(paths: list[Path]) -> dict:
    runs: dict[str, dict] = {}
    for path in paths:
        with open(path) as f:
            for row in csv.DictReader(f):
                run = runs.setdefault(f"{path.stem}/{row['run']}", {"tags": {k: row[k] for k in TAGS}, "series": {}})
                for key in COLUMNS:
                    if row.get(key) not in (None, ""):
                        value = float(row[key])
                        if math.isfinite(value):
                            run["series"].setdefault(key, []).append((int(row["step"]), value))
    for run in runs.values():
        for key in run["series"]:
            run["series"][key].sort()
    return runs


def area(curve: list[tuple[int, float]]) -> float | None:
    """Trapezoid ÷ step span (the study's auc)."""
    if len(curve) < 2:
        return None
    total = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in zip(curve, curve[1:]))
    return total / (curve[-1][0] - curve[0][0])


def run_numbers(series: dict) -> dict:
    val, called = series.get("val/avg@4", []), series.get("val/tool_call_rate", [])
    reward = [v for s, v in series.get("armor/policy_reward_mean") or series.get("reward", []) if s > 0]
    mean = lambda values: statistics.fmean(values) if values else None  # noqa: E731
    numbers = {
        "val_start": val[0][1] if val else None, "val_end": val[-1][1] if val else None, "val_auc": area(val),
        "called_start": called[0][1] if called else None, "called_end": called[-1][1] if called else None,
        "reward_first": mean(reward[:WINDOW]), "reward_last": mean(reward[-WINDOW:]),
        "anchor_tool_share": mean([v for _, v in series.get("armor/anchor_mode/tool", [])]),
        "policy_tool_share": mean([v for _, v in series.get("armor/policy_mode/tool", [])]),
    }
    lost = (None if None in (numbers["called_start"], numbers["called_end"], numbers["val_start"], numbers["val_end"],
                             numbers["reward_first"], numbers["reward_last"])
            else numbers["called_end"] < numbers["called_start"] / 2 and numbers["val_end"] < numbers["val_start"]
            and numbers["reward_last"] > numbers["reward_first"])
    return {**numbers, "lost_the_tool": lost}


def report(paths: list[Path]) -> None:
    runs = read_runs(paths)
    names = ("val_start", "val_end", "val_auc", "called_start", "called_end", "reward_first", "reward_last",
             "anchor_tool_share", "policy_tool_share", "lost_the_tool")
    print("| run | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 1))
    for name, run in runs.items():
        numbers = run_numbers(run["series"])
        cells = ["–" if numbers[k] is None else str(numbers[k]) if isinstance(numbers[k], bool)
                 else f"{numbers[k]:.3f}" for k in names]
        print(f"| {name} | " + " | ".join(cells) + " |")
    study_checks(runs)


def study_checks(runs: dict) -> None:
    """Per arm, the means over runs; the pre-registered falsifiers that the runs at hand decide: (1) plain GRPO lost
    the tool on a majority of its runs, (2, first half) π_ref's held-out tool-call rate at step 0 (the warm checkpoint
    validated before training) is at least 0.3 on every warm checkpoint."""
    by_arm: dict[str, list] = {}
    start_by_warm: dict[str, list] = {}
    for run in runs.values():
        numbers = run_numbers(run["series"])
        by_arm.setdefault(run["tags"]["arm"], []).append(numbers)
        if numbers["called_start"] is not None:
            start_by_warm.setdefault(run["tags"]["warmup_seed"], []).append(numbers["called_start"])
    names = ("val_end", "val_auc", "called_end")
    print("\n| arm | runs | " + " | ".join(f"mean {n}" for n in names) + " | lost the tool |")
    print("|" + "---|" * (len(names) + 3))
    for arm, rows in sorted(by_arm.items()):
        means = [statistics.fmean(r[n] for r in rows) for n in names]
        lost = sum(bool(r["lost_the_tool"]) for r in rows)
        print(f"| {arm} | {len(rows)} | " + " | ".join(f"{m:.3f}" for m in means) + f" | {lost}/{len(rows)} |")
    grpo = by_arm.get("grpo")
    if grpo:
        lost = sum(bool(r["lost_the_tool"]) for r in grpo)
        print(f"\nFalsifier 1 (the testbed shows the failure: GRPO lost the tool on a majority): {lost}/{len(grpo)} "
              f"runs -> {'not triggered' if lost > len(grpo) / 2 else 'TRIGGERED'}")
    starts = {w: statistics.fmean(v) for w, v in sorted(start_by_warm.items())}
    if starts:
        low = [w for w, v in starts.items() if v < 0.3]
        print("Falsifier 2, first half (pi_ref's held-out tool-call rate at step 0 >= 0.3 on every warm checkpoint): "
              + ", ".join(f"warm {w}: {v:.3f}" for w, v in starts.items())
              + f" -> {'TRIGGERED' if low else 'not triggered'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export", help="a study folder (or one metrics JSONL) -> a compact CSV")
    exporting.add_argument("folder", type=Path)
    exporting.add_argument("out", type=Path)
    reporting = commands.add_parser("report", help="the page's numbers from the CSVs")
    reporting.add_argument("csv", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "export":
        export(args.folder, args.out)
    else:
        report(args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
