"""The bench's tables: one bench run each, written to a file under docs/ and copied into the pages between its
markers. The current bench table (bench.yaml's ``bench_table``, ``make bench-table``) goes to ``docs/bench_table.md``
and into docs/performance.md between ``<!-- bench-table:start -->`` and ``<!-- bench-table:end -->`` (README.md quotes
a few of its cells in its cost sentence; tests/test_docs.py checks them against the table);
the further tables of ``bench_tables`` (``tools``: ARMOR on TRL's tool loop, ``make bench-tools``; ``dynamic_vllm``:
DAPO's loop on TRL's colocated vLLM engine, ``make bench-dynamic-vllm``) each to their own file and region of
docs/performance.md.

    python -m benchmarks.table run [--table NAME] [bench arguments]   # the bench with the table's arguments, then write
    python -m benchmarks.table write [--table NAME] results/bench_table/bench.json   # write a table from a saved run
    python -m benchmarks.table sync                     # copy every table's file into its pages

A run of another preset than ``full`` (``--smoke``) writes its table next to its bench.json only: the pages quote
measurements. tests/test_docs.py keeps the pages' copies equal to the files.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import config, floor

REPO = Path(__file__).resolve().parents[1]
MAIN = "main"


@dataclass(frozen=True)
class Spec:
    """Where a table goes: its file, its pages' region markers, the make target that measures it."""

    name: str
    file: Path
    marker: str
    pages: tuple
    make: str
    out: Path

    @property
    def start(self) -> str:
        return f"<!-- {self.marker}:start -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.marker}:end -->"

    @property
    def generated(self) -> str:
        return (f"<!-- written by `make {self.make}` (benchmarks/table.py); edit benchmarks/bench.yaml or the code, "
                "not this -->")

    @property
    def not_measured(self) -> str:
        return (f"{self.generated}\n\n**Not yet measured on the current code.** `make {self.make}` measures this table "
                "on a quiet machine and writes it here.")


MAIN_SPEC = Spec(MAIN, Path("docs") / "bench_table.md", "bench-table", (Path("docs") / "performance.md",),
                 "bench-table", Path("results") / "bench_table")
# the main table's names, as before further tables existed
TABLE_FILE, PAGES, START, END, OUT = MAIN_SPEC.file, MAIN_SPEC.pages, MAIN_SPEC.start, MAIN_SPEC.end, MAIN_SPEC.out
GENERATED, NOT_MEASURED = MAIN_SPEC.generated, MAIN_SPEC.not_measured


def spec_of(bench: config.BenchConfig, name: str = MAIN) -> Spec:
    if name == MAIN:
        return MAIN_SPEC
    if name not in bench.tables:
        raise ValueError(f"no bench table {name!r}: bench.yaml's bench_tables has {sorted(bench.tables)} (and {MAIN!r})")
    raw = bench.tables[name]
    return Spec(name, Path(raw["file"]), raw["marker"], tuple(Path(p) for p in raw.get("pages", ["docs/performance.md"])),
                raw["make"], Path(raw.get("out", f"results/bench_table_{name}")))


def table_settings(bench: config.BenchConfig, name: str = MAIN) -> dict:
    return bench.table if name == MAIN else bench.tables[name]


def specs(bench: config.BenchConfig) -> list:
    return [MAIN_SPEC] + [spec_of(bench, name) for name in bench.tables]


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


