"""Reward functions fail with a message that names them.

TRL calls reward functions deep inside a training step; an exception there, or a list of the wrong
length, otherwise surfaces as a traceback from TRL's internals. ``checked`` wraps a plain (sync)
reward function so that every such mistake raises ``RewardFunctionError`` naming the function.
"""

from __future__ import annotations

import functools
import math
import numbers

from transformers.utils import logging

logger = logging.get_logger(__name__)


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something that is not one reward per completion."""


def checked(func, name: str):
    """Wrap ``func`` (TRL's reward-function signature) with checks that name it on failure."""
    warned_nan = False

    @functools.wraps(func)
    def reward_with_checks(*args, **kwargs):
        nonlocal warned_nan
        try:
            values = func(*args, **kwargs)
        except Exception as error:  # re-raised with the function's name; the original stays chained
            raise RewardFunctionError(f"Reward function {name!r} raised {type(error).__name__}: {error}") from error
        expected = rows_of(kwargs)
        if not isinstance(values, (list, tuple)) and not hasattr(values, "tolist"):
            raise RewardFunctionError(
                f"Reward function {name!r} must return a list of floats (or None), one per completion; "
                f"got {type(values).__name__}."
            )
        values = list(values.tolist() if hasattr(values, "tolist") else values)
        if expected is not None and len(values) != expected:
            raise RewardFunctionError(
                f"Reward function {name!r} returned {len(values)} rewards for {expected} completions; it must return "
                "exactly one (a float, or None where it cannot judge) per completion."
            )
        for value in values:
            if value is not None and not isinstance(value, numbers.Real) and not hasattr(value, "__float__"):
                raise RewardFunctionError(
                    f"Reward function {name!r} returned {value!r} ({type(value).__name__}); rewards must be floats "
                    "or None."
                )
        if not warned_nan and any(v is not None and math.isnan(v) for v in values):
            warned_nan = True
            logger.warning(
                f"Reward function {name!r} returned NaN: it is treated like None (the function does not apply to that completion: no reward from it, and it does not count when verifying anchors)."
            )
        return values

    return reward_with_checks


ROW_FIELDS = ("completions", "prompts", "completion_ids", "environments")  # one entry per row where TRL passes them


def rows_of(kwargs: dict) -> int | None:
    """How many rewards a call must return: one per row of the first per-row field it was given (TRL passes them
    all; a direct call may pass only some, e.g. an environment-owned reward called with ``environments=[...]``);
    None where it was given none of them."""
    for name in ROW_FIELDS:
        if isinstance(kwargs.get(name), (list, tuple)):
            return len(kwargs[name])
    return None
