"""Reward functions: math-verify on \\boxed{} / #### / plain answers, the exact-integer verifier, name resolution."""

from __future__ import annotations

import pytest

from armor_trl.rewards import (
    REWARD_FUNCS,
    boxed_format_reward,
    exact_integer_reward,
    math_verify_reward,
    resolve_reward,
    resolve_rewards,
)


def chat(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"So the total is \boxed{72}.", "72", 1.0),
        (r"So the total is \boxed{71}.", "72", 0.0),
        ("48 + 24 = 72 clips.\n#### 72", "72", 1.0),
        ("48 + 24 = 72 clips.\n#### 73", "72", 0.0),
        ("72", "72", 1.0),
        ("The answer is 1234", "1,234", 1.0),  # GSM8K-style thousands separator in the ground truth
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),  # symbolic equivalence, not string match
        (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
        ("I do not know", "72", 0.0),
        ("", "72", 0.0),
    ],
)
def test_math_verify_answer_forms(completion, answer, expected):
    assert math_verify_reward([completion], answer=[answer]) == [expected]
    assert math_verify_reward([chat(completion)], answer=[answer]) == [expected]


def test_math_verify_cannot_judge_without_ground_truth():
    assert math_verify_reward(["42"], answer=[None]) == [None]
    assert math_verify_reward(["42"], answer=[""]) == [None]
    assert math_verify_reward(["42"], answer=["no number here"]) == [None]
    assert math_verify_reward(["42", "41"]) == [None, None]  # no ground-truth column at all


def test_math_verify_reads_a_full_solution_column():
    solution = r"Add them: $40 + 2 = 42$, so the answer is $\boxed{42}$."
    assert math_verify_reward([r"\boxed{42}", r"\boxed{24}"], solution=[solution, solution]) == [1.0, 0.0]


def test_math_verify_takes_trl_keyword_arguments():
    """GRPOTrainer passes every dataset column and extra keywords; the verifier must ignore the rest."""
    rewards = math_verify_reward(
        [chat(r"\boxed{5}")], answer=["5"], prompts=[[{"role": "user", "content": "2+3?"}]],
        completion_ids=[[1, 2]], trainer_state=None, log_extra=None, log_metric=None, level=["Level 1"],
    )
    assert rewards == [1.0]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("47", "47", 1.0),
        (" 47\n", "47", 1.0),
        ("047", "47", 1.0),
        ("-3", "-3", 1.0),
        ("48", "47", 0.0),
        ("470", "47", 0.0),
        ("47 and more", "47", 0.0),
        ("4 7", "47", 0.0),
        ("", "47", 0.0),
        ("47", "forty-seven", None),
        ("47", None, None),
    ],
)
def test_exact_integer(completion, answer, expected):
    assert exact_integer_reward([completion], answer=[answer]) == [expected]
    assert exact_integer_reward([chat(completion)], answer=[answer]) == [expected]


def test_exact_integer_checks_lengths():
    with pytest.raises(ValueError, match="2 completions but 1 ground truths"):
        exact_integer_reward(["1", "2"], answer=["1"])


def test_format_reward():
    assert boxed_format_reward([r"so \boxed{3}", "#### 3", "3", r"\boxed{}"]) == [1.0, 1.0, 0.0, 0.0]


def test_registry_and_names_for_trl_metrics():
    assert set(REWARD_FUNCS) == {"math_verify", "exact_integer", "format"}
    for name, function in REWARD_FUNCS.items():
        assert resolve_reward(name) is function
        assert function.__name__ == name  # TRL logs rewards/<__name__>/mean


def test_resolve_dotted_paths(tmp_path, monkeypatch):
    assert resolve_reward("armor_trl.rewards:exact_integer_reward") is exact_integer_reward
    assert resolve_reward("armor_trl.rewards.exact_integer_reward") is exact_integer_reward
    (tmp_path / "my_recipe_rewards.py").write_text("def short(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)  # like `trl grpo`, a module next to the recipe is importable
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward("my_recipe_rewards:short")(["a", "b"]) == [1.0, 1.0]
    assert resolve_rewards("math_verify, format") == [math_verify_reward, boxed_format_reward]


@pytest.mark.parametrize("name", ["no_such_reward", "armor_trl.rewards:nope", "no_such_module_xyz.f", "armor_trl.rewards:REWARD_FUNCS"])
def test_resolve_errors(name):
    with pytest.raises(ValueError):
        resolve_reward(name)
