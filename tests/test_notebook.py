"""notebooks/armor_grpo_colab.ipynb runs end to end in its offline mode (tiny model, synthetic task, no network)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "armor_grpo_colab.ipynb"


def test_notebook_runs_offline(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = next(cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", []))
    assert "OFFLINE_TINY = False" in params.source  # online (Colab) by default
    out = tmp_path / "out"
    params.source = params.source.replace("OFFLINE_TINY = False", "OFFLINE_TINY = True") + f"\nOUTPUT_DIR = {str(out)!r}"
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
        monkeypatch.setenv(name, "1")  # the kernel inherits them: any hub access fails
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell's traceback, if a cell fails

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "skipping the install" in text and "held-out: avg@2 =" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot cell displayed no figure"
    assert (out / "curves.png").stat().st_size > 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [step for step, _ in metrics["train_reward"]] == [1, 2, 3, 4]  # armor/policy_reward_mean, every step
    assert [step for step, _ in metrics["validation"]] == [0, 2, 4]
    assert 0.0 <= metrics["final"]["avg@2"] <= metrics["final"]["pass@2"] <= 1.0
    assert os.listdir(out / "tiny-model")
