"""Docs that stay true: every test a page cites exists, every row of docs/bad_input.md names tests that exist and
exercise what the row is about, the demo has one name, the accelerate configs say how to run them, and the versions
the README states are the ones installed."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_TESTED = "not tested"


def test_sources() -> dict[str, tuple[str, dict[str, str]]]:
    """{module file: (its source, {test function: its source with decorators})} of tests/test_*.py."""
    found = {}
    for path in sorted((REPO / "tests").glob("test_*.py")):
        text = path.read_text()
        lines = text.splitlines()
        functions = {}
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                functions[node.name] = "\n".join(lines[start - 1:node.end_lineno])
        found[path.name] = (text, functions)
    return found


test_sources.__test__ = False  # a helper, not a test
TESTS = test_sources()


def cited_tests(text: str) -> list[tuple[str, str | None, str | None]]:
    """(module, function or glob or None, parametrize id or None) for each backticked test reference in ``text``:
    `test_x.py`, `test_x.py::name[id]`, and `::name[id]` in the module named before."""
    cited, module = [], None
    for token in re.findall(r"`([^`]+)`", text):
        match = re.fullmatch(r"(test_\w+\.py)(?:::([\w*]+))?(?:\[([\w-]+)\])?", token)
        if match:
            module = match.group(1)
            cited.append((module, match.group(2), match.group(3)))
            continue
        match = re.fullmatch(r"::([\w*]+)(?:\[([\w-]+)\])?", token)
        if match:
            cited.append((module, match.group(1), match.group(2)))
    return cited


def resolve(module: str | None, function: str | None, param: str | None, where: str) -> list[str]:
    """The sources the reference names (the module's, or each matching function's); fails naming ``where``."""
    assert module in TESTS, f"{where}: cites {module}, which is not a test module"
    text, functions = TESTS[module]
    if function is None:
        return [text]
    names = fnmatch.filter(functions, function) if "*" in function else [function] * (function in functions)
    assert names, f"{where}: cites {module}::{function}, which does not exist"
    if param is not None:
        assert any(f'"{param}"' in functions[n] or f"'{param}'" in functions[n] or f'"{param}"' in text
                   for n in names), f"{where}: cites {module}::{function}[{param}]: no such parametrize id"
    return [functions[n] for n in names]


def test_every_test_cited_in_the_docs_exists():
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for module, function, param in cited_tests(line):
                if module is None:  # `::name` with no module before it on the line
                    pytest.fail(f"{page.name}:{number}: ::{function} without a test module before it")
                resolve(module, function, param, f"{page.name}:{number}")


def bad_input_rows() -> list[tuple[str, str, str]]:
    """(number, bad input, test cell) of each row of docs/bad_input.md."""
    rows = []
    for line in (REPO / "docs" / "bad_input.md").read_text().splitlines():
        if re.match(r"\| \d+ \|", line):
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            rows.append((cells[0], cells[1], cells[-1]))
    return rows


def subject_words(bad_input: str) -> set[str]:
    """The names a row is about: identifiers inside its backticked terms (fields, flags, functions)."""
    words = set()
    for term in re.findall(r"`([^`]+)`", bad_input):
        words |= {w for w in re.findall(r"[A-Za-z_]\w{3,}", term) if w not in {"True", "False", "None"}}
    return words


def test_every_bad_input_row_is_checked_by_the_tests_it_names():
    """Each row names tests that exist (or says it is not tested), and the tests it names exercise the row's subject:
    at least one of the names the row is about appears in the cited tests' code."""
    rows = bad_input_rows()
    assert [int(number) for number, _, _ in rows] == list(range(1, len(rows) + 1)), "rows are numbered 1, 2, ..."
    previous: list[str] = []
    for number, bad_input, cell in rows:
        where = f"docs/bad_input.md row {number}"
        if cell.startswith(NOT_TESTED):
            continue
        sources = list(previous) if cell.startswith("same") else []  # "same": the row above's tests
        for module, function, param in cited_tests(cell):
            sources += resolve(module, function, param, where)
        assert sources, f"{where}: names no test (write `{NOT_TESTED}` and why, if none)"
        words = subject_words(bad_input)
        if words:
            assert any(w in source for w in words for source in sources), \
                f"{where}: none of {sorted(words)} appears in the tests it names"
        previous = sources


