"""Verifiable reward functions for RLVR, in TRL's reward-function signature.

Three modules, one job each: :mod:`armor_trl.rewards.answers` reads answers (a completion's text, a row's gold
answer, the final answer under the row's ``answer_format``, math-verify's judgement of the two),
:mod:`armor_trl.rewards.verifier` runs math-verify in worker processes with a hard timeout per completion and a
budget per call, and :mod:`armor_trl.rewards.functions` holds the reward functions (:data:`REWARD_FUNCS`) and
resolves reward names (:func:`resolve_reward`). Their public names are imported here. Beside them,
:mod:`armor_trl.rewards.checks` wraps reward functions so that a mistake names them, and
:mod:`armor_trl.rewards.modes` holds the mode testbed's answer forms.

``import armor_trl.rewards`` imports only the standard library (math-verify is imported in the workers), so it is
cheap to import anywhere, the verifier's worker processes included.
"""

from __future__ import annotations

from armor_trl.rewards.answers import (
    ANSWER_FORMATS,
    as_latex,
    completion_text,
    final_answer,
    gold_answer,
    gsm8k_answer,
    is_no_answer,
    judge,
)
from armor_trl.rewards.functions import (
    REWARD_FUNCS,
    RewardFunc,
    boxed_format_reward,
    exact_integer_reward,
    final_integer_reward,
    math_verify_reward,
    missing_gold_answers,
    resolve_reward,
    resolve_rewards,
)
from armor_trl.rewards.verifier import VerifierPool, configure_verifier, verifier_settings, verifier_timeouts

__all__ = [
    "ANSWER_FORMATS",
    "REWARD_FUNCS",
    "RewardFunc",
    "VerifierPool",
    "as_latex",
    "boxed_format_reward",
    "completion_text",
    "configure_verifier",
    "exact_integer_reward",
    "final_answer",
    "final_integer_reward",
    "gold_answer",
    "gsm8k_answer",
    "is_no_answer",
    "judge",
    "math_verify_reward",
    "missing_gold_answers",
    "resolve_reward",
    "resolve_rewards",
    "verifier_settings",
    "verifier_timeouts",
]
