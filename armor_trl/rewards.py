"""Verifiable reward functions for RLVR, in TRL's reward-function signature.

Every function here is ``f(completions, **kwargs) -> list[float | None]``: ``completions`` are strings or
chat message lists (``[{"role": "assistant", "content": ...}]``), dataset columns arrive as keyword
arguments (the ground truth in ``answer``, or ``solution`` as a fallback), and ``None`` means "cannot judge"
(no or unparseable ground truth), which TRL leaves out of the reward statistics and ARMOR never counts as a
verified anchor.

Built-in names (:data:`REWARD_FUNCS`) resolve with :func:`resolve_reward`, as do dotted import paths
``pkg.mod:func`` or ``pkg.mod.func``.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence

from math_verify import parse, verify

RewardFunc = Callable[..., list]

_INTEGER = re.compile(r"\s*([+-]?\d+)\s*")


def completion_text(completion) -> str:
    """The text of a completion: the string itself, or the content of the last message of a chat completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    return str(completion[-1]["content"]) if completion else ""


def _ground_truths(n: int, answer, solution) -> list:
    truths = answer if answer is not None else solution
    if truths is None:
        return [None] * n
    if isinstance(truths, (str, int, float)):  # one ground truth for every completion
        return [truths] * n
    if len(truths) != n:
        raise ValueError(f"got {n} completions but {len(truths)} ground truths")
    return list(truths)


def _timeouts() -> tuple[int | None, int | None]:
    """math-verify times out with signal.alarm, which works only in the main thread (as in trl.rewards)."""
    if threading.current_thread() is threading.main_thread():
        return 10, 5
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return None, None


def math_verify_reward(completions: Sequence, answer=None, solution=None, **kwargs) -> list[float | None]:
    r"""1.0 when math-verify judges the completion's final answer equal to the ground truth, else 0.0.

    The answer is extracted by ``math_verify.parse`` (a ``\boxed{}`` answer first, then the last LaTeX or plain
    expression, which covers GSM8K's ``#### 42``) and compared with ``math_verify.verify`` (symbolic
    equivalence: ``\frac12`` = ``0.5``, ``1,234`` = ``1234``). The ground truth comes from the ``answer`` column,
    else ``solution`` (a full solution works: its boxed answer is used). ``None`` where the ground truth is
    missing or unparseable.
    """
    parse_timeout, verify_timeout = _timeouts()
    rewards: list[float | None] = []
    for completion, truth in zip(completions, _ground_truths(len(completions), answer, solution)):
        gold = parse(str(truth), parsing_timeout=parse_timeout) if truth is not None and str(truth).strip() else []
        if not gold:
            rewards.append(None)
            continue
        predicted = parse(completion_text(completion), parsing_timeout=parse_timeout)
        rewards.append(float(bool(predicted) and verify(gold, predicted, timeout_seconds=verify_timeout)))
    return rewards


def exact_integer_reward(completions: Sequence, answer=None, **kwargs) -> list[float | None]:
    """1.0 when the whole completion (whitespace aside) is exactly the integer ground truth, else 0.0.

    The verifier of the synthetic arithmetic task (``12+35=`` → ``47``): strict on purpose, so trailing text is
    wrong. ``None`` where the ground truth is missing or not an integer.
    """
    rewards: list[float | None] = []
    for completion, truth in zip(completions, _ground_truths(len(completions), answer, None)):
        gold = _INTEGER.fullmatch(str(truth)) if truth is not None else None
        if gold is None:
            rewards.append(None)
            continue
        predicted = _INTEGER.fullmatch(completion_text(completion))
        rewards.append(float(predicted is not None and int(predicted.group(1)) == int(gold.group(1))))
    return rewards


def boxed_format_reward(completions: Sequence, **kwargs) -> list[float]:
    r"""1.0 when the completion states a final answer in a form the verifiers read first (``\boxed{...}`` or ``#### x``)."""
    pattern = re.compile(r"\\boxed\{.+\}|^####\s*\S", re.MULTILINE | re.DOTALL)
    return [float(pattern.search(completion_text(c)) is not None) for c in completions]


math_verify_reward.__name__ = "math_verify"
exact_integer_reward.__name__ = "exact_integer"
boxed_format_reward.__name__ = "format"

REWARD_FUNCS: dict[str, RewardFunc] = {
    "math_verify": math_verify_reward,
    "exact_integer": exact_integer_reward,
    "format": boxed_format_reward,
}


def resolve_reward(name: str) -> RewardFunc:
    """A reward function from a built-in name (:data:`REWARD_FUNCS`) or an import path ``pkg.mod:func`` / ``pkg.mod.func``.

    Like ``trl grpo``, the current directory is importable, so a ``my_rewards.py`` next to the recipe works.
    """
    if name in REWARD_FUNCS:
        return REWARD_FUNCS[name]
    if ":" in name:
        module_name, attr = name.split(":", 1)
    elif "." in name:
        module_name, attr = name.rsplit(".", 1)
    else:
        raise ValueError(f"Unknown reward function {name!r}: expected one of {sorted(REWARD_FUNCS)} or an import path "
                         "'pkg.module:function'.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Could not load reward function {name!r}: {error}") from error
    if not callable(function):
        raise ValueError(f"Reward function {name!r} is not callable.")
    return function


def resolve_rewards(names: Sequence[str] | str) -> list[RewardFunc]:
    """:func:`resolve_reward` for each name (a single name or comma-separated names are accepted too)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    return [resolve_reward(name) for name in names]
