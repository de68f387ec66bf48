"""Solution modes of the synthetic addition task, and the classifier that tells them apart in a completion's text.

The mode testbed (configs/mode_testbed.yaml) warm-starts the tiny model on two ways of answering ``"125+307="``:

* ``worked``: the column sums from the ones column up, each with the carry it takes in, then the answer after
  ``#``: ``"5+7=12,2+0+1=3,1+3=4#432"``;
* ``direct``: only the answer: ``"#432"``.

Both end in ``#<answer>``, which :func:`armor_trl.rewards.final_integer_reward` verifies. :func:`classify` reads a
completion's form only (not whether its sums are right): ``worked``, ``direct`` or ``other`` (anything else).
:func:`classify_carries` splits the worked form by whether it writes a carry (``+1``): on problems that need one
(the testbed's held-out set) ``carrying`` is the general method, and ``worked`` without a carry is the heuristic
that no-carry training problems reward as much. Validation logs each mode's share (recipe field
``val_mode_classifier``, resolved by :func:`resolve_classifier`).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

WORKED, DIRECT, OTHER = "worked", "direct", "other"
MODES = (WORKED, DIRECT)  # the modes a warm-up can mix (the ``modes`` key of a recipe's demo.warmup)

_STEP = r"\d\+\d(?:\+1)?=\d{1,2}"  # one column: its two digits, the carry taken in (+1) if any, their sum
_WORKED = re.compile(rf"{_STEP}(?:,{_STEP})*#\d+")
_DIRECT = re.compile(r"#\d+")
# a column that takes a carry: two digits, then "+1" (not "3+1=4", where 1 is the second digit)
_CARRY = re.compile(r"(?:^|,)\d\+\d\+1=")


def column_steps(a: int, b: int) -> list[str]:
    """The written column sums of ``a + b``, ones column first: ``column_steps(125, 307) == ["5+7=12", "2+0+1=3",
    "1+3=4"]`` (a shorter operand's missing digits are 0)."""
    if a < 0 or b < 0:
        raise ValueError(f"column sums need non-negative operands, got {a} and {b}")
    steps, carry = [], 0
    while True:
        x, y = a % 10, b % 10
        total = x + y + carry
        steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
        carry, a, b = total // 10, a // 10, b // 10
        if not (a or b):
            return steps


def mode_text(mode: str, a: int, b: int) -> str:
    """The completion of ``"a+b="`` written in ``mode`` (``worked`` or ``direct``)."""
    if mode == WORKED:
        return f"{','.join(column_steps(a, b))}#{a + b}"
    if mode == DIRECT:
        return f"#{a + b}"
    raise ValueError(f"Unknown mode {mode!r}: expected one of {list(MODES)}.")


def parse_problem(prompt: str) -> tuple[int, int]:
    """The operands of an addition prompt ``"a+b="``."""
    match = re.fullmatch(r"\s*(\d+)\+(\d+)=\s*", prompt)
    if match is None:
        raise ValueError(f"not an addition prompt 'a+b=': {prompt!r}")
    return int(match.group(1)), int(match.group(2))


def classify(text: str) -> str:
    """``worked``, ``direct`` or ``other``: the form of a completion (whitespace around it aside); its sums may be
    wrong, a malformed or unfinished one is ``other``."""
    text = text.strip()
    if _DIRECT.fullmatch(text):
        return DIRECT
    if _WORKED.fullmatch(text):
        return WORKED
    return OTHER


classify.modes = (WORKED, DIRECT, OTHER)  # every label it returns: validation logs each, zeros included

CARRYING = "carrying"


def classify_carries(text: str) -> str:
    """:func:`classify`, with the worked form split in two: ``carrying`` when a column takes a carry (``+1`` after
    its two digits, as in ``2+0+1=3``), ``worked`` when none does (``3+1=4`` adds the digit 1: no carry)."""
    mode = classify(text)
    return CARRYING if mode == WORKED and _CARRY.search(text) else mode


classify_carries.modes = (CARRYING, WORKED, DIRECT, OTHER)


def max_completion_chars(digits: int) -> int:
    """Enough new tokens for either mode with ``digits``-digit operands (armor_trl.app.tiny's tokenizer: one token per
    character): ``digits`` steps of at most 8 characters ("9+9+1=19") and the commas between them, '#', at most
    ``digits`` + 1 answer digits, and the end-of-sequence token."""
    return digits * 8 + (digits - 1) + 1 + (digits + 1) + 1


TOOL, NO_TOOL = "tool", "no_tool"
TOOL_CALL_OPEN = "<tool_call>"  # how a Qwen-style chat template (and the tiny agent's) writes a tool call


def classify_tool_use(text: str) -> str:
    """``tool`` when an agent's trajectory (its decoded completion: model turns and tool results) writes a tool call
    (``<tool_call>``, the Qwen-style tag), else ``no_tool``: the mode of the tool-use testbed."""
    return TOOL if TOOL_CALL_OPEN in text else NO_TOOL


classify_tool_use.modes = (TOOL, NO_TOOL)

CLASSIFIERS: dict[str, Callable[[str], str]] = {"arithmetic": classify, "arithmetic_carries": classify_carries,
                                                "tool_use": classify_tool_use}


def has_carry(a: int, b: int) -> bool:
    """Whether the written addition of ``a`` and ``b`` carries in some column."""
    while a or b:
        if a % 10 + b % 10 >= 10:
            return True
        a, b = a // 10, b // 10
    return False


def prompt_needs_carry(prompt: str) -> str:
    """The type of an addition prompt's text: ``carry`` when its problem ``a+b=`` needs a carry, ``no_carry`` when it
    does not, ``other`` when the text holds no such problem."""
    match = re.search(r"(\d+)\+(\d+)=", prompt)
    if match is None:
        return OTHER
    return "carry" if has_carry(int(match.group(1)), int(match.group(2))) else "no_carry"


def prompt_operand_digits(prompt: str) -> str:
    """The type of an addition prompt's text by its longer operand: ``1_digit``, ``2_digit``, ...; ``other`` when the
    text holds no problem ``a+b=`` (the tool-use testbed: 1-digit problems need no tool, longer ones do)."""
    match = re.search(r"(\d+)\+(\d+)=", prompt)
    if match is None:
        return OTHER
    return f"{max(len(match.group(1)), len(match.group(2)))}_digit"


PROMPT_CLASSIFIERS: dict[str, Callable[[str], str]] = {"arithmetic_needs_carry": prompt_needs_carry,
                                                       "arithmetic_digits": prompt_operand_digits}


def resolve_prompt_classifier(name: str, field: str = "anchor_mode_prompt_classifier") -> Callable[[str], str]:
    """A prompt classifier (prompt text → prompt type) by registered name (:data:`PROMPT_CLASSIFIERS`) or import
    path ``pkg.mod:func``; errors name ``field``."""
    if name in PROMPT_CLASSIFIERS:
        return PROMPT_CLASSIFIERS[name]
    if ":" not in name:
        raise ValueError(f"Unknown {field} {name!r}: expected one of {sorted(PROMPT_CLASSIFIERS)} or an import path "
                         "'pkg.module:function'.")
    return resolve_classifier(name, field)


def resolve_classifier(name: str, field: str = "val_mode_classifier") -> Callable[[str], str]:
    """A mode classifier (completion text → mode label) by registered name (:data:`CLASSIFIERS`) or import path
    ``pkg.mod:func``; errors name ``field``, the setting that gave ``name``."""
    if name in CLASSIFIERS:
        return CLASSIFIERS[name]
    module_name, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"Unknown {field} {name!r}: expected one of {sorted(CLASSIFIERS)} or an import "
                         "path 'pkg.module:function'.")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Could not load {field} {name!r}: {error}") from error
    if not callable(function):
        raise ValueError(f"{field} {name!r} is not callable.")
    return function