def test_the_demo_has_one_name():
    """`armor-trl --help`, `armor-trl demo --help`, the README and the recipes' headers call the demo what it runs:
    the mode testbed (configs/mode_testbed.yaml)."""
    from armor_trl.app.cli import USAGE
    from armor_trl.app.experiments import demo

    assert demo.DEFAULT_CONFIG.name == "mode_testbed.yaml"
    usage = next(block for block in USAGE.split("\n  ") if block.startswith("demo"))
    assert "mode testbed" in usage and "collapse testbed" not in usage
    assert "mode testbed" in demo.__doc__.splitlines()[0]  # the description of `armor-trl demo --help`
    readme = (REPO / "README.md").read_text()
    make_demo = next(line for line in readme.splitlines() if line.startswith("make demo"))
    assert "the mode testbed" in make_demo
    header = (REPO / "configs" / "tiny_demo.yaml").read_text().split("\nmethod:")[0]
    assert "`armor-trl demo` runs its variant configs/mode_testbed.yaml" in header
    assert "`armor-trl demo` uses its variant configs/collapse_testbed.yaml" not in header


ACCELERATE_CONFIGS = sorted((REPO / "configs" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_configs_say_how_to_run_them(path):
    text = path.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert "train.py" not in text
    command = re.search(r"accelerate launch --config_file (\S+) --num_processes <GPUs> \\\n#\s+-m armor_trl train "
                        r"--config <recipe.yaml>", header)
    assert command and command.group(1) == f"configs/accelerate/{path.name}", header
    values = yaml.safe_load(text)
    for key in ("num_processes", "mixed_precision"):  # placeholders, said so where they stand
        line = next(line for line in text.splitlines() if line.startswith(f"{key}:"))
        assert "# SET:" in line and key in values, line
    assert "placeholders" in header and "--num_processes / --mixed_precision" in header


@pytest.mark.slow
def test_the_ddp_config_runs_as_its_header_says(tmp_path, tiny_model_path):
    """The command of configs/accelerate/ddp.yaml's header, its placeholders set on the command line for this CPU
    (--cpu, which runs one process, and no mixed precision), on a dry run of a tiny recipe: accelerate takes the
    config as written and runs `-m armor_trl train`."""
    import os
    import subprocess
    import sys

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": tiny_model_path, "dataset_name": "arithmetic",
                                      "output_dir": str(tmp_path / "out"), "use_cpu": True, "bf16": False,
                                      "per_device_train_batch_size": 4, "num_generations": 4, "dry_run": True}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           "configs/accelerate/ddp.yaml", "--cpu", "--num_processes", "1", "--mixed_precision", "no",
                           "-m", "armor_trl", "train", "--config", str(recipe)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Recipe OK (dry run, no weights loaded)" in done.stdout


def test_the_versions_the_readme_states_are_the_lock():
    """README's "tested with ..." versions are those of the lock the tests install (requirements/dev.txt; whether
    this venv holds the lock is tests/test_lock.py's question), the README names the lock and the drift check, and
    its version ranges are pyproject's."""
    from packaging.version import Version

    readme = (REPO / "README.md").read_text()
    tested = re.search(r"tested\s+with\s+(.+?)\s+\(CPU\)", readme, flags=re.S)
    assert tested, "README states no 'tested with ... (CPU)' line"
    pairs = re.findall(r"([a-z][\w-]*) (\d+(?:\.\d+)+)", tested.group(1))
    assert {name for name, _ in pairs} >= {"trl", "transformers", "peft", "accelerate", "datasets", "torch"}
    locked = dict(re.findall(r"^([A-Za-z0-9][\w.-]*)==(\S+)", (REPO / "requirements/dev.txt").read_text(), flags=re.M))
    for name, stated in pairs:
        assert Version(locked[name]).public == stated, f"README says {name} {stated}; requirements/dev.txt: {locked[name]}"
    assert "requirements/dev.txt" in readme and "make lock" in readme and "make test-latest" in readme
    pyproject = (REPO / "pyproject.toml").read_text()
    for page in (readme, (REPO / "docs" / "install.md").read_text()):  # the README and its install page
        trl = re.search(r"`(trl>=[^`]+)`", page).group(1)
        assert f'"{trl}"' in pyproject
        low, high = re.search(r"\((\S+) ≤ deepspeed < (\S+),", page).groups()
        assert f'"deepspeed>={low},<{high}"' in pyproject


def test_user_docs_speak_of_machines_a_user_has():
    """No page or recipe speaks of the machines this project was developed on ("the GPU image", "lent GPU machines")
    as if the reader had them."""
    files = [*PAGES, *sorted((REPO / "configs").rglob("*.yaml")), REPO / "Makefile"]
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not re.search(r"GPU image|\bthe image\b|\bimage's\b|\blent\b", line, flags=re.I), \
                f"{path.relative_to(REPO)}:{number}: {line.strip()}"


# What a reader cannot open or place: an internal issue ("issue 44", "issues 9, 10", "#44"; an upstream one is named
# with its repository, TRL#3708) and the project's own history ("main before f471e52", "the last round").
INTERNAL = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w#/-])#\d+\b(?![\w-])|\bmain before\b|\bthe last round\b")
PREREGISTRATIONS = sorted((REPO / "docs" / "preregistration").glob("*.md"))
NOTE = re.compile(r"> \*\*Note added (\d{4}-\d{2}-\d{2}), not part of the registered text\.\*\*")


def user_pages() -> list[Path]:
    """The pages a user reads: the README, the CHANGELOG, every page under docs/ and the notebooks."""
    return [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md")),
            *sorted((REPO / "notebooks").glob("*.ipynb"))]


def prose(text: str) -> str:
    """``text`` without code (fenced blocks, inline spans: `#432` is an answer, not an issue) and link targets."""
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"`[^`\n]*`|\]\([^)\s]*\)", " ", text)


