"""Validation of an agent through TRL's own tool loop (armor_trl.callbacks.tool_evaluation), and the tool-use
testbed's pieces: an unreliable tool, the warm start's retry conversation, the tool-use and digit classifiers, the
held-out set's own digits."""

from __future__ import annotations

import re

import pytest
from transformers.utils import get_json_schema

from armor_trl.app.tool_testbed import TIMEOUT, add, conversation, resolve_tools, unreliable, warm_start_examples
from armor_trl.callbacks.evaluation import evaluate_with_trainer
from armor_trl.callbacks.validation import ValidationCallback
from armor_trl.data.datasets import arithmetic_splits
from armor_trl.rewards.modes import classify_tool_use, prompt_operand_digits, resolve_classifier, resolve_prompt_classifier
from testing import ToolFake, answer_reward, build_tool_trainer, chat_numbers, last_tool_result, tool_call


def calls_on_even(text: str) -> str:
    """The policy: on "n*3?" with n even it calls multiply(n, 3) and answers with the result; with n odd it answers
    7 at once."""
    result = last_tool_result(text)
    if result is not None:
        return f"{result}</s>"
    n = int(re.search(r"u:(\d+)\*", text).group(1))
    return tool_call("multiply", a=n, b=3) if n % 2 == 0 else "7</s>"


def test_validation_runs_the_policys_samples_through_trls_tool_loop(tool_model, tool_tokenizer, tmp_path,
                                                                    monkeypatch):
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)))
    ToolFake(tool_tokenizer, trainer, policy_turn=calls_on_even, policy_tools=True).install(monkeypatch)
    result = evaluate_with_trainer(trainer, chat_numbers(range(4)), answer_reward, k=2, num_samples=2, seed=0,
                                   classify=classify_tool_use, max_new_tokens=96)
    # n = 0, 2 call the tool and answer from its result (right); n = 1, 3 answer 7 (wrong)
    assert result["correct_counts"] == [2, 0, 2, 0]
    assert result["avg@2"] == 0.5
    assert result["tool_call_rate"] == 0.5 and result["tool_calls"] == 0.5
    assert result["mode_shares"] == {"tool": 0.5, "no_tool": 0.5}
    assert result["samples"][0][0] == tool_call("multiply", a=0, b=3).removesuffix("</s>") + "\nt:0\na:0"


def test_without_tools_validation_reports_no_tool_metrics(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), tools=())
    ToolFake(tool_tokenizer, trainer, policy_turn=lambda text: "6</s>").install(monkeypatch)
    result = evaluate_with_trainer(trainer, chat_numbers(range(4)), answer_reward, k=1, seed=0, max_new_tokens=8)
    assert result["correct_counts"] == [0, 0, 1, 0] and "tool_call_rate" not in result


def test_the_validation_callback_logs_the_tool_call_rate(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)))
    ToolFake(tool_tokenizer, trainer, policy_turn=calls_on_even, policy_tools=True).install(monkeypatch)
    callback = ValidationCallback({None: chat_numbers(range(4)), "odd": chat_numbers([1, 3])}, answer_reward,
                                  every_steps=1, k=1, max_new_tokens=96, trainer=trainer)
    values = callback._evaluate(trainer.state, trainer.model, tool_tokenizer)
    assert values["val/tool_call_rate"] == 0.5 and values["val/odd/tool_call_rate"] == 0.0
    assert values["val/avg@1"] == 0.5 and values["val/odd/tool_calls"] == 0.0


def test_validation_with_environment_factory_is_refused_naming_why(tool_model, tool_tokenizer, tmp_path):
    from armor_trl.callbacks.tool_evaluation import check_tool_validation

    class Calculator:
        def reset(self, **row):
            return None

        def multiply(self, a: int, b: int) -> int:
            """
            Multiplies two integers.

            Args:
                a: The first integer.
                b: The second integer.
            """
            return a * b

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), tools=(),
                                 environment_factory=Calculator)
    with pytest.raises(ValueError, match="environment_factory is not supported.*tools="):
        check_tool_validation(trainer)


