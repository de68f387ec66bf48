"""ARMOR's Mixed Optimization as pure tensor functions (docs/algorithm.md, "2. Mixed Optimization").

Everything here is a function of tensors and floats; nothing imports TRL. The trainer hands TRL's loss
``mixed_logprobs`` in place of the current and the old policy's log-probs (one seam, ``trl_seam.loss_logps_replaced``),
so that whatever TRL builds from ``logπ − logπ_old`` is built from the mixed log-ratio log r_mix, and whatever it
builds from ``logπ`` from log π_mix. For each of TRL's ``LOSS_TYPES`` and ``IMPORTANCE_SAMPLING_LEVELS`` that gives
(docs/algorithm.md, "The mixed ratio in each of TRL's losses"):

* token level: r_mix per token; sequence level (GSPO): exp of each row's masked mean of log r_mix, the
  length-normalised log-ratio of the token-wise mixture policy, as TRL normalises the plain log-ratio;
* ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: the clipped surrogate min(r·A, clip(r)·A) on that ratio;
* ``sapo``: the soft gate (4/τ)·σ(τ·(r − 1)) on it;
* ``cispo``: the stop-gradient weight min(r, ε_high) on it, times A·log π_mix, so the objective's gradient (the
  loss is its negative) is sg(min(r, ε_high))·A·w·∇log π_θ, with w = α·π_θ/π_mix = ∂ log π_mix / ∂ log π_θ;
* ``vespo``: its gamma weight φ of exp(Σ_t log r_mix) (TRL's sum, whatever the level), times A·log π_mix.

α = 1 hands TRL the policy's own log-probs, so every one of them is TRL's loss exactly.
"""

from __future__ import annotations

import math

import torch


# TRL 1.16's loss types and importance-sampling levels (trl_seam.check_trl_surface checks GRPOTrainer's loss for them)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
CLIPPED_SURROGATE_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # -min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)
UNCLIPPED_LOSSES = ("sapo", "vespo")  # soft weights on the ratio, no clip


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must lie in (0, 1], got {alpha}.")


def mixed_logprobs(logp: torch.Tensor, ref_logp: torch.Tensor, alpha: float) -> torch.Tensor:
    """log(α·exp(logp) + (1−α)·exp(ref_logp)), computed in log space.

    Finite wherever the inputs are finite; when one input is −inf the result is the other term
    (plus its log-weight); α = 1 returns ``logp`` itself, so the ordinary ratio comes back exactly.
    Gradients flow to ``logp`` only through the α-weighted term.
    """
    _check_alpha(alpha)
    if alpha == 1.0:
        return logp
    ref_logp = ref_logp.to(logp.dtype)
    log_alpha, log_one_minus_alpha = math.log(alpha), math.log1p(-alpha)
    return torch.logaddexp(logp + log_alpha, ref_logp + log_one_minus_alpha)


def mixed_ratio(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, alpha: float) -> torch.Tensor:
    """r_mix = (α·π_θ + (1−α)·π_ref) / (α·π_old + (1−α)·π_ref), per token."""
    return torch.exp(mixed_logprobs(logp, ref_logp, alpha) - mixed_logprobs(old_logp, ref_logp, alpha))


