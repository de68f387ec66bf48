"""Dynamic sampling with refill under 2-process DDP on CPU (torchrun, gloo): every process runs the same number of
generation rounds, keeps only informative groups, agrees on the weights, and a resumed run continues exactly."""

from __future__ import annotations

import shutil
import sys

import pytest

from testing import SCRIPTS, _free_port, _launch

SCRIPT = SCRIPTS / "mp_dynamic_sampling_script.py"
pytestmark = pytest.mark.slow


def launch(model, out, *extra):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), str(SCRIPT), "--model", model, "--out", str(out), *extra,
    ]  # fmt: skip
    return _launch(command, out, 2)


@pytest.mark.parametrize("anchor_filter", ["drop", "keep"])  # keep: mixed groups draw their anchors after the loop
def test_refill_under_ddp_and_resume(tiny_model_path, tmp_path, anchor_filter):
    filter_args = ("--anchor-filter", anchor_filter)
    straight = launch(tiny_model_path, tmp_path / "straight", *filter_args)
    deferred = [rank["anchor_counts"].get("deferred_groups", 0) for rank in straight]
    assert all(deferred) if anchor_filter == "keep" else not any(deferred)
    # the draw after the loop is collective: every process made it as often, with as many rows
    calls = [rank["anchor_counts"].get("deferred_calls", 0) for rank in straight]
    rows = [rank["anchor_counts"].get("candidate_rows", 0) for rank in straight]
    assert calls[0] == calls[1] and rows[0] == rows[1]
    # same number of generation rounds on both processes (generation and reward gathering are collective)
    assert len(straight[0]["round_prompts"]) == len(straight[1]["round_prompts"]) > 4
    # and as many prompts per round: a refill round's size (what is missing) is agreed between the processes
    assert [len(p) for p in straight[0]["round_prompts"]] == [len(p) for p in straight[1]["round_prompts"]]
    for rank in straight:
        for batch in rank["batches"]:
            assert all(batch["kept"]), "a batch was left short although informative prompts exist"
    # the two processes drew different refill prompts (one stream, split between them)
    refills = [set(p for round_ in r["round_prompts"][1:] for p in round_) for r in straight]
    assert refills[0] != refills[1]
    assert straight[0]["checksum"] == straight[1]["checksum"]
    rounds = [e["armor/generation_rounds"] for e in straight[0]["log_history"] if "armor/generation_rounds" in e]
    assert len(rounds) == 4 and all(r >= 1 for r in rounds)

    # a run that got as far as step 2: the straight run's checkpoint-2 alone (a launch saved, not a third one spent)
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "straight" / "trainer" / "checkpoint-2", cut / "trainer" / "checkpoint-2")
    resumed = launch(tiny_model_path, cut, "--resume", *filter_args)
    assert resumed[0]["refill_drawn"] == straight[0]["refill_drawn"]
    assert resumed[0]["params"] == straight[0]["params"]
    assert resumed[0]["checksum"] == straight[0]["checksum"]


def test_deferred_tool_candidates_under_ddp_and_resume(tool_model, tmp_path):
    """TRL's tool loop, anchor_filter="keep": the candidates' trajectories of the groups that train run after the refill
    loop, a collective call every process makes as often with as many rows; a resumed run continues exactly."""
    straight = launch(tool_model, tmp_path / "straight", "--anchor-filter", "keep", "--tools")
    assert all(rank["anchor_counts"].get("deferred_groups", 0) for rank in straight)
    assert all(rank["anchor_counts"].get("eligible_groups", 0) == 0 for rank in straight)  # nothing drew in a round
    calls = [rank["anchor_counts"].get("deferred_calls", 0) for rank in straight]
    rows = [rank["anchor_counts"].get("candidate_rows", 0) for rank in straight]
    assert calls[0] == calls[1] == 4 and rows[0] == rows[1] > 0
    assert [len(p) for p in straight[0]["round_prompts"]] == [len(p) for p in straight[1]["round_prompts"]]
    assert straight[0]["checksum"] == straight[1]["checksum"]
    anchors = [e["armor/anchor_tool_call_frequency"] for e in straight[0]["log_history"]
               if "armor/anchor_tool_call_frequency" in e]
    # no anchor stands in a round's slot (all come after the refill loop): their tool metrics are logged when placed
    assert anchors and all(0.0 <= v <= 1.0 for v in anchors)
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "straight" / "trainer" / "checkpoint-2", cut / "trainer" / "checkpoint-2")
    resumed = launch(tool_model, cut, "--resume", "--anchor-filter", "keep", "--tools")
    assert resumed[0]["refill_drawn"] == straight[0]["refill_drawn"]
    assert resumed[0]["params"] == straight[0]["params"]
    assert resumed[0]["checksum"] == straight[0]["checksum"]