def split_note(path: Path) -> tuple[str, str]:
    """A pre-registration: (the dated note above it, the registered text under it, which is a record and keeps what
    it registered, internal numbers included)."""
    text = path.read_text()
    title = re.search(r"^# Pre-registration", text, flags=re.M)
    return (text[:title.start()], text[title.start():]) if title else ("", text)


def test_no_user_page_names_an_internal_issue_or_the_projects_history():
    """A reader cannot open the project's issue tracker: provenance on a user page is a commit and a machine, history
    is in CHANGELOG.md and git. Pre-registrations keep their registered text, under a note that explains it."""
    found = []
    for page in user_pages():
        if page.suffix == ".ipynb":
            import json

            text = "\n".join("".join(cell["source"]) for cell in json.loads(page.read_text())["cells"])
        else:
            text = split_note(page)[0] if page in PREREGISTRATIONS else page.read_text()
        for number, line in enumerate(prose(text).splitlines(), 1):
            if INTERNAL.search(line):
                found.append(f"{page.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_check_for_internal_issues_finds_them():
    """The check above catches each form it is meant to, and leaves code, links and upstream issues alone."""
    for wrong in ("as issue 44 asked", "(issues 9, 10)", "see #44.", "#44 fixed it", "on main before f471e52",
                  "since the last round"):
        assert INTERNAL.search(prose(wrong)), wrong
    for right in ("the answer `#432`", "its `#### 72` line", "```\n#44\n```", "TRL#3708", "pytest-xdist#1386",
                  "[1c](#1c-tuned)", "[section 1](#1-the-mode)", "## 2. A heading", "the last rounds of a batch"):
        assert not INTERNAL.search(prose(right)), right


# the pre-registrations whose registered text names internal issue numbers (the later ones name none)
NAMING_ISSUES = [p for p in PREREGISTRATIONS if INTERNAL.search(prose(split_note(p)[1]))]


def test_only_the_earlier_preregistrations_name_internal_issues():
    assert [p.name for p in NAMING_ISSUES] == ["mode_testbed.md", "mode_testbed_carry_mix.md",
                                               "mode_testbed_carry_mix_tuned.md"]


@pytest.mark.parametrize("path", NAMING_ISSUES, ids=lambda p: p.name)
def test_each_preregistration_has_a_dated_note_naming_its_registering_commit(path):
    """The registered text is a record: where it names internal issue numbers, a dated note above it says what they
    refer to and names the commit that registered it (the one that added the file); the note itself names no
    internal issue."""
    import subprocess

    note, registered = split_note(path)
    assert registered.startswith("# Pre-registration"), f"{path.name}: the registered text no longer starts the same"
    assert NOTE.match(note), f"{path.name}: no dated note above the registered text"
    assert "issue number" in note and "internal tracker" in note, f"{path.name}: the note does not explain the numbers"
    assert not INTERNAL.search(prose(note))
    added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "--abbrev=7", "--", str(path)], cwd=REPO,
                           capture_output=True, text=True)
    if added.returncode != 0 or not added.stdout.strip():
        pytest.skip("no git history here (an unpacked archive): the registering commit cannot be looked up")
    commit = added.stdout.split()[-1][:7]
    assert f"commit {commit}" in note or f"{commit} (" in note, f"{path.name}: the note does not name {commit}"


