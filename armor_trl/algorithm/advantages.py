"""Group advantages and DAPO's dynamic-sampling rule, as pure tensor functions.

Rows are laid out as TRL lays them out: groups of G consecutive rows with the same prompt. A reward of
NaN marks a row that is no member of its group (an empty anchor slot, or a completion no reward function
could score); it is left out of every statistic and gets advantage 0.

* :func:`group_advantages` — GRPO's advantage (r − baseline) / (std + 1e-4), where the baseline is the
  group mean or, with ``quantile`` = K, the group's K-quantile (QAE, arXiv 2509.22611, :func:`group_quantile`); the std is
  the group's or, with ``scale_rewards="batch"``, the batch's over the groups that are kept.
* :func:`dynamic_sampling_keep` — which groups DAPO's dynamic sampling keeps (rewards of the on-policy
  samples not all equal), with the reason each dropped group was dropped.
"""

from __future__ import annotations

import torch

# Why a group left the batch (codes of dynamic_sampling_keep's ``reasons``).
KEPT, ALL_CORRECT, ALL_WRONG, NO_ANCHOR = 0, 1, 2, 3
DROP_REASONS = {ALL_CORRECT: "all_correct", ALL_WRONG: "all_wrong", NO_ANCHOR: "no_anchor"}
STD_EPS = 1e-4  # as in TRL's GRPOTrainer
QUANTILE_INTERPOLATIONS = ("inverted_cdf", "lower", "higher", "nearest", "midpoint", "linear")


def group_quantile(grouped: torch.Tensor, quantile: float, interpolation: str = "inverted_cdf") -> torch.Tensor:
    """(groups, 1) K-quantile of each row of ``grouped``, ignoring NaNs (NaN where a row has none).

    ``"inverted_cdf"``: the smallest value v with at least a fraction K of the row's values <= v (the empirical
    quantile QAE defines; always a value of the row). The others are ``torch.nanquantile``'s interpolations.
    """
    if interpolation != "inverted_cdf":
        return torch.nanquantile(grouped, quantile, dim=1, keepdim=True, interpolation=interpolation)
    count = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    ordered = torch.sort(torch.nan_to_num(grouped, nan=torch.inf), dim=1).values  # NaNs last
    position = (torch.ceil(quantile * count.double()).long() - 1).clamp(min=0)
    position = torch.minimum(position, (count - 1).clamp(min=0))
    baseline = ordered.gather(1, position)
    return torch.where(count > 0, baseline, torch.full_like(baseline, float("nan")))


def total_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """TRL's total reward per row: weighted sum with None as 0; NaN where no function could score the row."""
    total = (rewards_per_func * weights.to(rewards_per_func.device)).nansum(dim=1)
    total[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
    return total



def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sample standard deviation (Bessel-corrected) ignoring NaNs; NaN where fewer than two values."""
    if dim is None:
        values, dim = values.flatten(), 0
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim)
    squares = torch.nansum((values - mean) ** 2, dim=dim)
    return torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), torch.full_like(squares, float("nan")))


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_rewards: str = "group",
    quantile: float | None = None,
    keep: torch.Tensor | None = None,
    interpolation: str = "inverted_cdf",
) -> torch.Tensor:
    """Advantages of ``rewards`` (N,) in groups of ``group_size`` rows.

    Args:
        scale_rewards: ``"group"`` (divide by the group's std), ``"batch"`` (by the std of all kept rows) or
            ``"none"``, as in TRL.
        quantile: ``None`` for the group mean as baseline; K in [0, 1] for the group's K-quantile — QAE, taken
            per ``interpolation`` (:func:`group_quantile`).
        keep: (N / group_size,) bool; groups that are not kept get advantage 0 and stay out of the batch std.
    """
    grouped = rewards.view(-1, group_size)
    if keep is None:
        keep = torch.ones(grouped.size(0), dtype=torch.bool, device=rewards.device)
    if quantile is None:
        baseline = torch.nanmean(grouped, dim=1, keepdim=True)
    else:
        baseline = group_quantile(grouped, quantile, interpolation)
    advantages = grouped - baseline
    if scale_rewards == "group":
        advantages = advantages / (nanstd(grouped, dim=1).unsqueeze(1) + STD_EPS)
    elif scale_rewards == "batch":
        advantages = advantages / (nanstd(grouped[keep]) + STD_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}.")
    advantages = torch.nan_to_num(advantages, nan=0.0) * keep.unsqueeze(1)
    return advantages.flatten()


def dynamic_sampling_keep(
    rewards: torch.Tensor,
    on_policy: torch.Tensor,
    threshold: float,
    has_anchor: torch.Tensor | None = None,
    gate: bool = False,
    keep_unsolved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DAPO's dynamic-sampling rule with ARMOR's query gate, per group.

    Args:
        rewards: (groups, G) total rewards, NaN where a row is no member.
        on_policy: (G,) bool, the columns holding on-policy samples (the test is over those only).
        threshold: a reward at or above it counts as correct (tells all-correct from all-wrong groups).
        has_anchor: (groups,) bool, whether the group found its anchor (``None``: no anchors).
        gate: drop groups without an anchor (ARMOR's query gate).
        keep_unsolved: also keep a group whose on-policy samples all failed when it has an anchor
            (the ARMOR authors' ``weak_filter``).
    Returns:
        ``(keep, reasons)``: keep (groups,) bool, and per group :data:`KEPT` or the first rule that dropped it
        (all-correct, then all-wrong, then no anchor).
    """
    samples = rewards[:, on_policy]
    high = torch.nan_to_num(samples, nan=-torch.inf).amax(dim=1)
    low = torch.nan_to_num(samples, nan=torch.inf).amin(dim=1)
    all_equal = ~(high > low)  # also true when no sample could be scored
    solved = all_equal & (high >= threshold)
    anchored = torch.zeros_like(all_equal) if has_anchor is None else has_anchor.to(all_equal.device)
    passes_gate = anchored | (not gate)
    keep = ~all_equal & passes_gate
    if keep_unsolved:
        keep |= all_equal & ~solved & anchored
    reasons = torch.full_like(rewards[:, 0], KEPT, dtype=torch.long)
    reasons[~keep & ~passes_gate] = NO_ANCHOR
    reasons[~keep & all_equal & ~solved] = ALL_WRONG
    reasons[~keep & solved] = ALL_CORRECT
    return keep, reasons