def provenance(result: dict, spec: Spec = MAIN_SPEC) -> str:
    meta, regime = result["meta"], result["regime"]
    loads = [max(run["load"]) for run in regime["runs"] if "load" in run]
    commit = meta.get("commit") or "an unrecorded commit"
    if meta.get("commit_at_end") not in (None, meta.get("commit")):  # the checkout changed during the run
        commit += f" (at {meta['commit_at_end']} when it ended)"
    engine = "TRL's colocated vLLM engine" if meta.get("vllm") else "transformers generation"
    return (f"Measured by `make {spec.make}` at commit {commit} on {meta.get('cpu_model', 'an unrecorded CPU')} "
            f"({meta['cpus']} CPUs), {meta['time'][:10]}: {_count(regime['meta']['reps'], 'repetition')} per variant and M, "
            f"1-min load {_f(min(loads))}–{_f(max(loads))} around the runs, {engine}, the bench's tiny model "
            f"(hidden {meta['hidden']}, {_count(meta['layers'], 'layer')}, G = {meta['g']}, K = {meta['k']}, "
            f"{regime['meta']['batch']} rows per optimizer step)"
            + ("" if meta.get("mixed_share") is None else f", mixed share {meta['mixed_share']} in DAPO's loop")
            + f"; the whole run took {meta['wall_s'] / 60:.0f} minutes.")


FLOOR_TEXT = {
    "loop": ("ARMOR in DAPO's loop against its floor (measured / floor; the floor is `grpo_dynamic`'s step plus the "
             "candidate rows, the groups the gate drops and π_ref's forward over the rows that train, priced at the same "
             "run's costs per row; the model is in docs/performance.md, \"The floor of ARMOR in DAPO's loop\"):"),
    "tools": ("ARMOR on TRL's tool loop against its floor (measured / floor; the floor is the base's step, GRPO with "
              "the same tools, plus the candidate rows at the base's cost per trajectory over all its turns, less the "
              "anchor slots' rows ARMOR does not generate, plus π_ref's forward where the base has none; the model is "
              "in docs/performance.md, \"The floor of ARMOR on TRL's tool loop\"):"),
}


def render(result: dict, bench: config.BenchConfig, name: str = MAIN) -> str:
    """A table's markdown (what goes between the markers) from a bench run's result."""
    spec, settings = spec_of(bench, name), table_settings(bench, name)
    regime, ms = result["regime"], [str(m) for m in result["regime"]["meta"]["mini_batches"]]
    summary = regime["summary"]
    # the floors again from the saved runs (a run saved before a part of the floor's report existed gets it)
    floor.add(summary, regime["runs"], bench, result["meta"]["g"], regime["meta"]["batch"])
    lines = [spec.generated, "", provenance(result, spec), "",
             "Cost per optimizer step at M optimizer steps per rollout batch, against the row's base at the same M "
             "(ratio of medians, paired range over repetitions); the bases' own seconds per optimizer step are given.",
             "", "| variant | against | " + " | ".join(f"M = {m}" for m in ms) + " |", "|---|---|" + "---|" * len(ms)]
    floors = {kind: [] for kind in FLOOR_TEXT}
    for row in settings["rows"]:
        variant, base = row["variant"], row["base"]
        by_m = summary.get(variant)
        if by_m is None:
            continue
        cells = [f"{_f(by_m[m]['cost_per_step_s']['median'], 3)} s" if variant == base else _ratio(by_m[m], base)
                 if m in by_m else "—" for m in ms]
        lines.append(f"| {row['label']} (`{variant}`) | {'—' if variant == base else f'`{base}`'} | "
                     + " | ".join(cells) + " |")
        kinds = {by_m[m]["floor"].get("kind", "loop") for m in ms if "floor" in by_m.get(m, {})}
        for kind in kinds:
            floors[kind].append(f"| `{variant}` | " + " | ".join(
                _f(by_m[m]["floor"]["measured_over_floor"]) if "floor" in by_m.get(m, {}) else "—" for m in ms) + " |")
    for kind, rows in floors.items():
        if rows:
            lines += ["", FLOOR_TEXT[kind], "", "| variant | " + " | ".join(f"M = {m}" for m in ms) + " |",
                      "|---|" + "---|" * len(ms), *rows]
    lines += floor.parts_table(summary)
    return "\n".join(lines)


