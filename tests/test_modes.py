"""The mode testbed's solution modes: the classifier on scripted completions, the texts each mode writes, the carry /
no-carry problem sets, the final-answer reward on both modes, and the warm-up's mode mix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from armor_trl.data.datasets import arithmetic_problems, arithmetic_splits, has_carry
from armor_trl.app.experiments.runner import warm_start, warmup_modes
from armor_trl.rewards.modes import (
    CARRYING, DIRECT, OTHER, WORKED, classify, classify_carries, column_steps, max_completion_chars, mode_text, parse_problem, resolve_classifier,
)
from armor_trl.rewards import final_integer_reward

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("text, mode", [
    ("5+7=12,2+0+1=3,1+3=4#432", WORKED),
    ("1+2=3#3", WORKED),
    (" 5+7=12,2+0+1=3#32\n", WORKED),       # whitespace around it aside
    ("5+7=99,2+0+1=3,1+3=4#1", WORKED),     # wrong sums are still the worked form
    ("#432", DIRECT),
    ("#0", DIRECT),
    ("432", OTHER),                         # no '#'
    ("#", OTHER),
    ("5+7=12,2+0+1=3,1+3=4#", OTHER),       # unfinished
    ("5+7=12,2+0+1=3,1+3=4", OTHER),
    ("5+7=12,,1+3=4#432", OTHER),
    ("5+7=12 1+3=4#432", OTHER),
    ("#432#432", OTHER),
    ("5+7+2=14#14", OTHER),                 # a carry is +1 only
    ("12+3=15#15", OTHER),                  # a column holds one digit of each operand
    ("", OTHER),
])
def test_classifier_on_scripted_completions(text, mode):
    assert classify(text) == mode


def test_mode_texts_are_what_the_classifier_and_the_reward_read():
    assert column_steps(125, 307) == ["5+7=12", "2+0+1=3", "1+3=4"]
    assert mode_text(WORKED, 125, 307) == "5+7=12,2+0+1=3,1+3=4#432"
    assert mode_text(DIRECT, 125, 307) == "#432"
    assert column_steps(999, 1) == ["9+1=10", "9+0+1=10", "9+0+1=10"]  # shorter operand: zeros
    with pytest.raises(ValueError, match="Unknown mode"):
        mode_text("sideways", 1, 2)
    for digits in (1, 2, 3, 4):
        for prompt, answer in arithmetic_problems(50, seed=digits, digits=digits):
            a, b = parse_problem(prompt)
            for mode in (WORKED, DIRECT):
                text = mode_text(mode, a, b)
                assert classify(text) == mode
                assert final_integer_reward([text], answer=[answer]) == [1.0]
                assert len(text) + 1 <= max_completion_chars(digits)  # + end of sequence
    assert len(mode_text(WORKED, 999, 999)) + 1 <= max_completion_chars(3)
    with pytest.raises(ValueError, match="not an addition prompt"):
        parse_problem("12-3=")


def test_the_worked_mode_writes_a_carry_exactly_after_a_column_of_ten_or_more():
    for a, b in [(125, 307), (999, 999), (100, 200), (58, 46), (5, 5)]:
        steps = column_steps(a, b)
        sums = [int(step.split("=")[1]) for step in steps]
        assert [step.count("+") == 2 for step in steps] == [False] + [s >= 10 for s in sums[:-1]]
        value = sum(s % 10 * 10**i for i, s in enumerate(sums)) + sums[-1] // 10 * 10 ** len(sums)
        assert value == a + b  # the column digits and the last carry are the answer


def test_final_integer_reward_reads_the_answer_after_the_last_hash():
    completions = ["5+7=12,2+0+1=3,1+3=4#432", "#432", "#433", "432", "#432x", "#4#432", " # 432 \n", "#"]
    assert final_integer_reward(completions, answer=["432"] * 8) == [1, 1, 0, 0, 0, 1, 1, 0]
    assert final_integer_reward(["#5"], answer=[None]) == [None]
    assert final_integer_reward([[{"role": "assistant", "content": "#7"}]], answer="7") == [1.0]


def test_carry_and_no_carry_sets_are_seeded_disjoint_and_what_they_say():
    train, held_out = arithmetic_splits(64, 100, seed=1, digits=3, train_filter="no_carry", eval_filter="carry")
    pairs = lambda data: [parse_problem(p) for p in data["prompt"]]  # noqa: E731
    assert all(not has_carry(a, b) and 100 <= a <= 999 and 100 <= b <= 999 for a, b in pairs(train))
    assert all(has_carry(a, b) for a, b in pairs(held_out))
    assert not set(train["prompt"]) & set(held_out["prompt"])
    assert len(set(train["prompt"])) == 64 and len(set(held_out["prompt"])) == 100
    again = arithmetic_splits(64, 100, seed=1, digits=3, train_filter="no_carry", eval_filter="carry")
    assert again[0]["prompt"] == train["prompt"] and again[1]["prompt"] == held_out["prompt"]
    other = arithmetic_splits(64, 100, seed=2, digits=3, train_filter="no_carry", eval_filter="carry")
    assert other[1]["prompt"] != held_out["prompt"]
    assert [str(a + b) for a, b in pairs(held_out)] == held_out["answer"]
    with pytest.raises(ValueError, match="arithmetic_eval_filter"):
        arithmetic_splits(4, 4, eval_filter="odd")
    # four digits: no exhaustive count of the kept pairs (81 million), the draw still works
    four, _ = arithmetic_splits(8, 8, seed=0, digits=4, train_filter="no_carry")
    assert all(not has_carry(*parse_problem(p)) for p in four["prompt"])


def test_resolve_classifier():
    assert resolve_classifier("arithmetic") is classify
    assert resolve_classifier("armor_trl.rewards.modes:classify") is classify
    with pytest.raises(ValueError, match="val_mode_classifier"):
        resolve_classifier("nope")
    with pytest.raises(ValueError, match="Could not load"):
        resolve_classifier("armor_trl.rewards.modes:nope")


def test_warmup_mode_mix_is_checked():
    assert warmup_modes(None) is None
    assert warmup_modes({"worked": 1, "direct": 0}) == {"worked": 1.0}
    for bad in ({"worked": -1, "direct": 1}, {"sideways": 1}, {"worked": 0}, {}, ["worked"], {"worked": True}):
        with pytest.raises(ValueError, match="demo.warmup.modes"):
            warmup_modes(bad)


def test_mixed_mode_warm_up_and_the_plain_cache_key(tmp_path, monkeypatch):
    """A short warm-up on the mode testbed writes both modes (record has the calibration's mode shares); the plain
    recipes' cache keys do not move (no new key unless a new field is set)."""
    import armor_trl.callbacks.evaluation as evaluation
    from armor_trl.app.experiments.runner import read_recipe

    _, recipe = read_recipe(CONFIGS / "mode_testbed.yaml")
    settings = dict(recipe["demo"])
    settings["tiny_model"] = {"hidden_size": 32, "num_layers": 1, "seed": 0}
    settings["warmup"] = {**settings["warmup"], "steps": 4, "check_every": 2, "calibration_size": 4,
                          "num_problems": 40, "batch_size": 8}
    calls = []
    original = evaluation.evaluate
    monkeypatch.setattr(evaluation, "evaluate", lambda *a, **k: calls.append(k) or original(*a, **k))
    recipe = {**recipe, "arithmetic_train_size": 8, "arithmetic_eval_size": 8}
    path, record = warm_start(recipe, settings, tmp_path)
    assert record["steps"] == 4 and set(record["calibration_modes"]) == {WORKED, DIRECT, OTHER}
    assert calls and all(k["max_new_tokens"] == max_completion_chars(3) and k["classify"] is classify for k in calls)
    assert json.loads((Path(path) / "warmup.json").read_text()) == record
    _, plain = read_recipe(CONFIGS / "tiny_demo.yaml")
    plain_settings = plain["demo"]
    key = json.dumps({"model": plain_settings["tiny_model"], "warmup": plain_settings["warmup"],
                      "task": {k: plain[k] for k in ("arithmetic_train_size", "arithmetic_eval_size",
                                                     "arithmetic_digits", "arithmetic_seed")}}, sort_keys=True)
    import hashlib

    expected = tmp_path / f"warm-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    os.makedirs(expected)
    (expected / "warmup.json").write_text('{"cached": true}')
    assert warm_start(plain, plain_settings, tmp_path) == (str(expected), {"cached": True})


@pytest.mark.parametrize("text,mode", [
    ("5+7=12,2+0+1=3,1+3=4#432", CARRYING),   # a column takes a carry
    ("5+2=7,2+0=2,1+3=4#427", WORKED),        # worked, no carry written (right on a no-carry problem)
    ("5+7=12,2+0=2,1+3=4#422", WORKED),       # the no-carry heuristic on a carry problem: no '+1' anywhere
    ("3+1=4,2+1=3,1+1=2#234", WORKED),        # digits 1 in the second operand are not carries
    ("9+1=10,2+1+1=4#40", CARRYING),          # a 1 digit and a carry in one completion
    ("#432", DIRECT),
    ("5+7=12,2+0+1=3#", OTHER),
])
def test_carry_classifier_splits_the_worked_form_by_its_carries(text, mode):
    assert classify_carries(text) == mode
    assert mode in classify_carries.modes and resolve_classifier("arithmetic_carries") is classify_carries
    assert (classify(text) == WORKED) == (mode in (CARRYING, WORKED))
