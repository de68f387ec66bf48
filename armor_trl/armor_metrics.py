"""What ARMOR logs beside TRL's metrics (all processes reduced; a metric without data in a step is not logged).

TRL's own ``reward``, ``entropy`` and ``completions/mean_length`` are over every row of the batch, anchors included;
the ``armor/policy_*`` and ``armor/anchor_*`` versions split them by row type.
"""

from __future__ import annotations

import math

import torch
from transformers.utils import logging

from . import trl_seam as seam
from .mixture import k3_kl, mixed_logprobs

logger = logging.get_logger(__name__)


def share(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


class ArmorMetrics:
    """Logs the anchors of a round, the anchor rows' advantages and the mixed ratio of each micro-batch."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._found_any, self._rounds_without_anchor = False, 0

    def _sums(self, values: list[torch.Tensor]) -> list[float]:
        return self.trainer.accelerator.reduce(torch.stack(values).float(), reduction="sum").tolist()

    def log(self, name: str, value: float) -> None:
        seam.log_metric(self.trainer, name, value)

    def anchor_round(self, anchors, anchor_filter: str, threshold: float, cache) -> None:
        trainer = self.trainer
        has_anchor = trainer.accelerator.gather(anchors.has_anchor.float())
        self.log("armor/anchor_found_frac", has_anchor.mean().item())
        self._check_anchors_found(has_anchor.sum().item() > 0, anchors.best_candidate_reward, anchor_filter, threshold)
        self.log("armor/groups_dropped_frac", 1.0 - has_anchor.mean().item() if anchor_filter == "drop" else 0.0)
        self.log("armor/anchor_reward_mean", torch.nanmean(trainer.accelerator.gather(anchors.reward)).item())
        verified = anchors.candidates_verified
        verified_sum, verified_count = self._sums([verified.sum(), torch.tensor(float(verified.numel()),
                                                                                device=verified.device)])
        self.log("armor/candidates_verified_frac", share(verified_sum, verified_count))
        if cache is not None:
            hits, groups = trainer.accelerator.reduce(anchors.cache_hits, reduction="sum").tolist()
            self.log("armor/anchor_cache_hit_frac", hits / groups)
            self.log("armor/anchor_cache_size", len(cache))

    def _check_anchors_found(self, found: bool, best_reward: float, anchor_filter: str, threshold: float) -> None:
        """Fail fast when the first rounds of a run find no anchor anywhere (``anchor_fail_after_rounds``)."""
        trainer = self.trainer
        rounds = trainer.args.anchor_fail_after_rounds
        if found or self._found_any or not rounds:
            self._found_any = self._found_any or found
            return
        best = trainer.accelerator.gather(torch.tensor([best_reward], device=trainer.accelerator.device))
        best = torch.nan_to_num(best, nan=-math.inf).max().item()
        self._rounds_without_anchor += 1
        if self._rounds_without_anchor % rounds:
            return
        verifier = trainer.args.anchor_reward_funcs or trainer.reward_func_names
        message = (
            f"No anchor in the first {self._rounds_without_anchor} anchor rounds: no reference candidate reached "
            f"anchor_reward_threshold={threshold} (best weighted reward of any candidate: "
            f"{best if math.isfinite(best) else 'none scored'}; reward functions judging correctness: {verifier}). "
            "Fixes: a 0/1 verifier reward (e.g. armor_trl.rewards.math_verify_reward), named in anchor_reward_funcs "
            "when other rewards shape; an anchor_reward_threshold a correct completion reaches; or "
            "anchor_filter='keep' to train groups without anchors. anchor_fail_after_rounds=0 turns this check off."
        )
        if anchor_filter == "drop":
            raise ValueError(message + " With anchor_filter='drop' nothing trains, so the run stops.")
        logger.warning(message + " Groups train without anchors (anchor_filter='keep').")

    def rows_by_type(self, output: dict, is_anchor: torch.Tensor) -> None:
        """Completion length and advantage means of the on-policy rows and of the anchor rows in the loss."""
        is_anchor = is_anchor.to(output["advantages"].device)
        lengths = output["completion_mask"].sum(dim=1).float()
        on_policy = ~is_anchor & (lengths > 0)
        sums = self._sums([(lengths * rows).sum() for rows in (on_policy, is_anchor)]
                          + [(output["advantages"] * rows).sum() for rows in (on_policy, is_anchor)]
                          + [on_policy.sum(), is_anchor.sum()])
        for index, kind in enumerate(("policy", "anchor")):
            self.log(f"armor/{kind}_length_mean", share(sums[index], sums[4 + index]))
            self.log(f"armor/{kind}_advantage_mean", share(sums[2 + index], sums[4 + index]))

    @torch.no_grad()
    def mixed_ratio(self, inputs, logps, entropies, ref_logps, mixed_old, alpha, epsilon_low, epsilon_high) -> None:
        """Per micro-batch, for on-policy and anchor rows: the mixed ratio's mean and extremes, the share of tokens
        clipped, the KLs to π_ref and the entropy."""
        mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()
        mixed = mixed_logprobs(logps, ref_logps, alpha)
        ratio = torch.exp(mixed - (mixed if mixed_old is None else mixed_old))
        advantages = inputs["advantages"].unsqueeze(1) if inputs["advantages"].dim() == 1 else inputs["advantages"]
        anchor = inputs["armor_is_anchor"].unsqueeze(1) & mask
        policy = ~inputs["armor_is_anchor"].unsqueeze(1) & mask
        low = (ratio < 1 - epsilon_low) & (advantages < 0) & mask
        high = (ratio > 1 + epsilon_high) & (advantages > 0) & mask
        entropies = torch.zeros_like(logps) if entropies is None else entropies
        total = self._sums([
            (ratio * policy).sum(), policy.sum(), (ratio * anchor).sum(), anchor.sum(), low.sum(), high.sum(),
            mask.sum(),
            (k3_kl(logps, ref_logps) * policy).sum(),  # reverse KL(π_θ‖π_ref), on-policy samples
            (k3_kl(ref_logps, logps) * anchor).sum(),  # forward KL(π_ref‖π_θ), anchor samples
            (entropies * policy).sum(), (entropies * anchor).sum(),
        ])
        extremes = torch.stack([
            torch.where(policy, ratio, math.inf).min(), -torch.where(policy, ratio, -math.inf).max(),
            torch.where(anchor, ratio, math.inf).min(), -torch.where(anchor, ratio, -math.inf).max(),
        ]).float()
        policy_min, neg_policy_max, anchor_min, neg_anchor_max = (
            self.trainer.accelerator.gather(extremes.unsqueeze(0)).min(dim=0).values.tolist()
        )
        self.log("armor/ratio_policy_mean", share(total[0], total[1]))
        self.log("armor/ratio_anchor_mean", share(total[2], total[3]))
        for name, value in (("armor/ratio_policy_min", policy_min), ("armor/ratio_policy_max", -neg_policy_max),
                            ("armor/ratio_anchor_min", anchor_min), ("armor/ratio_anchor_max", -neg_anchor_max)):
            self.log(name, value if math.isfinite(value) else math.nan)
        self.log("armor/clip_low_frac", share(total[4], total[6]))
        self.log("armor/clip_high_frac", share(total[5], total[6]))
        self.log("armor/kl_reverse_policy", share(total[7], total[1]))
        self.log("armor/kl_forward_anchor", share(total[8], total[3]))
        self.log("armor/policy_entropy", share(total[9], total[1]))
        self.log("armor/anchor_entropy", share(total[10], total[3]))
