"""scripts/tool_use_evidence.py: the registered windows in steps, falsifier 1 as its two majorities, and a study
folder's record stored and restored without losing anything."""

from __future__ import annotations

import gzip
import importlib.util
import json

import pytest

from testing import REPO

spec = importlib.util.spec_from_file_location("tool_use_evidence", REPO / "scripts" / "tool_use_evidence.py")
evidence = importlib.util.module_from_spec(spec)
spec.loader.exec_module(evidence)


def _run(reward_every: int, called_end: float, rise: bool) -> dict:
    """A 100-step run whose reward is logged every ``reward_every`` steps: 0.0 on steps 1-20, 1.0 on steps 81-100
    when ``rise`` (else 0.0), and 0.5 between (what a window counted in logged values would mix in)."""
    reward = [(s, 0.0 if s <= 20 else (1.0 if rise else 0.0) if s > 80 else 0.5)
              for s in range(reward_every, 101, reward_every)]
    return {"reward": reward, "val/avg@4": [(0, 0.3), (100, 0.2)], "val/tool_call_rate": [(0, 0.8), (100, called_end)]}


@pytest.mark.parametrize("every", [1, 2])
def test_reward_windows_are_20_steps_whatever_steps_log_a_reward(every):
    numbers = evidence.run_numbers(_run(every, 0.0, rise=True))
    # 20 logged values of a run that logs every other step would reach step 40 and mix in the 0.5s
    assert numbers["reward_first"] == 0.0 and numbers["reward_last"] == 1.0
    assert numbers["lost_the_tool"] is True and numbers["reward_rose"] is True


def test_lost_the_tool_is_the_tool_call_rate_alone_and_below_half_its_start():
    assert evidence.run_numbers(_run(2, 0.39, rise=False))["lost_the_tool"] is True
    assert evidence.run_numbers(_run(2, 0.4, rise=False))["lost_the_tool"] is False  # half of 0.8 is not below it
    assert evidence.run_numbers(_run(2, 0.0, rise=False))["reward_rose"] is False


def _runs(specs):
    return {f"grpo-{i}": {"tags": {"run": f"grpo-{i}", "arm": "grpo", "warmup_seed": "1", "seed": str(i)},
                          "series": _run(2, *spec)} for i, spec in enumerate(specs)}


def test_falsifier_1_needs_both_majorities(capsys):
    evidence.study_checks(_runs([(0.0, True)] * 2 + [(0.8, True)]))
    assert "in 2/3; training reward's last 20 steps above its first 20 in 3/3 -> not triggered" in capsys.readouterr().out
    evidence.study_checks(_runs([(0.0, True)] + [(0.0, False)] * 2))  # the tool lost, the reward not up
    assert "in 3/3; training reward's last 20 steps above its first 20 in 1/3 -> TRIGGERED" in capsys.readouterr().out


def test_store_and_restore_keep_a_study_folders_record_and_overwrite_nothing(tmp_path):
    study = tmp_path / "study"
    (study / "metrics").mkdir(parents=True)
    (study / "warm" / "warm7").mkdir(parents=True)
    (study / "warm" / "warm7" / "model.safetensors").write_bytes(b"weights")
    (study / "study.json").write_text(json.dumps({"warm_checkpoints": {"7": "abc"}}))
    line = {"run": "grpo-warm7-seed1", "arm": "grpo", "warmup_seed": 7, "seed": 1, "step": 0, "val/avg@4": 0.25}
    (study / "metrics" / "grpo-warm7-seed1.jsonl").write_text(json.dumps(line) + "\n")
    stored = tmp_path / "evidence"
    evidence.store(study, stored)
    first = (stored / "metrics" / "grpo-warm7-seed1.jsonl.gz").read_bytes()
    evidence.store(study, stored)  # the same bytes again: a commit shows only what changed
    assert (stored / "metrics" / "grpo-warm7-seed1.jsonl.gz").read_bytes() == first
    assert json.loads(gzip.decompress(first)) == line
    assert (stored / "warm" / "warm7" / "model.safetensors").read_bytes() == b"weights"
    assert "grpo-warm7-seed1" in (stored / "runs.csv").read_text()

    elsewhere = tmp_path / "there"
    (elsewhere / "metrics").mkdir(parents=True)
    (elsewhere / "metrics" / "grpo-warm7-seed1.jsonl").write_text("a run of its own\n")
    evidence.restore(stored, elsewhere)
    assert (elsewhere / "metrics" / "grpo-warm7-seed1.jsonl").read_text() == "a run of its own\n"  # kept
    assert (elsewhere / "study.json").read_text() == (study / "study.json").read_text()
    assert (elsewhere / "warm" / "warm7" / "model.safetensors").read_bytes() == b"weights"
    (elsewhere / "metrics" / "grpo-warm7-seed1.jsonl").unlink()
    evidence.restore(stored, elsewhere)
    assert json.loads((elsewhere / "metrics" / "grpo-warm7-seed1.jsonl").read_text()) == line


def test_compare_counts_the_values_two_runs_differ_in_and_ignores_wall_times(tmp_path, capsys):
    records = [{"run": "a", "step": 0, "val/avg@4": 0.25, "step_time": 1.0},
               {"run": "a", "step": 1, "loss": 0.5, "run_wall_time_s": 3.0}]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"
    first.write_text("".join(json.dumps(r) + "\n" for r in records))
    rerun = [{**records[0], "run": "b", "step_time": 2.0}, {**records[1], "run": "b", "run_wall_time_s": 9.0}]
    second.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rerun).encode()))
    assert evidence.compare(first, second) == 0
    assert "4 values compared, 0 differ" in capsys.readouterr().out
    rerun[1]["loss"] = 0.5000001
    second.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rerun).encode()))
    assert evidence.compare(first, second) == 1
    assert "1 differ (first: step 1 loss: 0.5 vs 0.5000001)" in capsys.readouterr().out