def splice(text: str, block: str, page: Path, spec: Spec = MAIN_SPEC) -> str:
    """``text`` with its table region replaced by ``block``; a clear error when the region is missing."""
    start, end = text.find(spec.start), text.find(spec.end)
    if start < 0 or end < start:
        raise ValueError(f"{page} has no {spec.marker} region: add the line {spec.start}, then the line {spec.end}, "
                         f"where the table belongs; `make {spec.make}` writes between them.")
    return text[: start + len(spec.start)] + "\n" + block.strip() + "\n" + text[end:]


def region(text: str, spec: Spec = MAIN_SPEC) -> str | None:
    """What a page holds between the markers (None: no region)."""
    start, end = text.find(spec.start), text.find(spec.end)
    return None if start < 0 or end < start else text[start + len(spec.start): end].strip()


def sync(root: Path = REPO, only: Spec | None = None) -> None:
    """Copy each table's file (``only``: that table's) into its pages' regions (every page checked before any is
    written)."""
    chosen = [only] if only is not None else specs(config.load())
    updated = {}
    for spec in chosen:
        block = (root / spec.file).read_text()
        for page in spec.pages:
            updated[page] = splice(updated.get(page, (root / page).read_text()), block, page, spec)
    for page, text in updated.items():
        (root / page).write_text(text)


def check_pages(root: Path = REPO, spec: Spec = MAIN_SPEC) -> None:
    for page in spec.pages:
        splice((root / page).read_text(), "", page, spec)


def write(result_path: Path, root: Path = REPO, name: str = MAIN) -> Path:
    """A table from a saved run: into its file and pages for a ``full`` run, else next to the run."""
    bench = config.load()
    spec = spec_of(bench, name)
    result = json.loads(result_path.read_text())
    block = render(result, bench, name)
    if result["meta"]["mode"] != "full":
        target = result_path.parent / spec.file.name
        target.write_text(block + "\n")
        print(f"a {result['meta']['mode']} run: wrote {target} only (the pages quote full runs)")
        return target
    check_pages(root, spec)
    (root / spec.file).write_text(block + "\n")
    sync(root, spec)
    readme = "; README.md quotes some of its cells in its cost sentence: update them (tests/test_docs.py checks them)"
    print(f"wrote {root / spec.file} and its copies in {', '.join(map(str, spec.pages))}"
          + (readme if spec.name == MAIN else ""))
    return root / spec.file


def bench_arguments(bench: config.BenchConfig, out: Path, name: str = MAIN) -> list:
    settings = table_settings(bench, name)
    configs = ",".join(dict.fromkeys(n for row in settings["rows"] for n in (row["base"], row["variant"])))
    return ["--configs", configs, *shlex.split(settings["arguments"]), "--out", str(out)]


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the bench for a table, then write it (further arguments go to the bench)")
    run.add_argument("--out", default=None, help="the run's directory (default: the table's, under results/)")
    run.add_argument("--table", default=MAIN, help="which table: main (bench_table) or a name of bench_tables")
    write_parser = sub.add_parser("write", help="write a table from a saved bench.json")
    write_parser.add_argument("result")
    write_parser.add_argument("--table", default=MAIN)
    sub.add_parser("sync", help="copy every table's file into its pages")
    args, extra = parser.parse_known_args(argv)
    if args.command == "sync":
        sync()
    elif args.command == "write":
        write(Path(args.result), name=args.table)
    else:
        from benchmarks import cli

        bench = config.load()
        spec = spec_of(bench, args.table)
        smoke = "--smoke" in extra or ("--preset" in extra and extra[extra.index("--preset") + 1 :][:1] != ["full"])
        if not smoke and "--dry-run" not in extra:
            check_pages(spec=spec)  # before a run of many minutes, not after it
        out = Path(args.out) if args.out else spec.out
        status = cli.main(bench_arguments(bench, out, args.table) + extra)
        if status or "--dry-run" in extra:
            return status
        write(out / "bench.json", name=args.table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
