"""The tool-use testbed's stored curves and every number its evidence page reports (docs/evidence.md, "Agents that
lose their tool"; docs/evidence/tool_use_pilot.md).

    python scripts/tool_use_evidence.py export results/tool_use_pilot/study docs/evidence/tool_use_pilot/study.csv
    python scripts/tool_use_evidence.py report docs/evidence/tool_use_pilot/*.csv
    python scripts/tool_use_evidence.py store results/tool_use_study_epyc docs/evidence/tool_use_study_epyc
    python scripts/tool_use_evidence.py restore docs/evidence/tool_use_study_epyc results/tool_use_study_epyc
    python scripts/tool_use_evidence.py compare RUN_A.jsonl RUN_B.jsonl.gz
    python scripts/tool_use_evidence.py report docs/evidence/tool_use_study_epyc/runs.csv \
        --summary docs/evidence/tool_use_study_epyc/summary.json

``export`` keeps, from each run's metrics file (``metrics/<run>.jsonl`` of an ``armor-trl study`` folder, or a JSONL
of the same records), the columns the page uses, one row per logged step: a small CSV anyone can recompute from.
``report`` reads such CSVs and prints, per run: held-out avg@4 and tool-call rate at step 0 and at the end, the area
under the held-out curve, the training reward's mean over the first and the last 20 steps, the anchors' and the
on-policy rows' tool-calling shares (ARMOR runs, averaged over the rounds that had such rows), and the two halves of
the pre-registered falsifier 1 per run: "lost the tool" (the final held-out tool-call rate below half its step-0 value)
and "reward rose" (the training reward's mean over the last 20 steps above the first 20 steps', windows in steps);
with ``--summary``, the numbers the pages take from the study's summary.json. ``store`` and ``restore`` move a study
folder's record (warm checkpoints included) to and from its committed evidence folder, so that a study resumes on
another machine from what has landed.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import shutil
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


STUDY_FILES = ("study.json", "summary.json", "summary.md", "curves.png", "kl.png", "modes.png", "reference.png")


def store(folder: Path, evidence: Path) -> None:
    """A study folder's record into the evidence folder: study.json, the summary and plots, the stored warm
    checkpoints (``warm/``), every finished run's metrics gzipped (``metrics/<run>.jsonl.gz``) and their curves as
    one CSV (``runs.csv``). Run after each finished run lands: committed, it is what a later start resumes from."""
    (evidence / "metrics").mkdir(parents=True, exist_ok=True)
    for name in STUDY_FILES:
        if (folder / name).is_file():
            shutil.copy2(folder / name, evidence / name)
    if (folder / "warm").is_dir():
        shutil.copytree(folder / "warm", evidence / "warm", dirs_exist_ok=True)
    files = sorted((folder / "metrics").glob("*.jsonl"))
    for path in files:
        with open(path, "rb") as src, open(evidence / "metrics" / f"{path.name}.gz", "wb") as raw:
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as dst:  # the same bytes every time
                shutil.copyfileobj(src, dst)
    export(folder, evidence / "runs.csv")


def restore(evidence: Path, folder: Path) -> None:
    """The inverse of :func:`store`, for resuming on another machine: study.json, the warm checkpoints and the
    finished runs' metrics into the study folder; a file the folder already has is left as it is."""
    (folder / "metrics").mkdir(parents=True, exist_ok=True)
    if (evidence / "study.json").is_file() and not (folder / "study.json").exists():
        shutil.copy2(evidence / "study.json", folder / "study.json")
    for stored in sorted((evidence / "warm").glob("warm*")) if (evidence / "warm").is_dir() else []:
        if not (folder / "warm" / stored.name).exists():
            shutil.copytree(stored, folder / "warm" / stored.name)
    restored = 0
    for path in sorted((evidence / "metrics").glob("*.jsonl.gz")):
        target = folder / "metrics" / path.name[: -len(".gz")]
        if not target.exists():
            with gzip.open(path, "rb") as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            restored += 1
    print(f"{folder}: {restored} runs restored")


def _records(path: Path) -> list[dict]:
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        return [json.loads(line) for line in f if line.strip()]


