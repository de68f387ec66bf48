"""The house (docs/architecture.md): the library a TRL user imports stands apart from the application, its imports
go round no circle, the math imports nothing of the floors above it, the flat layout's import paths still work, and no
module outgrows a room."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

from armor_trl._moved import MOVED

PACKAGE = Path(__file__).resolve().parents[1] / "armor_trl"
APPLICATION = "armor_trl.app"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module `path` imports, at module level or inside functions, relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    return found


def library_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if not module_name(p).startswith(APPLICATION)
            and p.name != "__main__.py"]  # `python -m armor_trl` runs the command: the one door into the application


def test_the_library_never_imports_the_application():
    offences = {module_name(p): sorted(n for n in imported(p) if n == APPLICATION or n.startswith(APPLICATION + "."))
                for p in library_modules()}
    assert not {k: v for k, v in offences.items() if v}, offences


def test_the_library_does_not_reach_the_application_through_the_old_paths():
    """``armor_trl.cli`` / ``recipe`` / ``tiny`` / ... name application modules since the move; a library module that
    imported them by their old names would cross the line unseen by the test above."""
    old_application = {f"armor_trl.{old}" for old, new in MOVED.items() if new.startswith("app.")}
    offences = {module_name(p): sorted(n for n in imported(p) if n.split(".")[:2] and
                                       ".".join(n.split(".")[:2]) in old_application) for p in library_modules()}
    assert not {k: v for k, v in offences.items() if v}, offences


def test_the_line_test_sees_an_import_of_the_application(tmp_path):
    """The parser above finds the forms an offence can take (absolute, relative, inside a function, by string)."""
    folder = PACKAGE / "rollout"
    probe = folder / "_probe_for_the_line_test.py"
    probe.write_text("from ..app import tiny\nimport armor_trl.app.cli\n\ndef f():\n    from armor_trl.app.recipe import x\n"
                     "    importlib.import_module('armor_trl.app.experiments')\n")
    try:
        found = imported(probe)
    finally:
        probe.unlink()
    assert {"armor_trl.app", "armor_trl.app.cli", "armor_trl.app.recipe", "armor_trl.app.experiments"} <= found


def library_graph() -> dict[str, set[str]]:
    """Each library module (packages included) -> the library modules it imports."""
    modules = {module_name(p): p for p in library_modules()}
    return {name: {n for n in imported(path) if n in modules and n != name} for name, path in modules.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles of ``graph``: paths of modules, each leading back to its first (at least one per circle)."""
    circles, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            circles.append(path[path.index(node):] + [node])
        elif node not in done:
            for following in sorted(graph[node]):
                visit(following, path + [node])
            done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return circles


def test_the_library_imports_go_round_no_circle():
    assert import_circles(library_graph()) == []


def test_the_circle_test_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c", "a"]]
    assert import_circles({**graph, "c": set()}) == []


# The math (algorithm/) imports torch, itself and these modules of the standard library only: nothing of TRL, of
# transformers or of the floors above it (integration/, rollout/, reference/, the trainer), which pass it what it needs.
ALGORITHM_MAY_IMPORT = ("torch", "armor_trl.algorithm", "__future__", "math", "typing")


def algorithm_offences(paths: list[Path]) -> dict[str, list[str]]:
    offences = {module_name(p): sorted(n for n in imported(p) if not any(n == allowed or n.startswith(allowed + ".")
                                                                        for allowed in ALGORITHM_MAY_IMPORT))
                for p in paths}
    return {name: names for name, names in offences.items() if names}


def test_the_algorithm_imports_only_torch_and_itself():
    assert algorithm_offences(sorted((PACKAGE / "algorithm").rglob("*.py"))) == {}


def test_the_algorithm_test_sees_a_new_import():
    probe = PACKAGE / "algorithm" / "_probe_for_the_algorithm_test.py"
    probe.write_text("import math\n\nimport torch\n\nfrom . import mixture\nfrom ..integration import trl_seam\n\n"
                     "def f():\n    import numpy\n    from armor_trl.rollout.refill import take_rows\n")
    try:
        offences = algorithm_offences([probe])
    finally:
        probe.unlink()
    assert offences == {"armor_trl.algorithm._probe_for_the_algorithm_test": [
        "armor_trl.integration", "armor_trl.integration.trl_seam", "armor_trl.rollout.refill",
        "armor_trl.rollout.refill.take_rows", "numpy"]}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_import_path_of_the_flat_layout_names_the_moved_module(old):
    new = importlib.import_module(f"armor_trl.{MOVED[old]}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert importlib.import_module(f"armor_trl.{old}") is new
    assert new.__name__ == f"armor_trl.{MOVED[old]}"


def test_the_old_path_warns_with_the_new_one():
    import sys

    sys.modules.pop("armor_trl.launcher", None)
    with pytest.warns(DeprecationWarning, match=r"armor_trl\.launcher moved to armor_trl\.integration\.launcher"):
        importlib.import_module("armor_trl.launcher")


def test_a_module_under_a_moved_package_keeps_its_old_path():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("armor_trl.experiments.stats")
    assert old is importlib.import_module("armor_trl.app.experiments.stats")


def test_an_unknown_submodule_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("armor_trl.no_such_module")


ROOM_LINES = 500
TRAINER_LINES = 450  # the trainer's hooks hand their work to the folders
# the rooms allowed to be larger, each with why (docs/architecture.md)
LARGE_ROOMS = {
    "armor_trl/config.py": "a field list: every ArmorConfig field with its help text, like TRL's GRPOConfig",
}


def test_no_room_outgrows_500_lines_but_the_field_list():
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > ROOM_LINES and name not in LARGE_ROOMS} == {}
    assert set(LARGE_ROOMS) <= set(sizes)  # an exception for a room that no longer exists goes too
    assert sizes["armor_trl/trainer.py"] <= TRAINER_LINES


def test_the_validation_callback_keeps_its_old_import_path():
    """armor_trl.evaluation held ValidationCallback before the move; it lives in callbacks/validation.py now."""
    from armor_trl.callbacks.validation import TRAIN_REWARD_KEYS, ValidationCallback

    with pytest.warns(DeprecationWarning, match="moved to armor_trl.callbacks.validation"):
        from armor_trl.evaluation import ValidationCallback as old
    assert old is ValidationCallback
    with pytest.warns(DeprecationWarning, match="TRAIN_REWARD_KEYS moved to armor_trl.callbacks.validation"):
        from armor_trl.evaluation import TRAIN_REWARD_KEYS as old_keys
    assert old_keys is TRAIN_REWARD_KEYS
    with pytest.raises(ImportError, match="no_such_name"):
        from armor_trl.evaluation import no_such_name  # noqa: F401
