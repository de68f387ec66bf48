r"""The verifiable reward functions (:data:`REWARD_FUNCS`: :func:`math_verify_reward`, :func:`exact_integer_reward`,
:func:`final_integer_reward`, :func:`boxed_format_reward`), the gold answer of each completion they judge (missing
ones counted by :func:`missing_gold_answers`), and the resolution of a reward's name (:func:`resolve_reward`). It
imports only the standard library (and ``trl.rewards`` when a name asks for it).

Every reward function here is ``f(completions, **kwargs) -> list[float | None]``: ``completions`` are strings or
chat message lists (``[{"role": "assistant", "content": ...}]``), dataset columns arrive as keyword
arguments (the ground truth in ``answer``, or ``solution`` as a fallback), and ``None`` means "cannot judge"
(no or unparseable ground truth, or a verifier call that timed out), which TRL leaves out of the reward
statistics and ARMOR never counts as a verified anchor.

Bounds. No completion or gold answer of any length or content raises out of a reward function. The in-process
rewards (:func:`exact_integer_reward`, :func:`boxed_format_reward`, and :func:`math_verify_reward`'s own part) are
linear in the completion's length: integers of any number of digits are compared as digit strings, never with
``int()``. math-verify runs in worker processes (:mod:`armor_trl.rewards.verifier`) with a hard timeout per
completion and a budget per call: once a call has run ``ARMOR_VERIFIER_BATCH_TIMEOUT`` seconds (default 60) from the
moment its workers were ready, every completion still waiting scores ``None`` (counted by
:func:`armor_trl.rewards.verifier_timeouts`) and the busy workers are replaced. Measured on 2 CPU cores with 64
completions of the worst kinds (``\boxed{9^{9^{9^9}}}``, ``\boxed{(10^{7})!}``, 5,000 nested braces, 150,000 and
224,000 × ``\boxed{``, 1 M characters, 5,000-digit integers, cycled): ``math_verify`` took 60.9 s with the default
settings (3.6 s with a 1 s timeout and a 3 s budget: the budget plus about 0.6 s to hand 64 MB to the workers),
``format`` 0.13 s and ``exact_integer`` 0.04 s for the whole batch; the call after a cut-short one first waits for
its replaced workers to start (about 2 s).

Built-in names (:data:`REWARD_FUNCS`) and TRL's reward names (``accuracy_reward``, ``think_format_reward``, ... from
``trl.rewards``) resolve with :func:`resolve_reward`, as do import paths ``pkg.mod:func`` or ``pkg.mod.func``.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence

from armor_trl.rewards.answers import ANSWER_FORMATS, completion_text, gold_answer
from armor_trl.rewards.verifier import verifier_pool

RewardFunc = Callable[..., list]

logger = logging.getLogger(__name__)
_INTEGER = re.compile(r"([+-]?)(\d+)")
_counts: Counter = Counter()  # "missing_gold": completions whose gold answer was missing (see missing_gold_answers)
_warned: set = set()


def _gold_answers(n: int, answer, solution, function: str) -> list[str | None]:
    """The gold answer per completion; the ones that are missing are counted (and warned about once)."""
    golds = [gold_answer(truth) for truth in _ground_truths(n, answer, solution)]
    missing = golds.count(None)
    if missing:
        _counts["missing_gold"] += missing
        if function not in _warned:
            _warned.add(function)
            logger.warning(f"{function}: {missing} of {n} completions have no gold answer (missing, NaN, 'nan' or "
                           "'None'); the reward does not apply to them (None). missing_gold_answers() counts them.")
    return golds


def missing_gold_answers() -> int:
    """How many completions got ``None`` from a reward of this module because their gold answer was missing
    (None, NaN, ``"nan"``, ``"None"``, empty) in this process."""
    return _counts["missing_gold"]


def _per_row(n: int, values, name: str) -> list:
    if values is None or isinstance(values, (str, int, float)):  # one value for every completion
        return [values] * n
    if len(values) != n:
        raise ValueError(f"got {n} completions but {len(values)} {name}")
    return list(values)


def _ground_truths(n: int, answer, solution) -> list:
    return _per_row(n, answer if answer is not None else solution, "ground truths")


# --- reward functions ------------------------------------------------------------------------------------------
def math_verify_reward(completions: Sequence, answer=None, solution=None, answer_format=None,
                       **kwargs) -> list[float | None]:
    r"""1.0 when math-verify judges the completion's final answer equal to the ground truth, else 0.0.

    The final answer is read by the row's ``answer_format`` (``auto``, ``boxed``, ``gsm8k`` or ``dapo``; see
    :mod:`armor_trl.rewards.answers`) and compared with ``math_verify.verify`` (symbolic equivalence:
    ``\frac12`` = ``0.5``, ``1,234`` = ``1234``). The ground truth comes from the ``answer`` column, else
    ``solution`` (see :func:`gold_answer`: a GSM8K worked solution counts by its ``#### N`` line).
    ``None`` where the ground truth is missing (None, NaN, ``"nan"``, ``"None"``; counted by
    :func:`missing_gold_answers`) or unparseable, or the judgement timed out (counted by
    :func:`armor_trl.rewards.verifier.verifier_timeouts`). A call takes at most about
    ``ARMOR_VERIFIER_BATCH_TIMEOUT`` seconds (default 60) once the workers are up, whatever the completions hold
    (see the module docstring for measured times).
    """
    n = len(completions)
    formats = ["auto" if f is None else str(f) for f in _per_row(n, answer_format, "answer_format values")]
    unknown = sorted(set(formats) - set(ANSWER_FORMATS))
    if unknown:
        raise ValueError(f"answer_format column: unknown value(s) {unknown}; expected one of {list(ANSWER_FORMATS)}.")
    golds = _gold_answers(n, answer, solution, "math_verify")
    items = [(completion_text(completion), gold, answer_format)
             for completion, gold, answer_format in zip(completions, golds, formats)]
    judged = [i for i, item in enumerate(items) if item[1] is not None]
    rewards: list[float | None] = [None] * n
    for i, reward in zip(judged, verifier_pool().run([items[i] for i in judged])):
        rewards[i] = reward
    return rewards


def exact_integer_reward(completions: Sequence, answer=None, **kwargs) -> list[float | None]:
    """1.0 when the whole completion (whitespace aside) is exactly the integer ground truth, else 0.0.

    The verifier of the synthetic arithmetic task (``12+35=`` → ``47``): strict on purpose, so trailing text is
    wrong. ``None`` where the ground truth is missing (counted by :func:`missing_gold_answers`) or not an integer.
    Integers of any length are compared as digit strings (sign and leading zeros aside), never with ``int()``,
    so no number of digits raises; linear in the completion's length.
    """
    rewards: list[float | None] = []
    for completion, gold in zip(completions, _gold_answers(len(completions), answer, None, "exact_integer")):
        expected = _integer_digits(gold) if gold is not None else None
        if expected is None:
            rewards.append(None)
            continue
        rewards.append(float(_integer_digits(completion_text(completion)) == expected))
    return rewards


def final_integer_reward(completions: Sequence, answer=None, **kwargs) -> list[float | None]:
    """1.0 when the text after the completion's last ``#`` (whitespace aside) is exactly the integer ground truth,
    else 0.0 (also without a ``#``).

    The verifier of the mode testbed (:mod:`armor_trl.rewards.modes`): a worked ``"5+7=12,2+0+1=3,1+3=4#432"`` and a direct
    ``"#432"`` are judged by their final answer alone. ``None`` where the ground truth is missing or not an integer;
    integers compared as digit strings, as :func:`exact_integer_reward` does.
    """
    rewards: list[float | None] = []
    for completion, gold in zip(completions, _gold_answers(len(completions), answer, None, "final_integer")):
        expected = _integer_digits(gold) if gold is not None else None
        if expected is None:
            rewards.append(None)
            continue
        text = completion_text(completion)
        mark = text.rfind("#")
        rewards.append(float(mark != -1 and _integer_digits(text[mark + 1:]) == expected))
    return rewards


def _integer_digits(text: str) -> tuple[str, str] | None:
    """(sign, digits) of an integer written as ``text`` (whitespace around it aside), with leading zeros and the
    sign of zero dropped and any Unicode decimal digits written as ASCII; None if ``text`` is not an integer."""
    match = _INTEGER.fullmatch(text.strip())
    if match is None:
        return None
    digits = match.group(2)
    if not digits.isascii():  # \d (like int()) also takes other scripts' decimal digits
        digits = "".join(str(unicodedata.decimal(digit)) for digit in digits)
    digits = digits.lstrip("0") or "0"
    return ("-" if match.group(1) == "-" and digits != "0" else "", digits)


_BOXED_CONTENT = "\\boxed{"


def boxed_format_reward(completions: Sequence, **kwargs) -> list[float]:
    r"""1.0 when the completion states a final answer in a form the verifiers read first (``\boxed{...}`` with
    something inside, or a ``#### x`` line), else 0.0.

    Linear in the completion's length (a megabyte of ``\boxed{`` takes milliseconds).
    """
    return [float(_has_final_answer_form(completion_text(c))) for c in completions]


def _has_final_answer_form(text: str) -> bool:
    # "\boxed{", at least one character, then a "}": the first "\boxed{" has the most room for both
    start = text.find(_BOXED_CONTENT)
    if start != -1 and text.find("}", start + len(_BOXED_CONTENT) + 1) != -1:
        return True
    return _GSM8K_MARK.search(text) is not None


_GSM8K_MARK = re.compile(r"^####\s*\S", re.MULTILINE)  # each "####" scans only the whitespace after it


math_verify_reward.__name__ = "math_verify"
exact_integer_reward.__name__ = "exact_integer"
final_integer_reward.__name__ = "final_integer"
boxed_format_reward.__name__ = "format"

REWARD_FUNCS: dict[str, RewardFunc] = {
    "math_verify": math_verify_reward,
    "exact_integer": exact_integer_reward,
    "final_integer": final_integer_reward,
    "format": boxed_format_reward,
}
# trl.rewards names that are factories: they need parameters, so a recipe cannot name them directly.
_TRL_FACTORIES = ("get_cosine_scaled_reward", "get_repetition_penalty_reward", "get_soft_overlong_punishment")


def _trl_reward(name: str) -> RewardFunc | None:
    """``trl.rewards.<name>`` (imported only now), None if TRL has no such reward."""
    trl_rewards = importlib.import_module("trl.rewards")
    if name not in getattr(trl_rewards, "__all__", ()) or name.endswith("_rewards"):
        return None
    if name in _TRL_FACTORIES:
        raise ValueError(
            f"trl.rewards.{name} builds a reward function from parameters, so a recipe cannot name it directly: put "
            f"e.g. `my_reward = {name}(...)` in a my_rewards.py next to the recipe and list 'my_rewards:my_reward'."
        )
    return getattr(trl_rewards, name)


def resolve_reward(name: str) -> RewardFunc:
    """A reward function from a built-in name (:data:`REWARD_FUNCS`), a reward of ``trl.rewards``
    (``accuracy_reward``, ``reasoning_accuracy_reward``, ``think_format_reward``), or an import path
    ``pkg.mod:func`` / ``pkg.mod.func``.

    Like ``trl grpo``, the current directory is importable, so a ``my_rewards.py`` next to the recipe works.
    """
    if name in REWARD_FUNCS:
        return REWARD_FUNCS[name]
    if ":" in name:
        module_name, attr = name.split(":", 1)
    elif "." in name:
        module_name, attr = name.rsplit(".", 1)
    else:
        function = _trl_reward(name) if re.fullmatch(r"[A-Za-z_]\w*", name) else None
        if function is None:
            raise ValueError(f"Unknown reward function {name!r}: expected one of {sorted(REWARD_FUNCS)}, a reward of "
                             "trl.rewards (accuracy_reward, reasoning_accuracy_reward, think_format_reward) or an "
                             "import path 'pkg.module:function'.")
        return function
    return import_callable(name, module_name, attr, "reward function")


def import_callable(name: str, module_name: str, attr: str, what: str):
    """``attr`` of ``module_name`` (the import path ``name`` a user wrote), which must be callable; the working directory
    is importable, as for a script beside a recipe; ``what`` names it in the errors."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Could not load {what} {name!r}: {error}") from error
    if not callable(function):
        raise ValueError(f"{what[0].upper()}{what[1:]} {name!r} is not callable.")
    return function


def resolve_rewards(names: Sequence[str] | str) -> list[RewardFunc]:
    """:func:`resolve_reward` for each name (a single name or comma-separated names are accepted too)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    return [resolve_reward(name) for name in names]
