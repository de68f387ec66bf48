"""The package's layers, read from the source (AST; imports inside functions count as much as top-level ones):

* no import cycle among ``armor_trl`` modules;
* library modules never import the CLI/app layer (the ``armor-trl`` command, the recipe layer that builds a run from
  a YAML file, the experiments) -- the layer is named here, explicitly, not inferred;
* no module imports another module's private (``_name``) helpers.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "armor_trl"
# The CLI/app layer: everything else under armor_trl is library and must not import these.
CLI_LAYER = ("armor_trl.app.cli", "armor_trl.__main__", "armor_trl.app.recipe", "armor_trl.app.experiments")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def package_of(name: str, path: Path) -> str:
    """The package that relative imports in module ``name`` start from."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def resolve(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``from ... import`` names (``from .x import y`` in armor_trl.z -> armor_trl.x)."""
    if node.level == 0:
        return node.module or ""
    base = package_of(name, path).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int, str | None]]:
    """(imported armor_trl module, line, imported name or None) of every import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(name, path, node)
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                # `from . import x` / `from .experiments import study` import a module; otherwise a name of target
                found.append((submodule, node.lineno, None) if submodule in known
                             else (target, node.lineno, alias.name))
    return [(target, line, imported) for target, line, imported in found
            if target == "armor_trl" or target.startswith("armor_trl.")]


def owning_module(target: str, known: set[str]) -> str | None:
    """The armor_trl module of an imported dotted name (``import armor_trl.app.experiments.demo`` -> that module)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {imported module: first line}} over armor_trl, the package's own __init__ excluded as a target only
    when a module imports a name re-exported there (``from armor_trl import ArmorConfig``) -- that is an edge to
    armor_trl itself, which is kept."""
    found = modules()
    known = set(found)
    graph = {}
    for name, path in found.items():
        edges = {}
        for target, line, _ in imports(name, path, known):
            target = owning_module(target, known)
            if target is not None and target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def describe(cycle: list[str], graph) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def in_cli_layer(name: str) -> bool:
    return any(name == layer or name.startswith(layer + ".") for layer in CLI_LAYER)


def test_the_graph_sees_relative_absolute_and_function_level_imports(tmp_path, monkeypatch):
    package = tmp_path / "armor_trl"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from .b import g\n")                # lazy, relative
    (package / "b.py").write_text("import armor_trl.sub.c\n")                       # absolute
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text("from .. import a\nfrom ..b import _hidden\n")  # parent package
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    graph = import_graph()
    assert graph["armor_trl.a"] == {"armor_trl.b": 2}
    assert graph["armor_trl.b"] == {"armor_trl.sub.c": 1}
    assert graph["armor_trl.sub.c"] == {"armor_trl.a": 1, "armor_trl.b": 2}
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {"armor_trl.a", "armor_trl.b", "armor_trl.sub.c"}
    assert private_imports() == ["armor_trl.sub.c line 2: from armor_trl.b import _hidden"]


def test_no_import_cycle_among_armor_trl_modules():
    graph = import_graph()
    assert len(graph) > 20 and "armor_trl.app.cli" in graph  # the real package was read
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {describe(cycle, graph)}"


def test_library_modules_never_import_the_cli_layer():
    graph = import_graph()
    assert all(layer in graph for layer in CLI_LAYER)  # the layer named above exists
    offending = [f"{name} imports {target} (line {line})" for name, edges in sorted(graph.items())
                 if not in_cli_layer(name) for target, line in sorted(edges.items()) if in_cli_layer(target)]
    assert not offending, "library module(s) import the CLI/app layer:\n" + "\n".join(offending)


def private_imports() -> list[str]:
    found = modules()
    known = set(found)
    offending = []
    for name, path in found.items():
        for target, line, imported in imports(name, path, known):
            if imported and imported.startswith("_") and not imported.startswith("__") and target != name:
                offending.append(f"{name} line {line}: from {target} import {imported}")
    return offending


def test_no_module_imports_another_modules_private_names():
    offending = private_imports()
    assert not offending, "private names imported across modules (make them public where they are needed):\n" + \
        "\n".join(offending)


@pytest.mark.parametrize("name", ["armor_trl.data.pregenerate", "armor_trl.trainer", "armor_trl.callbacks.evaluation"])
def test_key_library_modules_are_library(name):
    assert name in modules() and not in_cli_layer(name)