def _timing(key: str) -> bool:  # wall-clock values, which differ between any two runs
    return "time" in key or "per_second" in key


def compare(first: Path, second: Path) -> int:
    """Two runs' metrics files, value by value (wall-clock values aside): the check that a rerun at another commit
    trained the same (0 differing values) or by how much it did not. Returns the number of differing values."""
    a, b = _records(first), _records(second)
    compared, differing = 0, []
    for x, y in zip(a, b):
        for key in sorted(set(x) | set(y)):
            if key in TAGS or _timing(key):
                continue
            compared += 1
            if x.get(key) != y.get(key):
                differing.append((x.get("step"), key, x.get(key), y.get(key)))
    print(f"{first} vs {second}: {len(a)} and {len(b)} logged records, {compared} values compared, "
          f"{len(differing)} differ" + (f" (first: step {differing[0][0]} {differing[0][1]}: {differing[0][2]} vs "
                                        f"{differing[0][3]})" if differing else ""))
    return len(differing) + abs(len(a) - len(b))


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
    reward = [(s, v) for s, v in series.get("armor/policy_reward_mean") or series.get("reward", []) if s > 0]
    last_step = max((s for curve in series.values() for s, _ in curve), default=0)
    mean = lambda values: statistics.fmean(values) if values else None  # noqa: E731
    # windows in steps, as registered: a run that logs its reward every other step has 10 values in each
    numbers = {
        "val_start": val[0][1] if val else None, "val_end": val[-1][1] if val else None, "val_auc": area(val),
        "called_start": called[0][1] if called else None, "called_end": called[-1][1] if called else None,
        "reward_first": mean([v for s, v in reward if s <= WINDOW]),
        "reward_last": mean([v for s, v in reward if s > last_step - WINDOW]),
        "anchor_tool_share": mean([v for _, v in series.get("armor/anchor_mode/tool", [])]),
        "policy_tool_share": mean([v for _, v in series.get("armor/policy_mode/tool", [])]),
    }
    # the two halves of falsifier 1, per run: the final held-out tool-call rate below half its step-0 value ("lost
    # the tool"), and the training reward's last 20 steps above its first 20
    lost = (None if None in (numbers["called_start"], numbers["called_end"])
            else numbers["called_end"] < numbers["called_start"] / 2)
    rose = (None if None in (numbers["reward_first"], numbers["reward_last"])
            else numbers["reward_last"] > numbers["reward_first"])
    return {**numbers, "lost_the_tool": lost, "reward_rose": rose}


def report(paths: list[Path], summary: Path | None = None) -> None:
    runs = read_runs(paths)
    record = json.loads(summary.read_text()) if summary else {}
    tuning = set(record.get("tuning_seeds") or ())
    for run in runs.values():  # a tuning run and a reporting run of the same arm are counted apart
        if int(run["tags"]["seed"]) in tuning:
            run["tags"] = {**run["tags"], "arm": f"{run['tags']['arm']} (tuning)"}
    names = ("val_start", "val_end", "val_auc", "called_start", "called_end", "reward_first", "reward_last",
             "anchor_tool_share", "policy_tool_share", "lost_the_tool", "reward_rose")
    print("| run | " + " | ".join(names) + " |")
    print("|" + "---|" * (len(names) + 1))
    for name, run in runs.items():
        numbers = run_numbers(run["series"])
        cells = ["–" if numbers[k] is None else str(numbers[k]) if isinstance(numbers[k], bool)
                 else f"{numbers[k]:.3f}" for k in names]
        print(f"| {name} | " + " | ".join(cells) + " |")
    study_checks(runs)
    if record:
        summary_numbers(record)


def _interval(c: dict) -> str:
    return (f"{c['mean']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}] {c['verdict']}"
            f"{', sign on every warm checkpoint' if c.get('sign_holds_on_every_warm') else ''}; per warm "
            + ", ".join(f"{w}: {v:+.3f}" for w, v in c["per_warm"].items()))