def test_files_the_docs_name_exist():
    """A path the docs name in backticks (`benchmarks/run.py`, `scripts/gpu_check.sh`, ...) is in the repository."""
    for page in PAGES:
        for token in re.findall(r"`([^`\s<>*]+)`", page.read_text()):
            if token == "armor_trl/configs":  # configs/ as the wheel ships it (pyproject.toml's package-dir)
                continue
            if re.fullmatch(r"(armor_trl|benchmarks|scripts|configs|tests|notebooks|docs)/[\w./-]*\w", token):
                assert (REPO / token).exists(), f"{page.name} names {token}, which does not exist"


def test_no_page_has_an_empty_section():
    """No heading is followed by nothing before the next heading of its level (or a higher one), and no paragraph
    ending in ':' by nothing before the next heading."""
    for page in PAGES:
        lines = re.sub(r"```.*?```", "code", page.read_text(), flags=re.S).splitlines() + ["# end"]
        for number, line in enumerate(lines[:-1]):
            heading = re.match(r"(#+) ", line)
            rest = next(later for later in lines[number + 1:] if later.strip())
            level = re.match(r"(#+) ", rest)
            if heading and level and len(level.group(1)) <= len(heading.group(1)):
                pytest.fail(f"{page.name}: nothing under {line!r}")
            if not heading and line.rstrip().endswith(":") and level:
                pytest.fail(f"{page.name}: nothing follows {line.strip()!r}")


def _bench_table():
    import sys

    if str(REPO) not in sys.path:  # the benchmarks package lives at the repository root, next to armor_trl
        sys.path.insert(0, str(REPO))
    from benchmarks import table

    return table


# The cells of the bench table the README's cost sentence quotes, in the order it quotes them: online anchors at M = 1
# and 16, anchors from a dataset column at M = 1 and 16, ARMOR's default in DAPO's loop at M = 16.
README_QUOTES = (("armor_full", "M = 1"), ("armor_full", "M = 16"), ("armor_column", "M = 1"),
                 ("armor_column", "M = 16"), ("armor_dynamic_eligible", "M = 16"))
RATIO = re.compile(r"(\d+\.\d\d)×")


def bench_cells(written: str) -> dict[tuple[str, str], str]:
    """{(variant, "M = 4"): "1.11"} for every ratio cell of the bench table (a base's cells are seconds, left out)."""
    lines = written.splitlines()
    header = next(line for line in lines if line.startswith("| variant | against |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")][2:]
    cells = {}
    for line in lines:
        row = re.match(r"\| .*\(`(\w+)`\) \| [^|]+ \|(.*)\|$", line)
        if row:
            for column, cell in zip(columns, row.group(2).split("|")):
                ratio = RATIO.match(cell.strip())
                if ratio:
                    cells[(row.group(1), column)] = ratio.group(1)
    return cells


def readme_paragraphs() -> list[str]:
    """The README's paragraphs, each on one line (outside code blocks)."""
    text = re.sub(r"```.*?```", "", (REPO / "README.md").read_text(), flags=re.S)
    return [" ".join(paragraph.split()) for paragraph in re.split(r"\n\s*\n", text) if paragraph.strip()]