def trust_region_bounds(
    old_prob: torch.Tensor, ref_prob: torch.Tensor, alpha: float, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The values of π_θ at which r_mix reaches 1 − ε_low and 1 + ε_high (docs/algorithm.md, "2. Mixed Optimization").

    lower = (1 − ε_low)·π_old − ε_low·(1−α)/α·π_ref
    upper = (1 + ε_high)·π_old + ε_high·(1−α)/α·π_ref

    These are the raw formulas: a negative lower bound means the clip never binds from below for
    that token, and an upper bound above 1 means it never binds from above.
    """
    _check_alpha(alpha)
    ref_weight = (1.0 - alpha) / alpha
    lower = (1.0 - eps_low) * old_prob - eps_low * ref_weight * ref_prob
    upper = (1.0 + eps_high) * old_prob + eps_high * ref_weight * ref_prob
    return lower, upper


def default_alpha(num_generations: int, anchors_per_group: int = 1) -> float:
    """α = (G−m)/G: the share of on-policy completions in a group that holds m anchors ((G−1)/G for one)."""
    return (num_generations - anchors_per_group) / num_generations


def k3_kl(logp: torch.Tensor, other_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(p‖q) from samples of p: exp(q−p) − (q−p) − 1 with p=logp, q=other_logp.

    Non-negative and unbiased; used for the reverse KL (samples from π_θ) and, with the arguments
    swapped, the forward KL (samples from π_ref, i.e. anchors).
    """
    delta = other_logp - logp
    return torch.exp(delta) - delta - 1.0



def kl_reference_logps(ref_logp: torch.Tensor, logp: torch.Tensor, loss_logp: torch.Tensor,
                       on_policy: torch.Tensor) -> torch.Tensor:
    """What to hand TRL's KL term as the reference's log-probs when ARMOR trains with β ≠ 0 (ARMOR + KL).

    TRL builds its KL term from the log-probs its loss sees, ``loss_logp`` (the mixture's log π_mix under the mixed
    ratio), as k3 with δ = ref − loss_logp. Handing it ref' = log π_ref + (loss_logp − log π_θ) makes δ = log π_ref −
    log π_θ, so the term is β · k3 of π_θ against π_ref, the penalty of GRPO + KL, whatever the mixture; on anchor rows
    (``on_policy`` False: sampled from π_ref, where k3 estimates no reverse KL) ref' = loss_logp makes it 0. Both are
    exact in value and in gradient (autograd sees loss_logp − loss_logp). ``on_policy``: (rows,) bool.
    """
    shifted = ref_logp + (loss_logp - logp)
    return torch.where(on_policy.unsqueeze(-1).to(loss_logp.device), shifted, loss_logp)


def mixed_old_inputs(inputs: dict, ref_logps: torch.Tensor, alpha: float, mix_sampling_logps: bool) -> dict:
    """``inputs`` of TRL's loss with the old policy's log-probs (``old_per_token_logps``) as mixtures with π_ref, so
    that TRL's ratio is r_mix; with ``mix_sampling_logps`` (TRL's off-policy mask is on) vLLM's sampling log-probs
    (``sampling_per_token_logps``) too: the mask compares them with the (mixture) log-probs of the loss, so it compares
    like with like, and anchor rows (NaN: not sampled by the engine) fall back to the mixed old ones."""
    old_logps = inputs.get("old_per_token_logps")
    mixed_old = None if old_logps is None else mixed_logprobs(old_logps, ref_logps, alpha)
    if mixed_old is not None:
        inputs = {**inputs, "old_per_token_logps": mixed_old}
    sampling = inputs.get("sampling_per_token_logps")
    if sampling is not None and mix_sampling_logps:
        mixed_sampling = mixed_logprobs(sampling, ref_logps, alpha)
        if mixed_old is not None:
            mixed_sampling = torch.where(torch.isnan(sampling), mixed_old, mixed_sampling)
        inputs = {**inputs, "sampling_per_token_logps": mixed_sampling}
    return inputs

# --- what the loss's ratio does (metrics) ------------------------------------------------------------------------
def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str = "token"):
    """TRL's importance ratio π_θ/π_old per token, or (``level="sequence"``) the exp of each row's masked mean
    log-ratio, repeated over its tokens."""
    log_ratio = torch.where(mask.bool(), logp - old_logp, 0.0)
    if level == "sequence":
        mean = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = mean.expand_as(log_ratio)
    return torch.exp(log_ratio)


def clip_masks(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float,
               loss_type: str = "dapo"):
    """The tokens the loss's clip acts on. The clipped surrogate (``CLIPPED_SURROGATE_LOSSES``) removes their
    gradient: ``low`` where r < 1 − ε_low and A < 0, ``high`` where r > 1 + ε_high and A > 0 (TRL's
    ``clip_ratio/low_mean``, ``high_mean``). ``cispo`` caps their weight: ``high`` where r > ε_high, whatever the
    advantage's sign, and ``low`` is empty. ``sapo`` and ``vespo`` clip nothing: both empty. ``advantages``: one per
    row or one per token."""
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    mask = mask.bool()
    if loss_type in UNCLIPPED_LOSSES:
        return torch.zeros_like(mask), torch.zeros_like(mask)
    if loss_type == "cispo":
        return torch.zeros_like(mask), (ratio > eps_high) & mask
    return (ratio < 1 - eps_low) & (advantages < 0) & mask, (ratio > 1 + eps_high) & (advantages > 0) & mask


# --- KL between two models over completions (validation) --------------------------------------------------------
def sequence_log_ratios(logp: torch.Tensor, other_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_t (log p − log q) over each row's completion tokens: log p(y)/q(y) of the whole completion y."""
    return torch.where(mask.bool(), logp - other_logp, 0.0).sum(-1)


def kl_estimate(logp: torch.Tensor, other_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """Monte-Carlo estimate of KL(p‖q) over completions from rows sampled from p: the mean of log p(y)/q(y).
    Unbiased; single samples can be negative. Swap the models (and sample from q) for the other direction."""
    return sequence_log_ratios(logp, other_logp, mask).mean().item()