# --- the tool-use testbed's pieces ------------------------------------------------------------------------------
def test_an_unreliable_tool_fails_on_its_share_of_calls_and_keeps_its_schema():
    flaky = unreliable(add, 0.3, seed=5)
    assert flaky.__name__ == "add" and get_json_schema(flaky) == get_json_schema(add)
    outcomes = []
    for _ in range(2000):
        try:
            outcomes.append(flaky(2, 3) == 5)
        except TimeoutError as error:
            assert str(error) == TIMEOUT.format(name="add")
            outcomes.append(False)
    assert 0.25 < outcomes.count(False) / len(outcomes) < 0.35
    again = unreliable(add, 0.3, seed=5)

    def draws(tool):
        out = []
        for _ in range(50):
            try:
                out.append(tool(1, 1))
            except TimeoutError:
                out.append(None)
        return out

    assert draws(unreliable(add, 0.3, seed=5)) == draws(again)  # the failures repeat with the seed
    assert unreliable(add, 0.0) is add and resolve_tools(["add"], 0.0) == [add]
    with pytest.raises(ValueError, match="tool_failure_rate must lie in \\[0, 1\\)"):
        unreliable(add, 1.0)


def test_the_warm_starts_retry_is_the_result_trl_writes_for_a_tool_that_timed_out():
    messages = conversation(3, 4, "retry")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    try:
        unreliable(add, 0.999999, seed=0)(3, 4)
    except TimeoutError as error:  # TRL's loop: result = {"error": str(e)}, written as str(result)
        assert messages[2]["content"] == str({"error": str(error)})
    assert messages[4]["content"] == "7" and messages[5]["content"] == "7"
    with pytest.raises(ValueError, match="Unknown way 'guess'"):
        conversation(3, 4, "guess")


def test_warm_start_problems_mix_digits_and_never_draw_excluded_ones(tool_tokenizer):
    held_out = {f"{a}+{b}=" for a in range(10, 100) for b in range(10, 60)}
    examples = warm_start_examples(tool_tokenizer, 200, seed=0, digits={1: 0.5, 2: 0.5}, direct_share=0.3,
                                   wrong_name_share=0.0, retry_share=0.2, exclude=held_out)
    prompts = [re.search(r"u:(\d+\+\d+=)", tool_tokenizer.decode(ids)).group(1) for ids, _ in examples]
    assert not set(prompts) & held_out
    lengths = {len(p.split("+")[0]) for p in prompts}
    assert lengths == {1, 2}
    with pytest.raises(ValueError, match="way shares"):
        warm_start_examples(tool_tokenizer, 1, seed=0, direct_share=0.6, retry_share=0.6)


def test_tool_use_and_digit_classifiers():
    assert classify_tool_use('<tool_call>{"name": "add"}</tool_call>\nt:7\na:7') == "tool"
    assert classify_tool_use("7") == "no_tool"
    assert resolve_classifier("tool_use") is classify_tool_use
    assert prompt_operand_digits("u:3+4=\na:") == "1_digit" and prompt_operand_digits("u:3+45=") == "2_digit"
    assert prompt_operand_digits("hello") == "other"
    assert resolve_prompt_classifier("arithmetic_digits") is prompt_operand_digits


def test_the_held_out_problems_may_have_their_own_digits():
    train, held_out = arithmetic_splits(64, 32, seed=1, digits=1, eval_digits=2)
    assert all(len(a) == 1 and len(b) == 1 for a, b in (p.removesuffix("=").split("+") for p in train["prompt"]))
    assert all(len(a) == 2 and len(b) == 2 for a, b in (p.removesuffix("=").split("+") for p in held_out["prompt"]))
    # the same held-out set as a 2-digit task's (it depends on its own digits only)
    assert held_out["prompt"] == arithmetic_splits(8, 32, seed=1, digits=2)[1]["prompt"]