def test_the_pages_quote_the_bench_table_the_bench_wrote():
    """docs/bench_table.md is what `make bench-table` wrote (a measured run with its commit and machine, or the
    statement that none was measured on the current code); docs/performance.md holds it unchanged between the
    bench-table markers. The README holds no copy (nor the bench's variant names): its cost sentence quotes cells of
    the table, each checked against the table, with the table's commit and machine; any other ratio in the README
    names its own commit."""
    table = _bench_table()
    from benchmarks import config
    written = (REPO / table.TABLE_FILE).read_text().strip()
    assert written.startswith(table.GENERATED)
    # "+changes": the tree had uncommitted edits when the bench wrote its table (the README quotes the commit)
    measured = re.search(r"Measured by `make bench-table` at commit (\w+)(?:\+changes)? on (.+?) \((\d+) CPUs\)",
                         written)
    assert measured or written == table.NOT_MEASURED, "docs/bench_table.md is neither a measured table nor the not-measured note"
    if measured:
        assert re.search(r"(\d+) repetitions per variant and M, 1-min load \d\.\d\d–\d\.\d\d", written)
        assert int(re.search(r"(\d+) repetitions", written).group(1)) >= 3
    performance = (REPO / "docs" / "performance.md").read_text()
    assert table.region(performance) == written
    assert performance.index(table.START) < performance.index("\n## ", performance.index("\n## ") + 1), \
        "the bench table is not at the top of docs/performance.md"

    readme = (REPO / "README.md").read_text()
    assert table.region(readme) is None and table.START not in readme, "the README holds a copy of the bench table"
    variants = [name for name in dict.fromkeys(row["variant"] for row in config.load().table["rows"])
                if f"`{name}`" in readme]
    assert not variants, f"the README names the bench's variants {variants}: quote the table in words"
    paragraphs = readme_paragraphs()
    quoting = [paragraph for paragraph in paragraphs if "`make bench-table` at commit" in paragraph]
    if not measured:
        assert not quoting, "the README quotes a bench table, but none is measured on the current code"
        return
    assert len(quoting) == 1, "the README's cost sentence (quoting the bench table) is missing or repeated"
    cost = quoting[0]
    quoted_run = re.search(r"`make bench-table` at commit (\w+) on (.+?) \((\d+) CPUs\)", cost)
    assert quoted_run and quoted_run.groups() == measured.groups(), \
        f"the README's cost sentence names another run than the table's: {quoted_run and quoted_run.group(0)}"
    cells = bench_cells(written)
    assert RATIO.findall(cost) == [cells[quote] for quote in README_QUOTES], \
        (f"the README's cost sentence quotes {RATIO.findall(cost)}; the table's cells {README_QUOTES} are "
         f"{[cells[quote] for quote in README_QUOTES]}")
    sections = [section for page in sorted((REPO / "docs").glob("*.md"))
                for section in re.split(r"\n(?=#+ )", page.read_text())]
    for paragraph in paragraphs:
        if paragraph is not cost and RATIO.search(paragraph):
            commit = re.search(r"\bcommit ([0-9a-f]{7,})", paragraph)
            assert commit and commit.group(1) != measured.group(1), \
                f"a ratio in the README without its own commit (or quoting the bench table unchecked): {paragraph[:160]}"
            sources = [section for section in sections if commit.group(1) in section]
            for ratio in RATIO.findall(paragraph):
                assert any(re.search(rf"(?<![\d.]){re.escape(ratio)}(?!\d)", section) for section in sources), \
                    f"the README quotes {ratio}× from commit {commit.group(1)}; no docs section naming it holds {ratio}"


def test_the_performance_page_quotes_every_further_bench_table_the_bench_wrote():
    """Each of bench.yaml's bench_tables (the tool loop's, DAPO's loop on vLLM) is its file as `make <target>` wrote it
    (a measured run, or the statement that none was measured on the current code), held unchanged in its pages."""
    table = _bench_table()
    from benchmarks import config

    bench = config.load()
    assert set(bench.tables) >= {"tools", "dynamic_vllm"}
    for name in bench.tables:
        spec = table.spec_of(bench, name)
        written = (REPO / spec.file).read_text().strip()
        assert written.startswith(spec.generated), spec.file
        measured = re.search(rf"Measured by `make {spec.make}` at commit (\w+)(?:\+changes)? on (.+?) \((\d+) CPUs\)",
                             written)
        assert measured or written == spec.not_measured, f"{spec.file} is neither a measured table nor the note"
        for page in spec.pages:
            assert table.region((REPO / page).read_text(), spec) == written, (page, name)


