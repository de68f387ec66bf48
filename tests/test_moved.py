"""The flat layout's import paths (armor_trl/_moved.py) name the moved modules without changing them: after an old path
is imported, the module keeps its own spec (importlib finds it under its name, a package stays a package, a reload
re-executes it under its name), and ``python -m`` runs an old path as it runs the new one. Each check runs in a fresh
interpreter: what it checks is the state an import leaves behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from testing import REPO


def run_python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                               "HF_HUB_DISABLE_TELEMETRY": "1"})


def check_in_a_fresh_interpreter(code: str) -> None:
    result = run_python("-W", "ignore::DeprecationWarning", "-c", textwrap.dedent(code))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("old, new", [("mixture", "algorithm.mixture"), ("cli", "app.cli"),
                                      ("experiments", "app.experiments")])
def test_after_an_old_path_importlib_finds_the_module_under_its_own_name(old, new):
    check_in_a_fresh_interpreter(f"""
        import importlib, importlib.util, sys
        module = importlib.import_module("armor_trl.{old}")
        assert module is sys.modules["armor_trl.{new}"] is sys.modules["armor_trl.{old}"]
        assert module.__name__ == module.__spec__.name == "armor_trl.{new}", module.__spec__
        assert importlib.util.find_spec("armor_trl.{new}").name == "armor_trl.{new}"
    """)


def test_after_an_old_path_a_package_stays_a_package():
    check_in_a_fresh_interpreter("""
        import importlib, importlib.util
        import armor_trl.cli
        package = importlib.import_module("armor_trl.app.cli")
        assert package.__spec__.submodule_search_locations, package.__spec__
        assert list(package.__spec__.submodule_search_locations) == list(package.__path__)
        assert importlib.util.find_spec("armor_trl.app.cli.train").name == "armor_trl.app.cli.train"
        import armor_trl.cli.train, armor_trl.app.cli.train
        assert armor_trl.cli.train is armor_trl.app.cli.train
    """)


@pytest.mark.parametrize("through", ["old", "new"])
def test_a_reload_through_either_name_re_executes_the_module_under_its_own_name(through):
    check_in_a_fresh_interpreter(f"""
        import importlib
        import armor_trl.mixture as old
        import armor_trl.algorithm.mixture as new
        new.LOSS_TYPES = ()  # re-executing the module restores it
        reloaded = importlib.reload({through})
        assert reloaded is new and new.LOSS_TYPES, "the module was not re-executed"
        assert new.__name__ == new.__spec__.name == "armor_trl.algorithm.mixture"
        assert importlib.import_module("armor_trl.algorithm.mixture") is new
    """)


def test_an_old_path_still_warns_with_the_new_one_in_a_fresh_interpreter():
    result = run_python("-W", "error::DeprecationWarning", "-c", "import armor_trl.mixture")
    assert result.returncode == 1
    assert "armor_trl.mixture moved to armor_trl.algorithm.mixture" in result.stderr


@pytest.mark.parametrize("module", ["armor_trl.cli", "armor_trl.app.cli", "armor_trl"])
def test_python_m_runs_the_command_under_an_old_path_as_under_the_new_one(module):
    result = run_python("-m", module, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: armor-trl"), result.stdout
