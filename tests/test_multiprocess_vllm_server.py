"""vLLM in server mode across two processes with TRL's tool loop (tests/scripts/mp_vllm_server_script.py): TRL's own
vLLM generation object gathers every process's prompts and hands each process back the slice at ``process_index ×
its row count``; a fake server client answers each prompt with a completion naming it. The processes send different
numbers of rows per tool turn, and some none (unequal turns).

ArmorGRPOTrainer pads every tool turn to the same number of rows on every process (armor_trl.rollout.tool_turns), so
every row gets its own completion, with anchors and without. Plain GRPOTrainer has the same defect unpadded: gloo
aborts on the mismatched collective (or rows get other rows' completions). Three torchrun launches of about 20 s each
on 2 cores (DDP, gloo, CPU).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testing import LAUNCH_TIMEOUT, REPO, SCRIPTS, _env, _free_port, _launch

SCRIPT = SCRIPTS / "mp_vllm_server_script.py"


def launch(model: str, out: Path, *extra: str) -> list[dict]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), str(SCRIPT), "--model", model, "--out", str(out), *extra,
    ]  # fmt: skip
    return _launch(command, out, 2)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--no_anchors",)], ids=["anchors", "no_anchors"])
def test_every_row_gets_its_own_completion_from_a_vllm_server(tool_model, tmp_path, extra):
    ranks = launch(tool_model, tmp_path / "run", *extra)
    assert [r["error"] for r in ranks] == [None, None]
    assert all(r["rows_own"] and all(r["rows_own"]) for r in ranks), [r["rows_own"] for r in ranks]
    sent = ranks[0]["turn_rows"]
    assert sent == ranks[1]["turn_rows"] and all(a == b for a, b in sent)  # padded: equal rows in every tool turn
    assert any(a > 0 and b > 0 for a, b in sent)


@pytest.mark.slow
def test_plain_grpo_trainer_has_the_same_defect(tool_model, tmp_path):
    """Unpadded, the processes' generation calls and rows differ: gloo aborts on the mismatched collective (or, where
    the calls happen to match, rows get other rows' completions)."""
    out = tmp_path / "plain"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), str(SCRIPT), "--model", tool_model, "--out", str(out), "--plain",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    if done.returncode != 0:
        assert "collective mismatch" in done.stdout + done.stderr
        return
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert any(r["error"] is not None or not all(r["rows_own"]) for r in ranks)
