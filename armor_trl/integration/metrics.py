"""What ARMOR logs beside TRL's metrics (all processes reduced; a metric without data in a step is not logged).

TRL's own ``reward``, ``entropy`` and ``completions/mean_length`` are over every row of the batch, anchors included;
the ``armor/policy_*`` and ``armor/anchor_*`` versions split them by row type.
"""

from __future__ import annotations

import math

import torch
from accelerate.utils import gather_object
from transformers.utils import logging

from armor_trl.integration import trl_seam as seam
from armor_trl.algorithm.loss_rows import KEPT_ROWS
from armor_trl.algorithm.mixture import clip_masks, importance_ratio, k3_kl, mixed_logprobs, mixed_ratio

logger = logging.get_logger(__name__)


def share(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan


class ArmorMetrics:
    """Logs the anchors of a round, the anchor rows' advantages and the loss's ratio in each micro-batch."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._found_any, self._rounds_without_anchor = False, 0
        self._verifier = None  # the fresh candidates' verifier_counts summed over the rounds checked so far
        self._verifier_rounds, self._verifier_checked = 0, False

    def _sums(self, values: list[torch.Tensor]) -> list[float]:
        return self.trainer.accelerator.reduce(torch.stack(values).float(), reduction="sum").tolist()

    def log(self, name: str, value: float) -> None:
        seam.log_metric(self.trainer, name, value)

    def anchor_round(self, anchors, anchor_filter: str, threshold: float, cache) -> None:
        """The round's anchor metrics. ``anchor_found_frac`` is over the groups that looked for an anchor (all of them
        unless ``anchor_eligible_only`` left some out, :mod:`~armor_trl.rollout.anchor_waves`); a round where none looked does
        not count towards ``anchor_fail_after_rounds``."""
        trainer = self.trainer
        has_anchor = trainer.accelerator.gather(anchors.has_anchor.float())
        looked = torch.ones_like(has_anchor) if anchors.eligible is None else trainer.accelerator.gather(
            anchors.eligible.float())
        searched = looked.sum().item()
        self.log("armor/anchor_found_frac", share((has_anchor * looked).sum().item(), searched))
        if anchors.eligible is not None:  # after the refill loop: the share of the batch's groups that drew then
            self.log("armor/anchor_deferred_frac" if anchors.after_loop else "armor/anchor_eligible_frac",
                     looked.mean().item())
        if anchors.candidate_rows is not None:
            generated, scored = trainer.accelerator.reduce(anchors.candidate_rows.float(), reduction="sum").tolist()
            self.log("armor/anchor_candidate_rows", generated)
            self.log("armor/anchor_candidates_scored", scored)
        if searched:
            self._check_anchors_found(has_anchor.sum().item() > 0, anchors.best_candidate_reward, anchor_filter,
                                      threshold)
        self._check_verifier_can_say_correct(anchors.verifier_counts, threshold)
        # the share of groups the gate drops: those that looked for an anchor and found none
        dropped = (looked * (1.0 - has_anchor)).mean().item()
        self.log("armor/groups_dropped_frac", dropped if anchor_filter == "drop" else 0.0)
        self.log("armor/anchor_reward_mean", torch.nanmean(trainer.accelerator.gather(anchors.reward)).item())
        verified = anchors.candidates_verified
        verified_sum, verified_count = self._sums([verified.sum(), torch.tensor(float(verified.numel()),
                                                                                device=verified.device)])
        self.log("armor/candidates_verified_frac", share(verified_sum, verified_count))
        if cache is not None:
            hits, groups = trainer.accelerator.reduce(anchors.cache_hits, reduction="sum").tolist()
            self.log("armor/anchor_cache_hit_frac", share(hits, groups))
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

    def _check_verifier_can_say_correct(self, counts: torch.Tensor | None, threshold: float) -> None:
        """Stop a run whose verifier cannot say "correct": no verifying function scored any candidate of the first
        anchor round (all None), or every candidate of the first ``anchor_fail_after_rounds`` rounds but empty ones
        passed with weighted rewards outside [0, 1] (e.g. ``len(set(text))``, 0 for an empty completion, 1 or more for
        any other: every anchor would count as verified). A failed empty completion is no sign of a verifier saying
        "incorrect". Rounds without fresh candidates (cache hits, column anchors) are not counted."""
        trainer = self.trainer
        rounds = trainer.args.anchor_fail_after_rounds
        if counts is None or self._verifier_checked or not rounds or trainer.args.anchor_selection != "correct":
            return
        every = trainer.accelerator.gather(counts.unsqueeze(0).float())
        now = torch.cat([every[:, :4].sum(dim=0), every[:, 4].min().view(1), every[:, 5].max().view(1),
                         every[:, 6:].sum(dim=0)]).cpu()
        if now[0] == 0:
            return
        total = now if self._verifier is None else torch.cat([self._verifier[:4] + now[:4],
                                                              torch.minimum(self._verifier[4], now[4]).view(1),
                                                              torch.maximum(self._verifier[5], now[5]).view(1),
                                                              self._verifier[6:] + now[6:]])
        self._verifier, self._verifier_rounds = total, self._verifier_rounds + 1
        candidates, scored, verified, outside, low, high, failed_not_empty = total.tolist()
        verifier = trainer.args.anchor_reward_funcs or trainer.reward_func_names
        fixes = ("Fixes: a 0/1 verifier reward (e.g. armor_trl.rewards.math_verify_reward), named in anchor_reward_funcs "
                 "when other rewards shape; an anchor_reward_threshold only a correct completion reaches. "
                 "anchor_fail_after_rounds=0 turns this check off.")
        if scored == 0:
            raise ValueError(
                f"No reward function judging correctness ({verifier}; anchor_reward_funcs) returned a reward for any of "
                f"the {candidates:g} reference candidates of the first anchor round: all None, so no candidate can "
                f"reach anchor_reward_threshold={threshold}, no anchor is ever verified and the run would train on "
                "nothing. Return a float (e.g. 1.0 correct, 0.0 wrong) for the completions your verifier judges. "
                + fixes
            )
        if failed_not_empty:  # the verifier failed a non-empty candidate: it can tell correct from wrong
            self._verifier_checked = True
        elif self._verifier_rounds >= rounds:
            self._verifier_checked = True
            rewards = (f"with weighted rewards outside [0, 1] (from {low:g} to {high:g}; reward functions judging "
                       f"correctness: {verifier})")
            if outside and scored == verified:
                raise ValueError(
                    f"Every reference candidate of the first {self._verifier_rounds} anchor rounds ({verified:g} of "
                    f"{candidates:g}) reached anchor_reward_threshold={threshold}, {rewards}: they cannot say "
                    "\"incorrect\", so every anchor would count as verified. " + fixes
                )
            if outside:  # failed only empty completions, which any reward may score low (len(set(c)) scores 0)
                raise ValueError(
                    f"Every reference candidate of the first {self._verifier_rounds} anchor rounds ({verified:g} of "
                    f"{candidates:g}) reached anchor_reward_threshold={threshold} but empty completions "
                    f"({scored - verified:g}), {rewards}: failing only empty completions, they cannot say "
                    "\"incorrect\", so every other anchor would count as verified. " + fixes
                )

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

    def anchor_modes(self, output: dict, is_anchor: torch.Tensor, classifier, prompt_classifier=None) -> None:
        """The anchor mode diagnostic (``anchor_mode_classifier``): each mode's share among the anchors and among the
        on-policy rows of the groups the gate kept (``armor/anchor_mode/<mode>``, ``armor/policy_mode/<mode>``), how
        many anchors are in the kept groups (``armor/anchors_kept``, all processes) and their mean advantage
        (``armor/kept_anchor_advantage_mean``; an anchor whose group all solved the prompt gets 0: it moves nothing).
        With ``prompt_classifier`` (``anchor_mode_prompt_classifier``) the shares are also logged per prompt type,
        ``armor/{anchor,policy}_mode/<type>/<mode>``."""
        trainer = self.trainer
        kept = output.get(KEPT_ROWS)
        kept = torch.ones_like(is_anchor) if kept is None else kept.to(is_anchor.device)
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        ids = output["completion_ids"].masked_fill(output["completion_mask"] == 0, tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        if prompt_classifier is None:
            types = [None] * len(texts)
        else:
            prompt_ids = output["prompt_ids"].masked_fill(output["prompt_mask"] == 0, tokenizer.pad_token_id)
            types = [prompt_classifier(p) for p in tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)]
        local = [(bool(a), classifier(text), kind) for a, k, text, kind in
                 zip(is_anchor.tolist(), kept.tolist(), texts, types) if k]
        rows = [row for part in gather_object([local]) for row in part]  # every process's rows
        for kind, anchor in (("anchor", True), ("policy", False)):
            for prompt_type in (None, *sorted({t for _, _, t in rows if t is not None})):
                modes = [mode for a, mode, t in rows if a == anchor and prompt_type in (None, t)]
                prefix = f"armor/{kind}_mode/" + ("" if prompt_type is None else f"{prompt_type}/")
                for mode in sorted(set(modes)):
                    self.log(prefix + mode, modes.count(mode) / len(modes))
        advantages = output["advantages"].to(is_anchor.device)
        kept_anchors = is_anchor & kept
        count, total = self._sums([kept_anchors.sum(), (advantages * kept_anchors).sum()])
        self.log("armor/anchors_kept", count)
        self.log("armor/kept_anchor_advantage_mean", share(total, count))

    @torch.no_grad()
    def loss_ratios(self, inputs, logps, entropies, ref_logps, alpha, epsilon_low, epsilon_high,
                    level: str = "token") -> None:
        """Per micro-batch, for on-policy and anchor rows (any configuration): what the loss's ratio does.

        ``inputs`` hold the old policy's log-probs as TRL got them (absent: on-policy, π_old = π_θ); ``ref_logps``
        is given when the loss uses the mixed ratio. Logs the share of tokens the loss clips low / high (on r_mix
        with the mixed ratio, on TRL's ratio otherwise, per ``level``; what "clips" means per loss type:
        ``mixture.clip_masks``), mean and max |r − 1| of the plain ratio
        r = π_θ/π_old and, with the mixed ratio, of |r_mix − 1|; mean / min / max of the clipped ratio; the
        entropy; with the mixed ratio the k3 KLs to π_ref."""
        mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).bool()
        old = inputs.get("old_per_token_logps")
        old = logps if old is None else old  # TRL: no old log-probs = one step per rollout batch, π_old = π_θ
        anchor_rows = inputs.get("armor_is_anchor")
        anchor_rows = torch.zeros(mask.size(0), dtype=torch.bool) if anchor_rows is None else anchor_rows
        anchor_rows = anchor_rows.to(mask.device).unsqueeze(1)
        plain = importance_ratio(logps, old, mask)
        mixed = None if ref_logps is None else mixed_ratio(logps, old, ref_logps, alpha)
        if mixed is None:
            clipped = importance_ratio(logps, old, mask, level)
        else:  # the loss's ratio: r_mix per token, or each row's length-normalised one (sequence level)
            clipped = importance_ratio(mixed_logprobs(logps, ref_logps, alpha), mixed_logprobs(old, ref_logps, alpha),
                                       mask, level)
        low, high = clip_masks(clipped, inputs["advantages"], mask, epsilon_low, epsilon_high,
                               getattr(self.trainer, "loss_type", "dapo"))
        entropies = torch.zeros_like(logps) if entropies is None else entropies
        deviations = {"abs_ratio_dev": (plain - 1).abs()}
        if mixed is not None:
            deviations["abs_mixed_ratio_dev"] = (mixed - 1).abs()
        kinds = {"policy": ~anchor_rows & mask, "anchor": anchor_rows & mask}
        sums, maxima = [low.sum(), high.sum(), mask.sum()], []
        for rows in kinds.values():
            sums += [rows.sum(), (low & rows).sum(), (high & rows).sum(), (clipped * rows).sum(),
                     (entropies * rows).sum()] + [(dev * rows).sum() for dev in deviations.values()]
            maxima += [torch.where(rows, clipped, -math.inf).max(), -torch.where(rows, clipped, math.inf).min()]
            maxima += [torch.where(rows, dev, -math.inf).max() for dev in deviations.values()]
        if ref_logps is not None:
            sums += [(k3_kl(logps, ref_logps) * kinds["policy"]).sum(),  # reverse KL(π_θ‖π_ref), on-policy samples
                     (k3_kl(ref_logps, logps) * kinds["anchor"]).sum()]  # forward KL(π_ref‖π_θ), anchor samples
        sums = self._sums(sums)
        maxima = self.trainer.accelerator.gather(torch.stack(maxima).float().unsqueeze(0)).max(dim=0).values.tolist()
        self.log("armor/clip_low_frac", share(sums[0], sums[2]))
        self.log("armor/clip_high_frac", share(sums[1], sums[2]))
        per_kind, extremes = 5 + len(deviations), 2 + len(deviations)
        for index, kind in enumerate(kinds):
            tokens, low_sum, high_sum, ratio_sum, entropy_sum, *dev_sums = sums[3 + index * per_kind:][:per_kind]
            top, neg_bottom, *dev_max = maxima[index * extremes:][:extremes]
            self.log(f"armor/{kind}_clip_low_frac", share(low_sum, tokens))
            self.log(f"armor/{kind}_clip_high_frac", share(high_sum, tokens))
            self.log(f"armor/ratio_{kind}_mean", share(ratio_sum, tokens))
            self.log(f"armor/ratio_{kind}_min", -neg_bottom if tokens else math.nan)
            self.log(f"armor/ratio_{kind}_max", top if tokens else math.nan)
            self.log(f"armor/{kind}_entropy", share(entropy_sum, tokens))
            for name, dev_sum, dev_top in zip(deviations, dev_sums, dev_max):
                self.log(f"armor/{kind}_{name}_mean", share(dev_sum, tokens))
                self.log(f"armor/{kind}_{name}_max", dev_top if tokens else math.nan)
        if ref_logps is not None:
            self.log("armor/kl_reverse_policy", share(sums[-2], sums[3]))
            self.log("armor/kl_forward_anchor", share(sums[-1], sums[3 + per_kind]))
