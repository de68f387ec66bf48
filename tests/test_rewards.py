"""Reward functions: math-verify on \\boxed{} / #### / Answer: / plain answers, its worker pool and timeouts,
the exact-integer verifier, name resolution (built-in, trl.rewards, import paths), a light import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from armor_trl import rewards
from armor_trl.rewards import (
    REWARD_FUNCS,
    boxed_format_reward,
    configure_verifier,
    exact_integer_reward,
    final_answer,
    math_verify_reward,
    resolve_reward,
    resolve_rewards,
    verifier_timeouts,
)
from armor_trl.rewards import verifier  # the verifier's state: its pool, settings and worker command

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


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
    assert math_verify_reward(["42"], answer=[r"\text{}"]) == [None]  # nothing math-verify can read
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
    assert set(REWARD_FUNCS) == {"math_verify", "exact_integer", "final_integer", "format"}
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


# --- gold answers are read as LaTeX (issue 9, item 1) ------------------------------------------------------------
def math500_hard_golds():
    """36 MATH-500 answers (HuggingFaceH4/MATH-500 test split, copied from MobileLLM/BudgetThinker
    evaluation/data/math500/test_ori.jsonl) that math-verify misread when the gold was parsed without ``$...$``:
    a correct boxed answer scored 0 or None, and for many the gold's first integer (``wrong``) scored 1."""
    with open(os.path.join(FIXTURES, "math500_hard_golds.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_math500_golds_judge_right_and_wrong_answers():
    rows = math500_hard_golds()
    golds = [row["answer"] for row in rows]
    right = math_verify_reward([rf"The answer is $\boxed{{{g}}}$." for g in golds], answer=golds)
    wrong = math_verify_reward([rf"The answer is $\boxed{{{row['wrong']}}}$." for row in rows], answer=golds)
    assert [g for g, r in zip(golds, right) if r != 1.0] == []  # no false negatives (nor "cannot judge")
    assert [(row["answer"], row["wrong"]) for row, r in zip(rows, wrong) if r != 0.0] == []  # no false positives


@pytest.mark.parametrize("gold, right, wrong", [
    (r"3\sqrt{13}", r"3\sqrt{13}", "3"),
    (r"\frac{14}{3}", r"\frac{14}{3}", "14"),
    (r"(3, \frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)", "3"),
    ("p - q", "p-q", "p + q"),
    (r"\text{Evelyn}", r"\text{Evelyn}", r"\text{Navin}"),
    (r"11\sqrt2", r"11\sqrt{2}", "11"),
    (r"\$32{,}348", "32348", "32"),
    (r"10\%", r"10\%", "20"),
    ("x^2+7x+10", "x^2 + 7x + 10", "x^2+7x"),
    ("(15,-29)", "(15, -29)", "(15, 29)"),
    ("025", "25", "52"),  # AIME answers with leading zeros
])
def test_latex_golds_without_delimiters(gold, right, wrong):
    assert math_verify_reward([rf"\boxed{{{right}}}", rf"\boxed{{{wrong}}}"], answer=[gold, gold]) == [1.0, 0.0]


# --- the final-answer rule per dataset (items 3 and 4) ------------------------------------------------------------
def gsm8k_late_numbers():
    """Worked solutions, each with "#### {}" in place of its answer: rows 393, 226 and 258 of the GSM8K test set
    (openai/grade-school-math, grade_school_math/data/test.jsonl), whose last lines before #### hold another
    number ("= 20%", "rounds down to 33%", "$6.00")."""
    with open(os.path.join(FIXTURES, "gsm8k_test_late_numbers.jsonl")) as f:
        return [json.loads(line)["answer"].rsplit("####", 1)[0] + "#### {}" for line in f]


@pytest.mark.parametrize("answer_format", [{"answer_format": "gsm8k"}, {}], ids=["gsm8k", "no column"])
def test_gsm8k_final_line_wins(answer_format):
    carol, pokemon, nancy = gsm8k_late_numbers()
    assert math_verify_reward([carol.format(18)], answer=["18"], **answer_format) == [1.0]  # "= 20%" came last
    assert math_verify_reward([carol.format(18)], answer=["20"], **answer_format) == [0.0]
    assert math_verify_reward([carol.format(21)], answer=["20"], **answer_format) == [0.0]
    assert math_verify_reward([carol.format(20)], answer=["20"], **answer_format) == [1.0]
    assert math_verify_reward([pokemon.format(33)], answer=["33"], **answer_format) == [1.0]
    assert math_verify_reward([pokemon.format(34)], answer=["33"], **answer_format) == [0.0]
    assert math_verify_reward([nancy.format(6), nancy.format(7)], answer=["6", "6"], **answer_format) == [1.0, 0.0]


DAPO_541 = "... so the maximum is $\\boxed{540}$.\nChecking once more, I get 541.\n\nAnswer: 541"
DAPO_540 = "... so the maximum is $\\boxed{541}$.\nChecking once more, I get 540.\n\nAnswer: 540"


@pytest.mark.parametrize("answer_format", [{"answer_format": ["dapo"]}, {}], ids=["dapo", "no column"])
def test_dapo_last_answer_line_wins(answer_format):
    assert math_verify_reward([DAPO_541], answer=["540"], **answer_format) == [0.0]
    assert math_verify_reward([DAPO_540], answer=["540"], **answer_format) == [1.0]
    assert math_verify_reward(["**Answer:** $540$."], answer=["540"], **answer_format) == [1.0]


def test_dapo_format_needs_an_answer_line():
    """DAPO's own checker scores a completion without an 'Answer:' line as wrong, whatever it boxed."""
    assert math_verify_reward([r"\boxed{540}"], answer=["540"], answer_format="dapo") == [0.0]
    assert math_verify_reward([r"\boxed{540}"], answer=["540"]) == [1.0]  # auto: the box is the final answer


def test_boxed_format_takes_the_last_box():
    text = r"First guess $\boxed{540}$; on reflection the answer is $\boxed{541}$."
    assert math_verify_reward([text, text], answer=["541", "540"], answer_format=["boxed", "boxed"]) == [1.0, 0.0]
    assert final_answer(text, "boxed") == r"\boxed{541}"
    assert final_answer(r"\boxed{\frac{1}{2}} and more", "boxed") == r"\boxed{\frac{1}{2}}"
    assert final_answer("Answer: 5\n\\boxed{6}", "auto") == r"\boxed{6}"  # auto: the last marker
    assert final_answer("\\boxed{6}\nAnswer: 5", "auto") == "5"
    assert final_answer("no marker 7", "gsm8k") == "no marker 7"  # no ####: as boxed, then the whole text
    assert final_answer("no marker 7", "dapo") is None


@pytest.mark.parametrize("line, gold, expected", [
    ("Answer: 1,234 apples", "1234", 1.0),
    ("Answer: 3\\sqrt{13}", "3\\sqrt{13}", 1.0),
    ("Answer: 3\\sqrt{13}", "3", 0.0),  # read whole, not as its first number
    ("Answer: (15,-29)", "(15,-29)", 1.0),
    ("Answer: 2k+2", "2", 0.0),
    ("Answer: -2,1", "-2,1", 1.0),  # a list, not a number with a thousands separator
    ("Answer: -2,1", "-21", 0.0),
    ("Final Answer: The final answer is 5. I hope it is correct.", "5", 1.0),
    ("Answer: $\\frac{1}{2}$.", "0.5", 1.0),
    ("#### 1,234", "1234", 1.0),
])
def test_final_answer_lines_are_read_whole(line, gold, expected):
    assert math_verify_reward([f"Some work with 99 and 7.\n{line}"], answer=[gold]) == [expected]


def test_unknown_answer_format_names_the_column():
    with pytest.raises(ValueError, match="answer_format column.*'latex'"):
        math_verify_reward(["1"], answer=["1"], answer_format=["latex"])
    with pytest.raises(ValueError, match="2 completions but 1 answer_format"):
        math_verify_reward(["1", "2"], answer=["1", "2"], answer_format=["boxed"])


# --- a verifier call never stalls (item 5) ----------------------------------------------------------------------
@pytest.fixture
def short_verifier_timeout():
    configure_verifier(timeout=2, workers=1)
    yield
    configure_verifier(timeout=float(os.environ.get("ARMOR_VERIFIER_TIMEOUT", 10)),
                       workers=int(os.environ.get("ARMOR_VERIFIER_WORKERS", min(4, os.cpu_count() or 1))))


@pytest.mark.parametrize("pathological", [r"\boxed{9^{9^{9^{9}}}}", "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}"],
                         ids=["power tower", "5000 nested braces"])
def test_pathological_input_in_a_worker_thread_times_out(short_verifier_timeout, pathological):
    """math-verify's own timeouts need the main thread; from any thread the pool kills a stuck worker."""
    result, before = {}, verifier_timeouts()

    def call():
        start = time.monotonic()
        result["rewards"] = math_verify_reward([pathological, r"\boxed{2}", r"\boxed{3}"], answer=["2", "2", "2"])
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the reward call stalled"
    assert result["rewards"] == [None, 1.0, 0.0]  # cannot judge the stuck one; the others are still judged
    assert result["seconds"] < 30
    assert verifier_timeouts() == before + 1
    assert math_verify_reward([r"\boxed{4}"], answer=["4"]) == [1.0]  # the replaced worker serves later calls


def test_a_worker_that_cannot_start_is_an_error(monkeypatch):
    configure_verifier(workers=1)  # a fresh pool, started with the broken command below
    monkeypatch.setattr(verifier, "_WORKER_CODE", "import sys; sys.exit('no math-verify here')")
    try:
        with pytest.raises(RuntimeError, match="verifier worker process exited"):
            math_verify_reward([r"\boxed{1}"], answer=["1"])
    finally:
        monkeypatch.undo()
        configure_verifier(workers=int(os.environ.get("ARMOR_VERIFIER_WORKERS", min(4, os.cpu_count() or 1))))
    assert math_verify_reward([r"\boxed{1}"], answer=["1"]) == [1.0]


def test_configure_verifier_rejects_bad_values():
    with pytest.raises(ValueError, match="timeout"):
        configure_verifier(timeout=0)
    with pytest.raises(ValueError, match="workers"):
        configure_verifier(workers=0)


def test_many_completions_across_workers_keep_their_order():
    golds = [str(i) for i in range(40)]
    completions = [rf"\boxed{{{i if i % 3 else i + 1}}}" for i in range(40)]
    assert math_verify_reward(completions, answer=golds) == [0.0 if i % 3 == 0 else 1.0 for i in range(40)]


# --- TRL's reward names (item 15) and a light import (item 19) ---------------------------------------------------
@pytest.mark.parametrize("name", ["accuracy_reward", "reasoning_accuracy_reward", "think_format_reward"])
def test_trl_reward_names(name):
    import trl.rewards

    assert resolve_reward(name) is getattr(trl.rewards, name)


def test_trl_reward_works_from_a_recipe_name():
    accuracy, think = resolve_rewards("accuracy_reward, think_format_reward")
    assert accuracy([[{"role": "assistant", "content": r"\boxed{4}"}]], solution=["$4$"]) == [1.0]
    assert think([[{"role": "assistant", "content": "<think>\nhm\n</think>\n4"}]]) == [1.0]


def test_trl_reward_factories_explain_themselves():
    with pytest.raises(ValueError, match="get_soft_overlong_punishment.*my_rewards"):
        resolve_reward("get_soft_overlong_punishment")
    with pytest.raises(ValueError, match="Unknown reward function 'accuracy_rewards'"):
        resolve_reward("accuracy_rewards")  # a submodule of trl.rewards, not a reward


def test_import_is_light():
    """Reward workers import this module: no torch, transformers, TRL or math-verify in the parent."""
    code = ("import sys, armor_trl.rewards as r; r.resolve_reward('math_verify'); "
            "print([m for m in ('torch', 'transformers', 'trl', 'math_verify') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- hostile completions and gold answers (issue 19, items 1, 2 and 4) -------------------------------------------
@pytest.mark.parametrize("completion, answer, expected", [
    ("7" * 5000, "7" * 5000, 1.0),  # past Python's 4,300-digit limit of int()
    ("7" * 4999 + "8", "7" * 5000, 0.0),
    ("0007" + "1" * 9000, "+7" + "1" * 9000, 1.0),  # sign and leading zeros aside, as int() compared them
    ("-" + "9" * 6000, "9" * 6000, 0.0),
    ("-0", "0", 1.0),
    ("\u0664\u0667", "47", 1.0),  # Arabic-Indic digits, which int() read too
    ("1" * 1_000_000, "1" * 999_999, 0.0),
])
def test_exact_integer_compares_integers_of_any_length(completion, answer, expected):
    assert exact_integer_reward([completion], answer=[answer]) == [expected]


def test_exact_integer_takes_whole_number_floats_as_integers():
    """A column of integers with a missing value becomes floats (72.0) when read through pandas."""
    assert exact_integer_reward(["72", "72"], answer=[72.0, 72]) == [1.0, 1.0]


@pytest.mark.parametrize("text", ["\\boxed{" * 32_000, "\\boxed{x" * 28_000, "#### " + " " * 224_000,
                                  "####\n" * 45_000, "x" * 224_000], ids=["boxed", "boxed-x", "hash-spaces",
                                                                         "hash-lines", "plain"])
def test_format_reward_is_linear_in_the_completion_length(text):
    """224 k characters of \\boxed{ took 2.4 s (quadratic: about 50 s at 1 M); now milliseconds per megabyte."""
    start = time.monotonic()
    boxed_format_reward([text, text * 4])
    assert time.monotonic() - start < 0.5


@pytest.mark.parametrize("text", [r"so \boxed{3}", "#### 3", "3", r"\boxed{}", r"\boxed{}}", r"\boxed{ }",
                                  "\\boxed{\n}", r"\boxed{a", "x\n####  5", "x ####5", "####\n\n7",
                                  r"\boxed{} and \boxed{2}", r"} \boxed{", r"\boxed{{}", "", "####"])
def test_format_reward_keeps_its_rule(text):
    """The same verdicts as the pattern it replaced, ``\\boxed\\{.+\\}|^####\\s*\\S`` (multiline, dotall)."""
    import re

    rule = re.compile(r"\\boxed\{.+\}|^####\s*\S", re.MULTILINE | re.DOTALL)
    assert boxed_format_reward([text]) == [float(rule.search(text) is not None)]


@pytest.mark.parametrize("text", ["\\boxed{" * 150_000, "Answer: " + "a" * 30_000, ("\\boxed{1}" + "{" * 10) * 50_000],
                         ids=["unclosed boxes", "a long word after Answer:", "closed box then unclosed braces"])
def test_reading_the_final_answer_is_linear(text):
    """The final answer of a completion is read in the worker before math-verify: once quadratic (a 30 k-letter
    word after 'Answer:' took a worker 30 s, 150 k unclosed boxes several minutes), now milliseconds."""
    start = time.monotonic()
    final_answer(text, "auto")
    assert time.monotonic() - start < 1.0
    assert final_answer("x \\boxed{1} \\boxed{2" + "{" * 3, "boxed") == "\\boxed{1}"
    assert final_answer("\\boxed{\\boxed{1}", "boxed") == "\\boxed{1}"


FLOOD_KINDS = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{(10^{7})!}", "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
               "\\boxed{" * 150_000, "\\boxed{" * 32_000, "9" * 1_000_000, "x" * 1_000_000, "7" * 5000]


@pytest.fixture
def verifier_budget():
    configure_verifier(timeout=1, batch_timeout=3, workers=2)
    yield 3
    configure_verifier(timeout=float(os.environ.get("ARMOR_VERIFIER_TIMEOUT", 10)),
                       batch_timeout=float(os.environ.get("ARMOR_VERIFIER_BATCH_TIMEOUT", 60)),
                       workers=int(os.environ.get("ARMOR_VERIFIER_WORKERS", min(4, os.cpu_count() or 1))))


def test_a_flood_of_pathological_completions_costs_at_most_the_call_budget(verifier_budget):
    """64 completions of the worst kinds: each verifier call ends within its budget (plus handing 64 MB to the
    workers), the rest score None and are counted, and the next call is judged normally."""
    flood = [FLOOD_KINDS[i % len(FLOOD_KINDS)] for i in range(64)]
    assert math_verify_reward([r"\boxed{1}"], answer=["1"]) == [1.0]  # the workers are up
    before = verifier_timeouts()
    start = time.monotonic()
    result = math_verify_reward(flood, answer=["2"] * 64)
    seconds = time.monotonic() - start
    assert seconds < verifier_budget + 5, seconds  # one timeout after another: 16 s and more (measured: 3.6 s)
    assert len(result) == 64 and all(r in (None, 0.0) for r in result)
    assert verifier_timeouts() - before == result.count(None) >= 32
    assert boxed_format_reward(flood) == [float(i % 8 < 3) for i in range(64)]
    assert exact_integer_reward(flood, answer=["7" * 5000] * 64) == [float(i % 8 == 7) for i in range(64)]
    assert math_verify_reward([r"\boxed{2}", r"\boxed{3}"], answer=["2", "2"]) == [1.0, 0.0]


@pytest.mark.parametrize("variable, value", [
    ("ARMOR_VERIFIER_TIMEOUT", "0"), ("ARMOR_VERIFIER_TIMEOUT", "-1"), ("ARMOR_VERIFIER_TIMEOUT", "nan"),
    ("ARMOR_VERIFIER_TIMEOUT", "inf"), ("ARMOR_VERIFIER_TIMEOUT", "abc"), ("ARMOR_VERIFIER_BATCH_TIMEOUT", "0"),
    ("ARMOR_VERIFIER_BATCH_TIMEOUT", "nan"), ("ARMOR_VERIFIER_WORKERS", "0"), ("ARMOR_VERIFIER_WORKERS", "2.5"),
    ("ARMOR_VERIFIER_WORKERS", "many"),
])
def test_verifier_environment_variables_are_checked_where_read(monkeypatch, variable, value):
    """0 or -1 scored every completion None, nan disabled the timeout, abc failed at import: now each is a
    ValueError naming the variable and what it takes, raised by the first call (not at import)."""
    monkeypatch.setattr(verifier, "_settings", {})  # what configure_verifier set (in other tests) does not count
    monkeypatch.setattr(verifier, "_pool", None)  # a pool is made from the settings on the next call
    monkeypatch.setenv(variable, value)
    allowed = "a whole number >= 1" if variable.endswith("WORKERS") else "a positive, finite number of seconds"
    with pytest.raises(ValueError, match=f"{variable} must be {allowed}; got '{value}'"):
        math_verify_reward([r"\boxed{1}"], answer=["1"])
    with pytest.raises(ValueError, match=variable):
        rewards.verifier_settings()


def test_verifier_environment_variables_set_the_settings(monkeypatch):
    monkeypatch.setattr(verifier, "_settings", {})
    monkeypatch.setenv("ARMOR_VERIFIER_TIMEOUT", " 2.5 ")
    monkeypatch.setenv("ARMOR_VERIFIER_BATCH_TIMEOUT", "")  # empty: the default
    monkeypatch.setenv("ARMOR_VERIFIER_WORKERS", "3")
    assert rewards.verifier_settings() == {"timeout": 2.5, "batch_timeout": 60.0, "workers": 3}


def test_a_bad_verifier_variable_does_not_break_the_import():
    env = dict(os.environ, ARMOR_VERIFIER_TIMEOUT="abc")
    code = ("import armor_trl.rewards as r\ntry:\n    r.math_verify_reward(['1'], answer=['1'])\n"
            "except ValueError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert "ARMOR_VERIFIER_TIMEOUT must be a positive, finite number of seconds; got 'abc'" in out.stdout


@pytest.mark.parametrize("argument, value", [("timeout", float("nan")), ("timeout", float("inf")), ("timeout", -1),
                                             ("batch_timeout", 0), ("workers", 1.5), ("workers", "x")])
def test_configure_verifier_rejects_non_finite_values(argument, value):
    with pytest.raises(ValueError, match=f"{argument} must be"):
        configure_verifier(**{argument: value})


@pytest.mark.parametrize("reward", [math_verify_reward, exact_integer_reward], ids=["math_verify", "exact_integer"])
def test_missing_nan_and_none_golds_are_no_answer_and_counted(reward):
    """A JSON NaN gold became the string 'nan', and \\boxed{nan} (or n\\cdot a\\cdot n) scored 1.0; 'None' the same."""
    golds = [float("nan"), "nan", "NaN", "None", " none ", None, "<NA>", ""]
    completions = [r"\boxed{nan}", r"n\cdot a\cdot n", "nan", r"\boxed{None}", "None", "None", "<NA>", ""]
    before = rewards.missing_gold_answers()
    assert reward(completions, answer=golds) == [None] * len(golds)
    assert rewards.missing_gold_answers() - before == len(golds)
    assert reward(["5"], answer=["5"]) == [1.0]  # real golds are unaffected and not counted
    assert rewards.missing_gold_answers() - before == len(golds)


def test_a_raw_gsm8k_solution_as_gold_is_read_by_its_final_line():
    """openai/gsm8k passed straight to the trainer: the gold is the worked solution. math-verify misjudged
    test rows 226 and 258 (a '33%' and a '$6.00' before '#### N'); the '#### N' line is now read first."""
    with open(os.path.join(FIXTURES, "gsm8k_test_late_numbers.jsonl")) as f:
        _, pokemon, nancy = [json.loads(line)["answer"] for line in f]
    made_up = "Each gets 100/3 = <<100/3=33.333>>33.333...%.\nThe pen costs $4.00, so 2 cost <<2*4=8>>8.\n#### 1,208"
    golds = [pokemon, nancy, made_up]
    assert math_verify_reward([r"\boxed{33}", r"\boxed{6}", r"\boxed{1208}"], answer=golds) == [1.0, 1.0, 1.0]
    assert math_verify_reward([r"\boxed{34}", r"\boxed{4}", r"\boxed{8}"], answer=golds) == [0.0, 0.0, 0.0]
    assert exact_integer_reward(["33", "1208"], answer=[pokemon, made_up]) == [1.0, 1.0]
    assert rewards.gold_answer("Work.\n####") is None  # nothing after the marker: no answer


@pytest.mark.parametrize("completion", [None, [], {}, {"content": None}, [{"role": "assistant"}],
                                        [{"role": "assistant", "content": [{"type": "text", "text": "\\boxed{4}"}]}]])
def test_odd_completion_shapes_are_read_not_raised(completion):
    assert math_verify_reward([completion], answer=["4"])[0] in (0.0, 1.0)
    assert exact_integer_reward([completion], answer=["4"]) == [0.0]
    assert boxed_format_reward([completion])[0] in (0.0, 1.0)
