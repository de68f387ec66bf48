"""The wheel's contents: every subpackage of armor_trl and every recipe under configs/ (shipped as armor_trl/configs,
so `armor-trl demo` and `study` find their recipes and arms outside a clone) are named in pyproject.toml."""

from __future__ import annotations

import tomllib
from pathlib import Path

from armor_trl.experiments import demo, study

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _dotted(path: Path, root: Path, prefix: str) -> str:
    return ".".join([prefix, *path.relative_to(root).parts]) if path != root else prefix


def test_every_subpackage_and_config_folder_is_packaged():
    code = {_dotted(p.parent, REPO / "armor_trl", "armor_trl") for p in (REPO / "armor_trl").rglob("__init__.py")}
    configs = {_dotted(p.parent, REPO / "configs", "armor_trl.configs") for p in (REPO / "configs").rglob("*.yaml")}
    assert set(SETUPTOOLS["packages"]) == code | configs
    assert SETUPTOOLS["package-dir"] == {"armor_trl.configs": "configs"}
    assert all(SETUPTOOLS["package-data"][name] == ["*.yaml"] for name in configs)


def test_recipes_are_found_in_the_clone():
    assert study.CONFIGS == REPO / "configs"
    assert study.DEFAULT_ARMS_FILE.is_file() and demo.DEFAULT_CONFIG.is_file()
