"""An agent (TRL's tool loop) in two processes whose trajectories need different numbers of tool turns
(tests/scripts/mp_agent_script.py: rank 0's policy rows and π_ref's candidates call ``multiply`` once, rank 1's
never), with anchors: DeepSpeed ZeRO-3 and FSDP2 (accelerate launch; FSDP2 through tests/scripts/fsdp_on_cpu.py) and
DDP (torchrun), gloo, on CPU.

Under ZeRO-3 every generation call gathers the parameters over the processes, under FSDP2 its sharded forwards
all-gather them, so a process whose loop ends first must still join the others' calls (armor_trl.rollout.tool_turns):
the run trains, both processes make the same generation calls (rank 1 with throw-away turns), both end with the same
parameters, moved from the initial ones, and the anchors hold their tool results masked. ``use_anchors=False`` goes
through the same loop hook and trains too (ZeRO-3). Under DDP no call is collective: no throw-away turn, each process
makes its own number of calls. The FSDP2 run also takes its anchors from the anchor cache where a prompt comes back to
a process (4 prompts, 3 steps: at the last step rank 1 holds all its anchors and still joins rank 0's draw) and ends
with the weights of the DDP run drawn fresh on the same seed.

Run with ``pytest -m slow tests/test_multiprocess_agent.py`` (DeepSpeed needed for ZeRO-3); about 15 s per launch on
2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from testing import ACCELERATE_CONFIGS, SCRIPTS, _free_port, _launch, fsdp_command

SCRIPT = SCRIPTS / "mp_agent_script.py"
PROCESSES = 2
# 4 prompts over 3 steps (every step revisits them all); seed 48's order brings rank 1 at step 3 only prompts it held
# before: with the anchor cache it has none to draw then
REVISITS = ["--prompts", "4", "--max_steps", "3", "--seed", "48"]


def launch_zero3(model: str, out: Path, *extra: str) -> list[dict]:
    pytest.importorskip("deepspeed")
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / "zero3.yaml"),
        "--num_processes", str(PROCESSES), "--mixed_precision", "no", "--main_process_ip", "127.0.0.1",
        "--main_process_port", str(_free_port()),
        str(SCRIPT), "--model", model, "--out", str(out), "--ddp_backend", "gloo", "--no_cpu", *extra,
    ]  # fmt: skip
    return _launch(command, out, PROCESSES)


def launch_ddp(model: str, out: Path, *extra: str) -> list[dict]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(PROCESSES), "--master_addr",
        "127.0.0.1", "--master_port", str(_free_port()),
        str(SCRIPT), "--model", model, "--out", str(out), "--ddp_backend", "gloo", *extra,
    ]  # fmt: skip
    return _launch(command, out, PROCESSES)


def launch_fsdp2(model: str, out: Path, *extra: str) -> list[dict]:
    command = fsdp_command(ACCELERATE_CONFIGS / "fsdp2.yaml", SCRIPT, "--model", model, "--out", str(out),
                           "--ddp_backend", "gloo", *extra, processes=PROCESSES)
    return _launch(command, out, PROCESSES)


@pytest.fixture(scope="module")
def ddp_run(tool_model, tmp_path_factory):
    return launch_ddp(tool_model, tmp_path_factory.mktemp("ddp_agent"), *REVISITS)


def check_trained_alike(ranks: list[dict], moved: bool = True) -> None:
    assert len({r["final_checksum"] for r in ranks}) == 1, "the processes ended with different parameters"
    if moved:
        assert all(r["final_checksum"] != r["initial_checksum"] for r in ranks), "the policy did not move"
    assert all("train_loss" in r["log_history"][-1] for r in ranks)


@pytest.mark.slow
def test_zero3_agent_with_unequal_turn_counts_trains_with_anchors(tool_model, tmp_path):
    ranks = launch_zero3(tool_model, tmp_path / "zero3")
    assert [r["zero_stage"] for r in ranks] == [3, 3]
    check_trained_alike(ranks)
    # every generation call is made on both processes (ZeRO-3 gathers for each), rank 1 joining with throw-away turns:
    # in the same-call round's loop, then in the policy's and in π_ref's candidates' loops of the next round
    assert len(ranks[0]["generation_calls"]) == len(ranks[1]["generation_calls"])
    assert ranks[0]["throwaway_turns"] == 0 and ranks[1]["throwaway_turns"] == 3
    assert [n for _, n in ranks[1]["generation_calls"]].count(1) == 3
    # anchors in every round; rank 0's are π_ref's tool trajectories (the tool's result masked), rank 1's one turn
    assert all(round_["anchors"] == 2 for r in ranks for round_ in r["rounds"])
    assert all(tokens > 0 for round_ in ranks[0]["rounds"] for tokens in round_["anchor_tool_tokens"])
    assert all(tokens == 0 for round_ in ranks[1]["rounds"] for tokens in round_["anchor_tool_tokens"])


@pytest.mark.slow
def test_zero3_agent_with_unequal_turn_counts_trains_without_anchors(tool_model, tmp_path):
    """ARMOR off (the mixed ratio only): TRL's own loop, through the same hook, trains under ZeRO-3 as well (every
    on-policy row is wrong here, so no advantage moves the policy: the run completes, the processes agree)."""
    ranks = launch_zero3(tool_model, tmp_path / "zero3_off", "--no_anchors")
    check_trained_alike(ranks, moved=False)
    assert len(ranks[0]["generation_calls"]) == len(ranks[1]["generation_calls"])
    assert ranks[1]["throwaway_turns"] == 2  # the policy's loop, one round after the other


@pytest.mark.slow
def test_ddp_agent_with_unequal_turn_counts_trains_with_anchors(ddp_run):
    ranks = ddp_run
    assert [r["zero_stage"] for r in ranks] == [None, None] and not any(r["sharded"] for r in ranks)
    check_trained_alike(ranks)
    assert [r["throwaway_turns"] for r in ranks] == [0, 0]  # no collective call: each process its own turns
    assert len(ranks[0]["generation_calls"]) > len(ranks[1]["generation_calls"])
    assert all(round_["anchors"] == 2 for r in ranks for round_ in r["rounds"])


@pytest.mark.slow
def test_fsdp2_agent_with_unequal_turn_counts_and_anchor_cache_trains_like_ddp(tool_model, tmp_path, ddp_run):
    """FSDP2 (each generation call all-gathers the shards: the script's fake makes a sharded forward per call), the
    anchor cache on: the processes make the same generation calls, cached anchors keep their tool results masked, and
    the run ends with the weights of the DDP run that draws every anchor fresh (the fake's π_ref answers a prompt
    alike on every visit, so a cached anchor is the one a fresh draw gives)."""
    ranks = launch_fsdp2(tool_model, tmp_path / "fsdp2", *REVISITS, "--anchor_cache")
    assert all(r["distributed_type"].endswith("FSDP") and r["sharded"] for r in ranks)
    check_trained_alike(ranks)
    assert len(ranks[0]["generation_calls"]) == len(ranks[1]["generation_calls"])
    # rank 1 joins rank 0's tool turns: the same-call round's loop, then the policy's and π_ref's loops of two rounds
    assert ranks[0]["throwaway_turns"] == 0 and ranks[1]["throwaway_turns"] == 5
    # the cache: hits once prompts come back; at step 3 rank 1 has every anchor cached and still joins rank 0's draw
    # for its one group (K = 2 padding rows), then its tool turn
    assert [r["cache_hits"] for r in ranks] == [[0, 1, 1], [0, 1, 2]]
    assert ranks[1]["generation_calls"][-2:] == [[True, 2], [True, 1]]
    assert all(round_["anchors"] == 2 for r in ranks for round_ in r["rounds"])
    assert all(tokens > 0 for round_ in ranks[0]["rounds"] for tokens in round_["anchor_tool_tokens"])
    assert all(tokens == 0 for round_ in ranks[1]["rounds"] for tokens in round_["anchor_tool_tokens"])
    for mine, theirs in zip(ranks, ddp_run, strict=True):
        assert mine["rounds"] == theirs["rounds"]
        assert mine["final_checksum"] == pytest.approx(theirs["final_checksum"], rel=1e-6)
    assert [r["cache_hits"] for r in ddp_run] == [[0, 0, 0], [0, 0, 0]]
