"""The layout of tests/: shared helpers in testing.py, fixtures in conftest.py, launch scripts in tests/scripts/,
and no test module importing another (or conftest)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SCRIPTS = TESTS / "scripts"
SUPPORT = {"conftest.py", "testing.py"}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module `path` imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def runs_as_a_script(path: Path) -> bool:
    """Whether the module has an ``if __name__ == "__main__":`` block."""
    return any(
        isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        for node in ast.parse(path.read_text(), filename=str(path)).body
    )


def _test_files() -> list[Path]:
    return sorted(TESTS.glob("test_*.py"))


def test_no_test_module_imports_another_or_conftest():
    offenders = {
        path.name: sorted(name for name in imported_modules(path) if name.startswith("test_") or name == "conftest")
        for path in [*_test_files(), *(TESTS / name for name in SUPPORT), *SCRIPTS.glob("*.py")]
    }
    offenders = {name: modules for name, modules in offenders.items() if modules}
    assert not offenders, f"import shared helpers from testing.py instead: {offenders}"


def test_no_script_lives_among_the_tests():
    others = sorted(p.name for p in TESTS.glob("*.py") if p.name not in SUPPORT and not p.name.startswith("test_"))
    assert not others, f"launch scripts belong in tests/scripts/: {others}"
    runnable = [p.name for p in _test_files() if runs_as_a_script(p)]
    assert not runnable, f"test modules run as scripts: {runnable}"


def test_every_launch_script_is_launched_by_a_test():
    scripts = sorted(p.name for p in SCRIPTS.glob("*.py"))
    assert scripts, "tests/scripts/ holds the scripts the tests launch"
    sources = "\n".join(p.read_text() for p in _test_files())
    assert [name for name in scripts if name not in sources] == []


def test_xdist_groups_are_in_effect(tmp_path):
    """`make test` relies on --dist loadgroup (tests/conftest.py): the tests of a group run on one worker, so launches
    do not pile up and module-scoped runs are made once. With pytest 9.2 and pytest-xdist 3.8 the groups are silently
    ignored (pytest-xdist#1386); pyproject.toml pins pytest below 9.2. This fails if the installed pair does not
    group."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_grouped.py").write_text(
        "import pytest\n\n"
        + "".join(f"@pytest.mark.xdist_group('one')\ndef test_{i}():\n    pass\n\n" for i in range(4))
        + "".join(f"def test_free_{i}():\n    pass\n\n" for i in range(4))
    )
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "test_grouped.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    grouped = re.findall(r"\[(gw\d+)\].*PASSED test_grouped.py::test_\d+(@one)?", done.stdout)
    assert len(grouped) == 4, done.stdout[-2000:]
    assert all(suffix == "@one" for _, suffix in grouped), (
        "pytest-xdist's --dist loadgroup is not grouping with this pytest (pytest-xdist#1386): install the versions "
        "pyproject.toml's test extra pins (make install)")
    assert len({worker for worker, _ in grouped}) == 1, done.stdout[-2000:]
