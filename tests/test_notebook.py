"""notebooks/armor_grpo_colab.ipynb: its install cell installs from the source the user sets, every name it uses exists in the installed
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


def notebook_text() -> str:
    return "\n".join(cell.source for cell in nbformat.read(NOTEBOOK, as_version=4).cells)


def code_cell(marker: str) -> str:
    """The code cell (as Python, magics turned into calls) whose source holds ``marker``."""
    (cell,) = [source for source in code_cells() if marker in source]
    return cell


class MagicRecorder:
    """Stands in for IPython in exec'd cells: records each line magic, expanded like IPython's ``{name}``."""

    def __init__(self, namespace: dict):
        self.namespace, self.calls = namespace, []

    def run_line_magic(self, name, line):
        self.calls.append((name, re.sub(r"\{(\w+)\}", lambda m: str(self.namespace[m.group(1)]), line)))


def run_install_cell(source: str, tmp_path: Path) -> tuple[dict, list]:
    namespace = {"OFFLINE_TINY": False, "ARMOR_TRL_SOURCE": source, "REPORT_TO": "tensorboard"}
    recorder = MagicRecorder(namespace)
    namespace["get_ipython"] = lambda: recorder
    exec(compile(code_cell("armor_trl_url"), "install cell", "exec"), namespace)
    return namespace, recorder.calls


def pip_requirement(calls: list) -> str:
    (line,) = [line for name, line in calls if name == "pip" and "armor-trl" in line]
    return re.search(r'"(armor-trl\[experiments\] @ [^"]+)"', line).group(1)


def test_install_cell_installs_from_the_source_the_user_sets(tmp_path):
    """No placeholder to edit and no install from the package index (armor-trl is not there): the parameters cell
    has ARMOR_TRL_SOURCE, unset it stops with a message saying what to set, a wheel or a git URL is installed as
    `armor-trl[experiments] @ <url>` (tests/test_packaging.py installs a built wheel with that requirement)."""
    text = notebook_text()
    for placeholder in ("YOUR_ORG", "<your git host>", "<URL", "<path>"):
        assert placeholder not in text
    assert '%pip install -q "armor-trl[experiments]"' not in text  # the package index has no armor-trl
    params = next(cell.source for cell in nbformat.read(NOTEBOOK, as_version=4).cells
                  if "parameters" in cell.metadata.get("tags", []))
    assert 'ARMOR_TRL_SOURCE = ""' in params

    with pytest.raises(ValueError, match=r"Set ARMOR_TRL_SOURCE in the parameters cell: the path of an armor-trl "
                                         r"wheel .*`make dist`.*git URL"):
        run_install_cell("", tmp_path)
    with pytest.raises(ValueError, match=r"ARMOR_TRL_SOURCE='armor_trl.whl' is neither a file on this machine"):
        run_install_cell("armor_trl.whl", tmp_path)

    wheel = tmp_path / "armor_trl-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    _, calls = run_install_cell(str(wheel), tmp_path)
    assert pip_requirement(calls) == f"armor-trl[experiments] @ {wheel.resolve().as_uri()}"
    assert any("tensorboard" in line for _, line in calls)
    _, calls = run_install_cell("git+https://example.org/armor-trl.git", tmp_path)
    assert pip_requirement(calls) == "armor-trl[experiments] @ git+https://example.org/armor-trl.git"


@pytest.mark.parametrize("capability, expected", [((7, 5), "fp16"), ((7, 0), "fp16"), ((8, 0), "bf16"),
                                                  ((9, 0), "bf16"), (None, "fp32")])
def test_precision_cell_takes_fp16_on_gpus_without_native_bf16(monkeypatch, capability, expected):
    """A T4 (compute capability 7.5) trains in fp16 mixed precision, although torch.cuda.is_bf16_supported() is True
    there (emulated bf16); Ampere and newer in bf16; no GPU: fp32. The notebook's own cell, with the GPU mocked."""
    import torch

    gpu = capability is not None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "mocked GPU")
    monkeypatch.setattr(torch.version, "hip", None)
    namespace = {"OFFLINE_TINY": False}
    exec(compile(code_cell("use_bf16, use_fp16"), "precision cell", "exec"), namespace)
    assert (namespace["use_bf16"], namespace["use_fp16"]) == (expected == "bf16", expected == "fp16")
    config = code_cell("args = ArmorConfig(")
    assert "bf16=use_bf16" in config and "fp16=use_fp16" in config  # what the training cell passes


def test_both_paths_train_several_optimizer_steps_per_rollout_batch():
    """ARMOR's mixed ratio acts only when a rollout batch feeds several optimizer steps (docs/algorithm.md): the
    online (Colab) settings and the offline ones both have steps_per_generation > gradient_accumulation_steps."""
    tree = ast.parse(code_cell("settings = dict("))
    regimes = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "settings":
            values = {k.arg: ast.literal_eval(k.value) for k in node.value.keywords
                      if k.arg in ("steps_per_generation", "gradient_accumulation_steps")}
            regimes.append(values["steps_per_generation"] / values["gradient_accumulation_steps"])
    assert sorted(regimes) == [2, 4]  # offline (tiny) 2, online 4 optimizer steps per rollout batch


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
    from armor_trl.app.experiments.plan import CONFIGS

    nb = nbformat.read(NOTEBOOK, as_version=4)
    text = "\n".join(cell.source for cell in nb.cells)
    assert "configs/lora_gsm8k_single_gpu.yaml" not in text  # a path that exists only in a clone
    for recipe in set(re.findall(r"([\w.-]+\.yaml)", text)):
        assert (CONFIGS / recipe).is_file(), recipe


def built_wheel(tmp_path: Path) -> Path:
    """armor_trl built as a wheel from a copy of the sources (nothing is written into the repository) and unpacked
    with pip into a folder of its own, which the notebook's kernel gets first on its path."""
    import subprocess
    import sys

    from testing import source_copy

    src = source_copy(tmp_path)
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
    # armor/policy_reward_mean is logged where a rollout batch is generated: steps 1 and 3 (2 steps per batch)
    assert [step for step, _ in metrics["train_reward"]] == [1, 3]
    assert "fully on-policy" not in text  # no update-regime warning: the mixed ratio can act
    assert [step for step, _ in metrics["validation"]] == [0, 2, 4]
    assert 0.0 <= metrics["final"]["avg@2"] <= metrics["final"]["pass@2"] <= 1.0
    assert os.listdir(out / "tiny-model")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]  # resumable
    assert (out / "adapter_config.json").is_file()  # trainer.save_model(): the final LoRA adapter
    assert list(out.rglob("events.out.tfevents.*")), "no TensorBoard event file"
