"""Property tests (hypothesis) for every shipped reward function (issue 19, item 7).

Random and adversarial completions and gold answers go to each function of ``armor_trl.rewards.REWARD_FUNCS``:
it never raises, returns one float in [0, 1] or None per completion, within its time bound, and a gold answer
that is "no answer" (None, NaN, "nan", "None") never scores.

The default run is bounded (a few dozen examples, some seconds). ``ARMOR_HYPOTHESIS_PROFILE=long`` runs many more:

    ARMOR_HYPOTHESIS_PROFILE=long pytest tests/test_reward_properties.py
"""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from armor_trl import rewards  # noqa: E402
from armor_trl.rewards import (  # noqa: E402
    ANSWER_FORMATS,
    REWARD_FUNCS,
    boxed_format_reward,
    configure_verifier,
    exact_integer_reward,
    final_integer_reward,
    gold_answer,
    math_verify_reward,
)

PROFILE = os.environ.get("ARMOR_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"ARMOR_HYPOTHESIS_PROFILE must be 'ci' (the default) or 'long', got {PROFILE!r}.")
# in-process rewards: examples per test; math_verify: fewer (a pathological example costs its budget and a restart)
EXAMPLES = {"ci": (40, 10), "long": (2000, 300)}[PROFILE]
SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]
IN_PROCESS = settings(max_examples=EXAMPLES[0], deadline=timedelta(seconds=5), suppress_health_check=SLOW)
VERIFIER = settings(max_examples=EXAMPLES[1], deadline=timedelta(seconds=60), suppress_health_check=SLOW)

IN_PROCESS_BOUND = 1.0  # seconds per call of a few completions of up to ~1 M characters (measured: milliseconds)
TIMEOUT, BUDGET = 0.5, 1.0  # math_verify here: seconds per completion and per call
HAND_OVER = 5.0  # on top of the budget: passing a few megabytes and replacing workers, on a shared, busy machine

# --- strategies --------------------------------------------------------------------------------------------------
PIECES = [
    "\\boxed{", "{", "}", "\\boxed{9^{9^{9^{9}}}}", "\\boxed{(10^{7})!}", "####", "#### ", "\n", "Answer:", "answer: ",
    "$", "\\$4.00", "33.333...%", "<<2*4=8>>", "\\frac{1}{2}", "\\sqrt{", "^{", "!", "-", "+", "0", "7", "1,234",
    "\u0664\u0667", "nan", "NaN", "None", "inf", " ", "\t", "\\", "\\text{", "__import__('os').system('true')",
    "lambda: 0", "\x00", "\ud800", "\U0001f600", "e", "x",
]
piece = st.sampled_from(PIECES)
repeated = st.builds(lambda p, n: p * n, piece, st.integers(0, 5_000))
huge = st.builds(lambda p, n: p * (n // max(1, len(p))), piece, st.integers(100_000, 1_000_000))
digits = st.builds(lambda sign, zeros, n, d: sign + "0" * zeros + d * n, st.sampled_from(["", "-", "+"]),
                   st.integers(0, 3), st.integers(1, 12_000), st.sampled_from("0123456789"))
text = st.one_of(
    st.text(max_size=60),
    st.lists(st.one_of(piece, repeated, st.text(max_size=10)), max_size=8).map("".join),
    huge,
    digits,
)
completion = st.one_of(
    text,
    text.map(lambda t: [{"role": "assistant", "content": t}]),
    text.map(lambda t: [{"role": "user", "content": "q"}, {"role": "assistant", "content": t}]),
    text.map(lambda t: [{"role": "assistant", "content": [{"type": "text", "text": t}]}]),
    st.sampled_from([None, [], {}, {"content": None}, [{"role": "assistant"}]]),
)
gold = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-10**30, 10**30),
    st.sampled_from(["nan", "NaN", "None", " none ", "<NA>", "", "72", "#### 72", "####",
                     "Each <<100/3=33.333>>33.333...% costs $4.00.\n#### 1,234", "\\frac{1}{2}", "(15,-29)"]),
    text,
)
random_batch = st.integers(1, 4).flatmap(lambda n: st.tuples(st.lists(completion, min_size=n, max_size=n),
                                                             st.lists(gold, min_size=n, max_size=n)))