def summary_numbers(record: dict) -> None:
    """The numbers the pages take from the study's summary.json: the tuning's scores and choices, the comparisons'
    intervals (accuracy and the tool-call rate), the warm checkpoints' hashes and the runs' wall times."""
    for alias, choice in (record.get("selection") or {}).items():
        print(f"\nTuning of {alias} (mean held-out area on the tuning seeds; per warm checkpoint): chose "
              f"{choice['chosen']}")
        for arm, score in choice["scores"].items():
            print(f"  {arm}: {score['mean']:.4f} (" + ", ".join(f"{w}: {v:.4f}" for w, v in score["per_warm"].items())
                  + ")")
    mechanism = {(m["arm"], m["baseline"]): m for m in record.get("mechanism") or []}
    for kind in ("primary", "secondary"):
        for comparison in record.get(kind) or []:
            pair = (comparison["arm"], comparison["baseline"])
            print(f"\n{kind}: {pair[0]} - {pair[1]}")
            for metric in ("final", "auc"):
                print(f"  {metric}: {_interval(comparison['metrics'][metric])}")
            for name, c in (mechanism.get(pair) or {}).get("sets", {}).items():
                print(f"  final tool-call rate ({name}): {_interval(c)}")
    for warm in record.get("warmups") or []:
        print(f"\nwarm checkpoint {warm['seed']}: weights sha256 {warm.get('weights_sha256', 'not recorded')}")
    times: dict[str, list] = {}
    for run in record.get("runs") or []:
        times.setdefault(f"{run['arm']}{' (tuning)' if run['tuning'] else ''}", []).append(run["wall_time_s"])
    if times:
        machine = record.get("machine", {})
        print(f"\nRun wall times (s) on {machine.get('cpu_model')}, {machine.get('cpu_cores')} cores, "
              f"{record.get('workers')} runs at a time:")
        for arm, values in sorted(times.items()):
            print(f"  {arm}: mean {statistics.fmean(values):.0f}, {min(values):.0f}-{max(values):.0f} ({len(values)} runs)")


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
    print("\n| arm | runs | " + " | ".join(f"mean {n}" for n in names) + " | lost the tool | reward rose |")
    print("|" + "---|" * (len(names) + 4))
    for arm, rows in sorted(by_arm.items()):
        means = [statistics.fmean(r[n] for r in rows) for n in names]
        lost = sum(bool(r["lost_the_tool"]) for r in rows)
        rose = sum(bool(r["reward_rose"]) for r in rows)
        print(f"| {arm} | {len(rows)} | " + " | ".join(f"{m:.3f}" for m in means)
              + f" | {lost}/{len(rows)} | {rose}/{len(rows)} |")
    grpo = by_arm.get("grpo")
    if grpo:
        lost = sum(bool(r["lost_the_tool"]) for r in grpo)
        rose = sum(bool(r["reward_rose"]) for r in grpo)
        shown = lost > len(grpo) / 2 and rose > len(grpo) / 2
        print(f"\nFalsifier 1 (the testbed shows the failure), its two majorities over GRPO's runs: final held-out "
              f"tool-call rate below half its step-0 value in {lost}/{len(grpo)}; training reward's last {WINDOW} steps "
              f"above its first {WINDOW} in {rose}/{len(grpo)} -> {'not triggered' if shown else 'TRIGGERED'}")
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
    reporting.add_argument("--summary", type=Path, help="the study's summary.json: tuning and reporting runs apart, "
                           "the tuning's scores, the comparisons' intervals, the warm checkpoints' hashes, run times")
    for name, helptext in (("store", "a study folder -> its evidence folder (record, warm checkpoints, gzipped runs)"),
                           ("restore", "an evidence folder -> a study folder to resume (nothing there overwritten)")):
        command = commands.add_parser(name, help=helptext)
        command.add_argument("source", type=Path)
        command.add_argument("target", type=Path)
    comparing = commands.add_parser("compare", help="two runs' metrics files, value by value (wall times aside)")
    comparing.add_argument("first", type=Path)
    comparing.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    if args.command == "compare":
        return 1 if compare(args.first, args.second) else 0
    if args.command == "export":
        export(args.folder, args.out)
    elif args.command == "store":
        store(args.source, args.target)
    elif args.command == "restore":
        restore(args.source, args.target)
    else:
        report(args.csv, args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
