"""notebooks/armor_grpo_colab.ipynb: its install cell names a real source, every name it uses exists in the installed
packages (with the keyword arguments it passes), and it runs end to end in its offline mode (tiny model, synthetic
task, no network) against armor_trl built as a wheel, writing checkpoints, TensorBoard logs and the plot."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "armor_grpo_colab.ipynb"
# modules that exist only on Colab (the notebook falls back to a local folder without them)
COLAB_ONLY = {"google.colab"}


def code_cells() -> list[str]:
    """Each code cell as Python (IPython's %magics turned into calls, as the kernel does)."""
    from IPython.core.inputtransformer2 import TransformerManager

    nb = nbformat.read(NOTEBOOK, as_version=4)
    return [TransformerManager().transform_cell(cell.source) for cell in nb.cells if cell.cell_type == "code"]


def test_install_cell_names_a_real_source():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    text = "\n".join(cell.source for cell in nb.cells)
    assert "YOUR_ORG" not in text
    install = next(cell.source for cell in nb.cells if "%pip install" in cell.source)
    live = [line.strip() for line in install.splitlines() if line.strip().startswith("%pip install")]
    assert live[0].startswith('%pip install -q "armor-trl[experiments]"')  # the name on the package index
    assert "whl" in install and "git+" in install  # the commented alternatives


def test_every_name_the_notebook_uses_exists():
    """Every ``from M import a`` / ``import M`` resolves in the installed packages, every ``M.attr`` read from an
    imported module exists, and every call of an imported function or class accepts the keyword arguments the
    notebook passes (``**settings`` included), on the online path too, which CI does not execute."""
    trees = [ast.parse(source) for source in code_cells()]
    bound: dict[str, object] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.module in COLAB_ONLY:
                    continue
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module}.{alias.name}"
                    bound[alias.asname or alias.name] = getattr(module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    module = importlib.import_module(alias.name)
                    if alias.asname:  # import a.b as c: c is a.b
                        bound[alias.asname] = module
                    else:  # import a.b: a
                        bound[alias.name.split(".")[0]] = importlib.import_module(alias.name.split(".")[0])
    assert {"ArmorConfig", "ArmorGRPOTrainer", "ValidationCallback", "evaluate", "math_verify_reward",
            "load_rlvr_dataset", "RECIPES"} <= set(bound)

    dict_kwargs = {}  # name = dict(a=..., b=...): the keys, for calls that pass **name
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                    isinstance(node.value.func, ast.Name) and node.value.func.id == "dict":
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        dict_kwargs.setdefault(target.id, set()).update(k.arg for k in node.value.keywords if k.arg)
    assert dict_kwargs.get("settings")

    checked = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    inspect.ismodule(bound.get(node.value.id)):
                assert hasattr(bound[node.value.id], node.attr), f"{node.value.id}.{node.attr}"
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Name) and node.func.id in bound and callable(bound[node.func.id]):
                target = bound[node.func.id]
            elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and \
                    inspect.ismodule(bound.get(node.func.value.id)):
                target = getattr(bound[node.func.value.id], node.func.attr)
            else:
                continue
            names = {k.arg for k in node.keywords if k.arg}
            for k in node.keywords:
                if k.arg is None and isinstance(k.value, ast.Name):
                    names |= dict_kwargs.get(k.value.id, set())
            if not names or inspect.isbuiltin(target):
                continue
            if dataclasses.is_dataclass(target):
                allowed = {f.name for f in dataclasses.fields(target) if f.init}
                assert names <= allowed, f"{node.func.id if isinstance(node.func, ast.Name) else node.func.attr}: " \
                                         f"{sorted(names - allowed)}"
            else:
                parameters = inspect.signature(target).parameters
                if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                    assert names <= set(parameters), f"{target.__name__}: {sorted(names - set(parameters))}"
            checked.append(getattr(target, "__name__", str(target)))
    assert {"ArmorConfig", "ArmorGRPOTrainer", "ValidationCallback", "evaluate", "load_rlvr_dataset",
            "LoraConfig"} <= set(checked)


def test_next_steps_name_installed_recipes():
    from armor_trl.experiments.study import CONFIGS

    nb = nbformat.read(NOTEBOOK, as_version=4)
    text = "\n".join(cell.source for cell in nb.cells)
    assert "configs/lora_gsm8k_single_gpu.yaml" not in text  # a path that exists only in a clone
    for recipe in set(re.findall(r"([\w.-]+\.yaml)", text)):
        assert (CONFIGS / recipe).is_file(), recipe


def built_wheel(tmp_path: Path) -> Path:
    """armor_trl built as a wheel from a copy of the sources (nothing is written into the repository) and unpacked
    with pip into a folder of its own, which the notebook's kernel gets first on its path."""
    import shutil
    import subprocess
    import sys

    repo = NOTEBOOK.parent.parent
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(repo / name, src / name)
    for name in ("armor_trl", "configs"):
        shutil.copytree(repo / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True)
    (wheel,) = (tmp_path / "dist").glob("armor_trl-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True)
    return site


def test_notebook_runs_offline_against_the_built_wheel(tmp_path, monkeypatch):
    site = built_wheel(tmp_path)
    # the kernel inherits the environment: the wheel's armor_trl comes before the editable install of the clone
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = next(cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", []))
    assert "OFFLINE_TINY = False" in params.source  # online (Colab) by default
    out = tmp_path / "out"
    params.source = params.source.replace("OFFLINE_TINY = False", "OFFLINE_TINY = True") + f"\nOUTPUT_DIR = {str(out)!r}"
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
        monkeypatch.setenv(name, "1")  # the kernel inherits them: any hub access fails
    nb.cells.append(nbformat.v4.new_code_cell("import armor_trl; print('armor_trl from', armor_trl.__file__)"))
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell's traceback, if a cell fails

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert f"armor_trl from {site / 'armor_trl' / '__init__.py'}" in text  # the wheel, not the clone
    assert f"recipes: {site / 'armor_trl' / 'configs'}" in text  # next steps: the recipes inside the wheel
    assert "skipping the install" in text and "held-out: avg@2 =" in text
    assert "resuming from: nothing (a new run)" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot cell displayed no figure"
    assert (out / "curves.png").stat().st_size > 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [step for step, _ in metrics["train_reward"]] == [1, 2, 3, 4]  # armor/policy_reward_mean, every step
    assert [step for step, _ in metrics["validation"]] == [0, 2, 4]
    assert 0.0 <= metrics["final"]["avg@2"] <= metrics["final"]["pass@2"] <= 1.0
    assert os.listdir(out / "tiny-model")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]  # resumable
    assert (out / "adapter_config.json").is_file()  # trainer.save_model(): the final LoRA adapter
    assert list(out.rglob("events.out.tfevents.*")), "no TensorBoard event file"