# a completion that looks like its gold answer: long integers, "nan" against a NaN gold, a raw GSM8K solution
alike = st.one_of(
    st.tuples(digits, digits),
    digits.map(lambda d: (d, d)),
    st.tuples(st.sampled_from(["nan", "\\boxed{nan}", "n\\cdot a\\cdot n", "None", "\\boxed{None}"]),
              st.sampled_from([float("nan"), "nan", "NaN", "None", None])),
    st.tuples(st.sampled_from(["\\boxed{1234}", "1234", "#### 1,234"]),
              st.just("Each <<100/3=33.333>>33.333...% costs $4.00.\n#### 1,234")),
).map(lambda pair: ([pair[0]], [pair[1]]))
batch = st.one_of(random_batch, alike)


def check_rewards(values, golds):
    """One float in [0, 1] or None per completion; None wherever the gold answer is "no answer"."""
    assert isinstance(values, list) and len(values) == len(golds)
    for value, truth in zip(values, golds):
        assert value is None or (isinstance(value, float) and not math.isnan(value) and 0.0 <= value <= 1.0), value
        if gold_answer(truth) is None:
            assert value is None


def timed(function, *args, **kwargs):
    start = time.monotonic()
    values = function(*args, **kwargs)
    return values, time.monotonic() - start


# --- the properties ----------------------------------------------------------------------------------------------
def test_every_shipped_reward_function_is_covered():
    """A reward function added to REWARD_FUNCS must get its property test here too."""
    assert set(REWARD_FUNCS) == {"math_verify", "exact_integer", "final_integer", "format"}


@IN_PROCESS
@given(batch)
def test_final_integer_is_total_and_linear(completions_and_golds):
    completions, golds = completions_and_golds
    values, seconds = timed(final_integer_reward, completions, answer=golds)
    check_rewards(values, golds)
    assert seconds < IN_PROCESS_BOUND


@IN_PROCESS
@given(digits, st.text(alphabet="0123456789+=,#", max_size=30))
def test_final_integer_reads_only_the_text_after_the_last_hash(number, worked):
    """Whatever comes before the last '#' (worked steps, other '#'s) does not change the verdict."""
    assert final_integer_reward([f"{worked}#{number}", f"{worked}#{number}#"], answer=[number, number]) == [1.0, 0.0]


@IN_PROCESS
@given(batch)
def test_exact_integer_is_total_and_linear(completions_and_golds):
    completions, golds = completions_and_golds
    values, seconds = timed(exact_integer_reward, completions, answer=golds)
    check_rewards(values, golds)
    assert seconds < IN_PROCESS_BOUND


@IN_PROCESS
@given(digits, st.integers(0, 3))
def test_exact_integer_reads_integers_of_any_length(number, zeros):
    """An integer of any number of digits equals itself with extra leading zeros, and not its last digit changed."""
    sign, body = (number[0], number[1:]) if number[0] in "+-" else ("", number)
    values = exact_integer_reward([sign + "0" * zeros + body, body + "1"], answer=[number, number])
    assert values == [1.0, 0.0]


@IN_PROCESS
@given(st.lists(completion, min_size=1, max_size=4))
def test_format_reward_is_total_and_linear(completions):
    values, seconds = timed(boxed_format_reward, completions)
    assert len(values) == len(completions) and all(value in (0.0, 1.0) for value in values)
    assert seconds < IN_PROCESS_BOUND


@pytest.fixture(scope="module")
def small_verifier_budget():
    configure_verifier(timeout=TIMEOUT, batch_timeout=BUDGET, workers=2)
    yield
    configure_verifier(timeout=float(os.environ.get("ARMOR_VERIFIER_TIMEOUT", 10)),
                       batch_timeout=float(os.environ.get("ARMOR_VERIFIER_BATCH_TIMEOUT", 60)),
                       workers=int(os.environ.get("ARMOR_VERIFIER_WORKERS", min(4, os.cpu_count() or 1))))


@VERIFIER
@given(batch, st.lists(st.sampled_from([*ANSWER_FORMATS, None]), min_size=4, max_size=4))
def test_math_verify_is_total_and_bounded_per_call(small_verifier_budget, completions_and_golds, formats):
    completions, golds = completions_and_golds
    formats = formats[: len(completions)]
    assert math_verify_reward([r"\boxed{1}"], answer=["1"])[0] in (1.0, None)  # workers replaced before are up
    before = rewards.verifier_timeouts()
    values, seconds = timed(math_verify_reward, completions, answer=golds, answer_format=formats)
    check_rewards(values, golds)
    assert seconds < BUDGET + HAND_OVER
    assert rewards.verifier_timeouts() - before <= values.count(None)
