"""The current bench table: one bench run, written to ``docs/bench_table.md`` and copied into docs/performance.md
between the lines ``<!-- bench-table:start -->`` and ``<!-- bench-table:end -->``. README.md quotes a few of its
cells in its cost sentence (tests/test_docs.py checks them against the table).

    python -m benchmarks.table run [bench arguments]   # `make bench-table`: the bench (bench.yaml's bench_table), then write
    python -m benchmarks.table write results/bench_table/bench.json   # write the table from a saved run
    python -m benchmarks.table sync                     # copy docs/bench_table.md into the pages

A run of another preset than ``full`` (``--smoke``) writes its table next to its bench.json only: the pages quote
measurements. tests/test_docs.py keeps the page's copy equal to docs/bench_table.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from benchmarks import config

REPO = Path(__file__).resolve().parents[1]
TABLE_FILE = Path("docs") / "bench_table.md"
PAGES = (Path("docs") / "performance.md",)
START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
OUT = Path("results") / "bench_table"
GENERATED = "<!-- written by `make bench-table` (benchmarks/table.py); edit benchmarks/bench.yaml or the code, not this -->"
NOT_MEASURED = (f"{GENERATED}\n\n**Not yet measured on the current code.** `make bench-table` measures this table on a "
                "quiet machine and writes it here.")


def _f(value, digits=2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _ratio(entry: dict, base: str) -> str:
    ratio = entry.get("vs_" + base)
    if not ratio:
        return "—"
    paired = ratio["step_paired"]
    return f"{ratio['step']:.2f}× ({_f(paired['min'])}–{_f(paired['max'])})"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def provenance(result: dict) -> str:
    meta, regime = result["meta"], result["regime"]
    loads = [max(run["load"]) for run in regime["runs"] if "load" in run]
    commit = meta.get("commit") or "an unrecorded commit"
    engine = "TRL's colocated vLLM engine" if meta.get("vllm") else "transformers generation"
    return (f"Measured by `make bench-table` at commit {commit} on {meta.get('cpu_model', 'an unrecorded CPU')} "
            f"({meta['cpus']} CPUs), {meta['time'][:10]}: {_count(regime['meta']['reps'], 'repetition')} per variant and M, "
            f"1-min load {_f(min(loads))}–{_f(max(loads))} around the runs, {engine}, the bench's tiny model "
            f"(hidden {meta['hidden']}, {_count(meta['layers'], 'layer')}, G = {meta['g']}, K = {meta['k']}, "
            f"{regime['meta']['batch']} rows per optimizer step), mixed share {meta.get('mixed_share')} in DAPO's loop; "
            f"the whole run took {meta['wall_s'] / 60:.0f} minutes.")


def render(result: dict, bench: config.BenchConfig) -> str:
    """The table's markdown (what goes between the markers) from a bench run's result."""
    summary, ms = result["regime"]["summary"], [str(m) for m in result["regime"]["meta"]["mini_batches"]]
    lines = [GENERATED, "", provenance(result), "",
             "Cost per optimizer step at M optimizer steps per rollout batch, against the row's base at the same M "
             "(ratio of medians, paired range over repetitions); the bases' own seconds per optimizer step are given.",
             "", "| variant | against | " + " | ".join(f"M = {m}" for m in ms) + " |", "|---|---|" + "---|" * len(ms)]
    loop = []
    for row in bench.table["rows"]:
        name, base = row["variant"], row["base"]
        by_m = summary.get(name)
        if by_m is None:
            continue
        cells = [f"{_f(by_m[m]['cost_per_step_s']['median'], 3)} s" if name == base else _ratio(by_m[m], base)
                 if m in by_m else "—" for m in ms]
        lines.append(f"| {row['label']} (`{name}`) | {'—' if name == base else f'`{base}`'} | " + " | ".join(cells) + " |")
        if any("floor" in by_m.get(m, {}) for m in ms):
            loop.append(f"| `{name}` | " + " | ".join(
                _f(by_m[m]["floor"]["measured_over_floor"]) if "floor" in by_m.get(m, {}) else "—" for m in ms) + " |")
    if loop:
        lines += ["", "ARMOR in DAPO's loop against its floor (measured / floor; the floor is `grpo_dynamic`'s step "
                  "plus the candidate rows, the groups the gate drops and π_ref's forward over the rows that train, "
                  "priced at the same run's costs per row; the model is in docs/performance.md, \"The floor of ARMOR in DAPO's "
                  "loop\"):",
                  "", "| variant | " + " | ".join(f"M = {m}" for m in ms) + " |", "|---|" + "---|" * len(ms), *loop]
    return "\n".join(lines)


def splice(text: str, block: str, page: Path) -> str:
    """``text`` with its bench-table region replaced by ``block``; a clear error when the region is missing."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{page} has no bench-table region: add the line {START}, then the line {END}, where the "
                         "current bench table belongs; `make bench-table` writes between them.")
    return text[: start + len(START)] + "\n" + block.strip() + "\n" + text[end:]


def region(text: str) -> str | None:
    """What a page holds between the markers (None: no region)."""
    start, end = text.find(START), text.find(END)
    return None if start < 0 or end < start else text[start + len(START): end].strip()


def sync(root: Path = REPO) -> None:
    """Copy docs/bench_table.md into every page's region (every page checked before any is written)."""
    block = (root / TABLE_FILE).read_text()
    updated = {page: splice((root / page).read_text(), block, page) for page in PAGES}
    for page, text in updated.items():
        (root / page).write_text(text)


def check_pages(root: Path = REPO) -> None:
    for page in PAGES:
        splice((root / page).read_text(), "", page)


def write(result_path: Path, root: Path = REPO) -> Path:
    """The table from a saved run: into docs/bench_table.md and the pages for a ``full`` run, else next to the run."""
    bench = config.load()
    result = json.loads(result_path.read_text())
    block = render(result, bench)
    if result["meta"]["mode"] != "full":
        target = result_path.parent / "bench_table.md"
        target.write_text(block + "\n")
        print(f"a {result['meta']['mode']} run: wrote {target} only (the pages quote full runs)")
        return target
    check_pages(root)
    (root / TABLE_FILE).write_text(block + "\n")
    sync(root)
    print(f"wrote {root / TABLE_FILE} and its copies in {', '.join(map(str, PAGES))}; README.md quotes some of its "
          "cells in its cost sentence: update them (tests/test_docs.py checks them)")
    return root / TABLE_FILE


def bench_arguments(bench: config.BenchConfig, out: Path) -> list:
    configs = ",".join(dict.fromkeys(row["variant"] for row in bench.table["rows"]))
    return ["--configs", configs, *shlex.split(bench.table["arguments"]), "--out", str(out)]


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the bench for the table, then write it (further arguments go to the bench)")
    run.add_argument("--out", default=str(OUT))
    sub.add_parser("write", help="write the table from a saved bench.json").add_argument("result")
    sub.add_parser("sync", help="copy docs/bench_table.md into the pages")
    args, extra = parser.parse_known_args(argv)
    if args.command == "sync":
        sync()
    elif args.command == "write":
        write(Path(args.result))
    else:
        from benchmarks import cli

        smoke = "--smoke" in extra or ("--preset" in extra and extra[extra.index("--preset") + 1 :][:1] != ["full"])
        if not smoke and "--dry-run" not in extra:
            check_pages()  # before a run of many minutes, not after it
        out = Path(args.out)
        status = cli.main(bench_arguments(config.load(), out) + extra)
        if status or "--dry-run" in extra:
            return status
        write(out / "bench.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