def _names_the_docs_show() -> dict[str, set[str]]:
    """{page: the dotted armor_trl names and import lines it shows} over the README, docs/ and the notebook."""
    pages = [*PAGES, *sorted((REPO / "docs").glob("*/*.md")), *sorted((REPO / "notebooks").glob("*.ipynb"))]
    shown = {}
    for page in pages:
        text = page.read_text().replace("\\n", "\n")  # a notebook's cells are JSON strings
        names = set(re.findall(r"armor_trl(?:\.[A-Za-z_]\w*)+", text))
        names |= {line.strip() for line in re.findall(r"^[ \t\"]*((?:from armor_trl[\w.]* import [\w, ]+|import armor_trl[\w.]*))",
                                                       text, re.M)}
        if names:
            shown[str(page.relative_to(REPO))] = names
    return shown


def test_every_import_path_the_docs_show_resolves_without_a_moved_path():
    """The docs move with the code (docs/architecture.md): a dotted name or an import line a page shows imports today,
    and not through a path of the flat layout that only a DeprecationWarning keeps alive."""
    import importlib
    import warnings

    broken = []
    for page, names in _names_the_docs_show().items():
        for name in sorted(names):
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)
                try:
                    if name.startswith(("from ", "import ")):
                        exec(name, {})
                        continue
                    parts = name.split(".")
                    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
                        try:
                            target = importlib.import_module(".".join(parts[:cut]))
                            break
                        except ModuleNotFoundError:
                            continue
                    for attribute in parts[cut:]:
                        target = getattr(target, attribute)
                except Exception as error:  # noqa: BLE001 - every failure is reported with its page
                    broken.append(f"{page}: {name}: {type(error).__name__}: {error}")
    assert not broken, "\n".join(broken)


def test_a_page_that_places_a_variant_in_the_current_table_finds_its_row_there():
    """A sentence that speaks of the current bench table names only variants that have a row in it
    (docs/bench_table.md as `make bench-table` wrote it): a variant added to the bench after the table was measured is
    said to be missing from it, not in it."""
    from benchmarks import config

    bench = config.load()
    names = set(bench.variants) | set(bench.baselines)
    rows = set(re.findall(r"\(`(\w+)`\) \|", (REPO / _bench_table().TABLE_FILE).read_text()))
    assert rows and rows <= names
    found = []
    for page in PAGES:
        for sentence in re.split(r"(?<=[.;])\s+", " ".join(re.sub(r"```.*?```", "", page.read_text(), flags=re.S).split())):
            if re.search(r"current (bench )?table", sentence, flags=re.I):
                found += [f"{page.name}: `{name}` in {sentence[:120]!r}" for name in re.findall(r"`(\w+)`", sentence)
                          if name in names and name not in rows]
    assert not found, "\n".join(found)


def test_the_recipe_fields_of_an_agent_are_documented_with_their_default():
    """`tools` and `tool_failure_rate` (recipe fields, not ArmorConfig's: the tool-use testbed depends on the second)
    are on docs/cli.md and docs/configuration.md, not only in `armor-trl train --help`, the failure rate with its
    default and what a failed call raises."""
    import dataclasses

    from armor_trl.app.recipe.fields import TrainScriptArguments

    defaults = {field.name: field.default for field in dataclasses.fields(TrainScriptArguments)}
    assert defaults["tool_failure_rate"] == 0.0 and defaults["tools"] is None
    for page in ("cli.md", "configuration.md"):
        text = " ".join((REPO / "docs" / page).read_text().split())
        assert "`tools`" in text or "`tools: [" in text, page
        assert re.search(r"`tool_failure_rate` \(default 0\b[^)]*\)[^.]*`TimeoutError`", text), page
