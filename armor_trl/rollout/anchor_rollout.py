"""Anchor Rollout (docs/algorithm.md, "1. Anchor Rollout"): one verified completion of π_ref in each group.

:class:`AnchorRollout` fills a generation round: G − m on-policy completions per group from the trainer's own path,
then m anchors per group, from the anchor cache, from the dataset's anchor column, or picked from
``anchor_num_samples`` candidates sampled from π_ref and scored once with the trainer's reward functions. It returns
the completions in TRL's row order and an :class:`~armor_trl.rollout.anchors.AnchorRound` with what the later steps need.

Same-call rounds (``anchor_same_call``): when π_ref holds the weights that generate the round, the candidates are
extra rows of the policy's own generate call instead of a second call on π_ref (docs/performance.md).

Which groups get candidates and how they are drawn (``anchor_eligible_only``, ``anchor_sampling``) is
:mod:`~armor_trl.rollout.anchor_waves`: where a group's fate can be independent of its anchor the on-policy rows are scored
first and only eligible groups sample; lazy rounds draw in waves. Under dynamic sampling the eligible groups kept
whatever their anchor draw after the refill loop, if they train (``anchor_deferred``,
:mod:`~armor_trl.rollout.deferred_anchors`).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter

import torch

from armor_trl.integration import trl_seam as seam
from armor_trl.integration import trl_generation
from armor_trl.algorithm.advantages import total_rewards
from armor_trl.rollout.anchors import (AnchorCache, AnchorRound, anchor_rows, fill_groups, policy_rows, select_anchors, verified_mask,
                      verifier_counts)
from armor_trl.rollout.anchor_waves import (agreed_count, draw_in_waves, filters_groups, picks_needed, round_eligibility,
                                           score_on_policy)
from armor_trl.rollout.deferred_anchors import DEFERRED, deferred_slots, place_deferred
from armor_trl.rollout.column_anchors import ColumnAnchors, verify_round
from armor_trl.algorithm.loss_rows import drop_rows
from armor_trl.reference.vllm_swap import neutral_sampling_logprobs, reference_in_engine


class AnchorRollout:
    """Samples, picks, caches and places the anchors of each generation round of ``trainer``."""

    def __init__(self, trainer, train_dataset):
        args = trainer.args
        self.trainer, self.args = trainer, args
        # anchor slots per group: none when the anchor only gates its group (anchor_gate_only)
        self.slots_per_group = 0 if args.anchor_gate_only else args.anchors_per_group
        self.funcs = trainer.verifier_funcs  # the reward functions that verify a candidate (None: all)
        self.same_call_round = False  # whether the last round's candidates came from the policy's own call
        self.on_policy_scores = None  # the round's on-policy rows scored before its candidates (anchor_waves)
        # this process's running totals: candidate rows generated and scored, groups that found an anchor among
        # fresh candidates, groups and eligible groups of sampled rounds (the bench reads them)
        self.counts = Counter()
        self.cache = AnchorCache(args.anchor_cache_size, args.anchor_cache_per_prompt) if args.anchor_cache else None
        self.column = None
        if args.anchor_source == "column":
            self.column = ColumnAnchors(args.anchor_column, args.seed, seam.tokenizer(trainer),
                                        trainer.max_completion_length)
            self.column.check_dataset(train_dataset)

    def register(self, state) -> None:
        if self.cache is not None:
            state.register("anchor_cache", self.cache.state_dict, self.cache.load_state_dict)
        if self.column is not None:
            state.register("column_anchors", self.column.state_dict, self.column.load_state_dict)

    # --- a round -----------------------------------------------------------------------------------------------
    def generate(self, generate_policy, prompt_ids: list, group_size: int, inputs: list[dict]):
        """The round's completion ids (and vLLM sampling log-probs, or None) in row order, and its AnchorRound.

        ``generate_policy(prompt_ids, n)`` is TRL's own generation of the on-policy completions (and, in a same-call
        round, of the K anchor candidates per group too).
        """
        rows, slots = len(prompt_ids), self.slots_per_group
        firsts = list(range(0, rows, group_size))
        group_prompt_ids, group_inputs = [prompt_ids[i] for i in firsts], [inputs[i] for i in firsts]
        self.same_call_round = self.same_call_applies()
        seam.log_metric(self.trainer, "armor/anchor_same_call", float(self.same_call_round))
        candidates = None
        if self.same_call_round:
            on_policy_ids, on_policy_logprobs, candidates = self._same_call(generate_policy, group_prompt_ids,
                                                                            group_size - slots)
        else:
            on_policy_ids, on_policy_logprobs = generate_policy(
                [prompt_ids[i] for i in policy_rows(rows, group_size, slots)], group_size - slots
            )
        # scored first where some groups' fate cannot depend on their anchor (they then get no candidates)
        self.on_policy_scores, eligible, deferred = None, None, None
        column = self.column is not None and self.column.active(self.trainer.reference.resets)
        if filters_groups(self.args) and not column:
            self.on_policy_scores = score_on_policy(self, inputs, prompt_ids, on_policy_ids, group_size, slots)
            eligible, deferred = round_eligibility(self.trainer, self.on_policy_scores, len(firsts), slots,
                                                   self.defers_candidates())
        fillers = [on_policy_ids[g * (group_size - slots)] for g in range(len(firsts))]
        anchor_ids, anchors = self.sample(group_prompt_ids, group_inputs, candidates, eligible=eligible, fillers=fillers,
                                          deferrable=deferred)
        if not slots:  # anchor_gate_only: the anchors decided the gate and are not trained
            return on_policy_ids, on_policy_logprobs, anchors
        logprobs = None
        if on_policy_logprobs is not None:  # vLLM: anchors are never importance-corrected (their ratio is set to 1)
            logprobs = fill_groups(on_policy_logprobs, neutral_sampling_logprobs(anchor_ids), group_size, slots)
        return fill_groups(on_policy_ids, anchor_ids, group_size, slots), logprobs, anchors

    def reward_fields(self, completion_ids: list) -> dict:
        """The fields TRL adds to this completion's input row before its reward functions run (none on TRL's own
        generation paths; a rollout_func's extra fields: :class:`~armor_trl.rollout.rollout_func.RolloutFuncAnchors`)."""
        return {}

    def reward_prompts(self, rows: list[int], inputs: list[dict]) -> list:
        """The prompts TRL hands the reward functions with these rows of the round: their dataset prompts (after an
        environment's reset with tools: :class:`~armor_trl.rollout.tool_anchors.ToolAnchorRollout`)."""
        return [inputs[i]["prompt"] for i in rows]

    def reward_completions(self, prompt_ids: list, completion_ids: list, prompts: list) -> list:
        """The completions as TRL hands them to the reward functions (with tools: the trajectories' messages)."""
        return trl_generation.decode_for_rewards(self.trainer, prompt_ids, completion_ids, prompts)

    def same_call_applies(self) -> bool:
        """Whether this round's K candidates per group can be extra rows of the policy's generate call: π_ref holds
        the weights that generate the round (the policy's weights have not changed since the reference copied them:
        :meth:`~armor_trl.reference.policy.ReferencePolicy.holds_policy_weights`), the policy generates without dropout
        (TRL generates and scores in train mode, π_ref runs in eval mode), and the anchors are sampled, not read from
        the dataset's column."""
        trainer = self.trainer
        if not self.args.anchor_same_call:
            return False
        if self.column is not None and self.column.active(trainer.reference.resets):
            return False
        return trainer.reference.holds_policy_weights() and not dropout_active(trainer.model)

    def defers_candidates(self) -> bool:
        """Whether this round's groups that are kept whatever their anchor draw their candidates after the refill
        loop, once per rollout batch and only if they train (``anchor_deferred`` under dynamic sampling; not in a
        same-call round, whose candidates come with the policy's call, nor for a VLM, whose images are known to their
        round only)."""
        return (self.args.anchor_deferred and self.args.dynamic_sampling and self.slots_per_group > 0
                and not self.same_call_round and not seam.is_vlm(self.trainer))

    def deferred_anchors(self, batch: dict, group_inputs: list[dict], kept: int):
        """Draw and place the deferred groups' anchors in the batch dynamic sampling built (see
        :func:`~armor_trl.rollout.deferred_anchors.place_deferred`); returns (their AnchorRound, the rows placed) or
        None where no process had any to draw."""
        return place_deferred(self, batch, group_inputs, kept)

    def deferred_row_fields(self, completion_ids: list, width: int, device) -> dict:
        """Per-row batch fields of anchors drawn after the refill loop beyond the completion's own (none here; with
        tools their ``tool_mask``), each ``width`` wide."""
        return {}

    def _same_call(self, generate_policy, group_prompt_ids: list, per_group: int):
        """One policy call with ``per_group`` on-policy rows and K candidate rows per group: the on-policy ids (and
        vLLM log-probs) in row order, and {group: its K candidates}. All rows of a group are i.i.d. samples of the
        same policy, so which of them are candidates does not matter: the last K."""
        n = per_group + self.args.anchor_num_samples
        ids, logprobs = generate_policy([ids for ids in group_prompt_ids for _ in range(n)], n)
        on_policy, on_policy_logprobs, candidates = [], None if logprobs is None else [], {}
        for g in range(len(group_prompt_ids)):
            on_policy += ids[g * n : g * n + per_group]
            candidates[g] = ids[g * n + per_group : (g + 1) * n]
            if logprobs is not None:
                on_policy_logprobs += logprobs[g * n : g * n + per_group]
        return on_policy, on_policy_logprobs, candidates

    def sample(self, group_prompt_ids: list, group_inputs: list[dict], candidates: dict | None = None,
               eligible: torch.Tensor | None = None, fillers: list | None = None,
               deferrable: torch.Tensor | None = None, after_loop: bool = False) -> tuple[list, AnchorRound]:
        """``max(anchor slots, 1)`` anchors per group, group after group: from the cache, the column, or picked from K
        reference candidates per ``anchor_selection`` (``candidates``: {group: its K candidates}, already sampled in
        the policy's call; else sampled here, all K at once or in waves per ``anchor_sampling``). Where no candidate
        is eligible the slot still gets one (so shapes stay fixed) and ``found`` marks it; it is then no member of its
        group. ``eligible`` (groups,): only these groups look for an anchor (None: all); the others' slots hold their
        ``fillers`` (one on-policy completion of the group each). ``deferrable`` (groups,): eligible groups kept
        whatever their anchor; they look at the cache now (a hit, or a remembered failure skipped, settles them in
        their round, as on the paper's path at this visit), and those that would draw wait for the refill loop's end
        (``AnchorRound.deferred``), their slots holding fillers meanwhile. ``after_loop``: the waiting groups of a
        batch, drawn after the refill loop: they looked at the cache in their round, so it is not read again here
        (only filled), and they are counted apart from the rounds' groups."""
        trainer, args = self.trainer, self.args
        device = trainer.accelerator.device
        if self.column is not None and self.column.active(trainer.reference.resets):
            return self.column.round_anchors(group_prompt_ids, group_inputs, device)
        k, per_group, groups = args.anchor_num_samples, max(self.slots_per_group, 1), len(group_prompt_ids)
        looks = [True] * groups if eligible is None else eligible.tolist()
        cached, known_failures = [None] * groups, [None] * groups
        if self.cache is not None:
            self.cache.sync(trainer.reference.resets)
        if self.cache is not None and not after_loop:
            # in group order, as the paper's path visits them: a group that does not look still moves the cache's
            # rotation and counts its visit (AnchorCache.visit_unlooked), so its later anchors are the paper's path's
            cached = [self.cache.get(ids) if look else self.cache.visit_unlooked(ids)
                      for ids, look in zip(group_prompt_ids, looks)]
            if args.anchor_cache_failures:
                known_failures = [
                    None if hit is not None or not look else self.cache.known_failure(ids, args.anchor_failure_retry_every)
                    for ids, hit, look in zip(group_prompt_ids, cached, looks)
                ]
        waits = [False] * groups if deferrable is None else [
            bool(wait) and cached[g] is None and known_failures[g] is None for g, wait in enumerate(deferrable.tolist())]
        to_sample = [g for g in range(groups)
                     if looks[g] and not waits[g] and cached[g] is None and known_failures[g] is None]
        # Generation and scoring are collective (ZeRO-3 gathers, rewards are gathered): every process samples
        # the same number of groups. Spare places retry remembered failures, then repeat a group (discarded).
        rounds = len(to_sample)
        if self.cache is not None or eligible is not None:
            rounds = agreed_count(trainer, rounds)
        retried = [g for g in range(groups) if known_failures[g] is not None][: max(rounds - len(to_sample), 0)]
        used = to_sample + retried
        sampled = used + [used[0] if used else 0] * (rounds - len(used))

        weights = trainer.reward_weights
        anchors = [[None] * per_group for _ in range(groups)]
        scores = torch.full((groups, per_group, len(weights)), float("nan"))  # per reward function
        for g in range(groups):
            if not looks[g] or waits[g]:
                anchors[g] = [fillers[g]] * per_group  # fills the slots; the group's fate does not need an anchor (yet)
            elif cached[g] is not None:
                anchors[g][0], scores[g, 0] = cached[g][0], torch.tensor(cached[g][1])
            elif known_failures[g] is not None and g not in retried:
                anchors[g][0] = known_failures[g]  # fills the slot; the group has no anchor this round
        found = torch.tensor([[cached[g] is not None] + [False] * (per_group - 1) for g in range(groups)])
        verified_frac, best_candidate = torch.empty(0), math.nan
        counts = verifier_counts(torch.empty(0, len(weights)), weights, args.anchor_reward_threshold)
        generated = scored = fresh_anchors = 0
        if sampled and args.anchor_sampling == "lazy":
            candidate_ids, rewards, drawn, generated, scored = draw_in_waves(
                self, group_prompt_ids, group_inputs, used, k, candidates,
                picks_needed(args, self.slots_per_group, self.cache is not None))
        elif sampled:
            candidate_ids, rewards = self._score_candidates(
                [group_prompt_ids[g] for g in sampled], [group_inputs[g] for g in sampled], k,
                None if candidates is None else [ids for g in sampled for ids in candidates[g]],
            )
            drawn = torch.ones(len(used) * k, dtype=torch.bool)
            generated = 0 if candidates is not None else len(candidate_ids)
            scored = len(candidate_ids)
        if sampled:
            weights = weights.to(rewards.device)
            chosen, _ = select_anchors(rewards, weights, k, args.anchor_reward_threshold, per_group,
                                       args.anchor_selection, self.funcs)
            verified = verified_mask(rewards, weights, args.anchor_reward_threshold, self.funcs)
            fresh = drawn.to(rewards.device)  # this round's drawn candidates of the groups used
            verified_frac = verified[: len(used) * k][fresh].float()
            totals = (torch.nan_to_num(rewards) * weights).sum(dim=1)
            # over this process's drawn candidates only: padding draws for another process's calls are discarded,
            # and a process may have drawn none of its own (all its groups ineligible or cache hits)
            own = totals[: len(used) * k][fresh]
            best_candidate = own.max().item() if own.numel() else math.nan
            # (lazy waves leave undrawn candidates as None: only this round's drawn ones are decoded)
            drawn_ids = [ids for ids, taken in zip(candidate_ids[: len(used) * k], drawn.tolist()) if taken]
            texts = trl_generation.decode(trainer, drawn_ids, False)
            empty = torch.tensor([not text.strip() for text in texts], dtype=torch.bool)
            counts = verifier_counts(rewards[: len(used) * k][fresh], weights, args.anchor_reward_threshold, self.funcs,
                                     empty=empty)
            for position, g in enumerate(used):
                for slot in range(per_group):
                    index = int(chosen[position, slot])
                    anchors[g][slot] = candidate_ids[position * k + max(index, 0)]
                    if index >= 0:
                        scores[g, slot], found[g, slot] = rewards[position * k + index].cpu(), True
                fresh_anchors += int(found[g].any())
                if self.cache is not None:
                    self._remember(g, group_prompt_ids[g], anchors, scores, found, candidate_ids, rewards, verified,
                                   range(position * k, (position + 1) * k))
        if candidates is not None:  # a same-call round generated K candidates for every group in the policy's call
            generated = k * groups
        self.counts.update(candidate_rows=generated, candidates_scored=scored, anchors_from_candidates=fresh_anchors)
        looked = [look and not wait for look, wait in zip(looks, waits)]  # (in this round / call)
        if after_loop:
            self.counts.update(deferred_groups=sum(looked), deferred_calls=1)
        else:
            self.counts.update(groups=groups, eligible_groups=sum(looked), rounds=1)
        weighted = (torch.nan_to_num(scores) * trainer.reward_weights.cpu()).sum(dim=2)
        reward = torch.where(found, weighted, torch.full_like(weighted, float("nan")))
        found = found.to(device)
        anchor_round = AnchorRound(
            found=found.flatten() if self.slots_per_group else found.new_zeros(0),  # per anchor slot
            has_anchor=found.any(dim=1),  # per group
            reward=reward.flatten().to(device),
            candidates_verified=verified_frac.to(device),
            cache_hits=torch.tensor([sum(hit is not None for hit in cached), sum(looked)], device=device,
                                    dtype=torch.float),  # over the groups that looked for an anchor
            rewards_per_func=scores.flatten(0, 1)[: groups * self.slots_per_group].to(device),
            best_candidate_reward=best_candidate,
            verifier_counts=counts.to(device),
            eligible=None if eligible is None else torch.tensor(looked, device=device),
            candidate_rows=torch.tensor([float(generated), float(scored)], device=device),
            deferred=None if deferrable is None else torch.tensor(waits, device=device),
            after_loop=after_loop,
        )
        return [ids for group in anchors for ids in group], anchor_round

    def _score_candidates(self, prompt_ids: list, inputs: list[dict], k: int, candidate_ids: list | None = None):
        """K candidates of π_ref per prompt (sampled here unless given) and their rewards (rows, reward functions),
        NaN where None."""
        trainer = self.trainer
        candidate_prompt_ids = [ids for ids in prompt_ids for _ in range(k)]
        candidate_inputs = [row for row in inputs for _ in range(k)]
        if candidate_ids is None:
            candidate_ids = self._reference_candidates(candidate_prompt_ids, k)
        prompts = [row["prompt"] for row in candidate_inputs]
        conversational = trl_generation.is_conversational_prompt(prompts[0])
        completions = trl_generation.decode(trainer, candidate_ids, conversational)
        return candidate_ids, trl_generation.score_quietly(trainer, candidate_inputs, prompts, completions,
                                                           candidate_ids)

    def _reference_candidates(self, prompt_ids: list, k: int, inputs: list[dict] | None = None) -> list:
        """π_ref's completions: on the reference's own vLLM server when there is one, else on TRL's path (with the
        policy's vLLM engine holding π_ref's weights meanwhile, or the reference model routed in). ``inputs``: the
        candidates' rows (read with tools, :class:`~armor_trl.rollout.tool_anchors.ToolAnchorRollout`)."""
        trainer = self.trainer
        if trainer.reference_server is not None:
            return trainer.reference_server.generate(prompt_ids, k, trainer.unwrapped_policy())
        with self.reference_routed():
            return trl_generation.generate(trainer, prompt_ids, k)

    @contextlib.contextmanager
    def reference_routed(self):
        """Within the block TRL's generation path samples from π_ref: the policy's vLLM engine holding π_ref's weights,
        or the reference model (LoRA: its adapter) routed into the transformers path."""
        trainer = self.trainer
        if trainer.use_vllm:
            with reference_in_engine(trainer):
                yield
            return
        reference = trainer.reference
        routed = trl_generation.generating_with(trainer, reference.full_model)
        with reference.active(trainer.unwrapped_policy()), routed:
            yield

    def _remember(self, g, prompt_ids, anchors, scores, found, candidate_ids, rewards, verified, span) -> None:
        """Keep up to anchor_cache_per_prompt verified candidates, the chosen anchor first; without one, reuse a kept
        anchor of the prompt, or remember the failure."""
        fresh = [i for i in span if verified[i]][: self.args.anchor_cache_per_prompt]
        for i in fresh:
            self.cache.put(prompt_ids, candidate_ids[i], rewards[i].tolist())
        # filled now, after visits at which the group did not look: the anchor the paper's path's rotation is at
        # (first_fill forgets those visits either way)
        filled = self.cache.first_fill(prompt_ids)
        kept = filled if fresh else self.cache.get(prompt_ids, partial=True)
        if kept is not None:  # (or: no verified candidate now, but the prompt has a kept anchor)
            anchors[g][0], scores[g, 0], found[g, 0] = kept[0], torch.tensor(kept[1]), True
        elif not fresh and self.args.anchor_cache_failures:
            self.cache.put_failure(prompt_ids, anchors[g][0])

    # --- rows of a round ---------------------------------------------------------------------------------------
    def slot_rows(self, rows: int, device) -> torch.Tensor:
        """Local row indices of the anchor slots."""
        group_size = self.trainer.num_generations
        return torch.tensor(anchor_rows(rows, group_size, self.slots_per_group), device=device, dtype=torch.long)

    def anchor_mask(self, rows: int, anchors: AnchorRound | None, device) -> torch.Tensor:
        """(rows,) bool: the local rows that hold a verified anchor."""
        mask = torch.zeros(rows, dtype=torch.bool, device=device)
        if anchors is not None:
            mask[self.slot_rows(rows, device)[anchors.found.to(device)]] = True
        return mask

    def empty_slots(self, rows: int, anchors: AnchorRound | None, device) -> torch.Tensor:
        """(rows,) bool: the local anchor slots that hold no anchor (a filler, no member of its group)."""
        empty = torch.zeros(rows, dtype=torch.bool, device=device)
        if anchors is not None:
            empty[self.slot_rows(rows, device)[~anchors.found.to(device)]] = True
        return empty

    def reusing_scores(self, score):
        """``score`` (TRL's scoring), except that rows already scored before the candidates were drawn
        (:func:`~armor_trl.rollout.anchor_waves.score_on_policy`) keep those rewards: no reward function runs twice."""
        early, self.on_policy_scores = self.on_policy_scores, None
        if early is None:
            return score

        def scored_once(inputs, prompts, completions, completion_ids):
            reused = early.reuse(self.trainer, completions, completion_ids, inputs)
            return reused if reused is not None else score(inputs, prompts, completions, completion_ids)

        return scored_once

    def score_round(self, score, inputs, prompts, completions, completion_ids, anchors: AnchorRound):
        """TRL's reward tensor (all processes' rows, reward functions) of a round whose anchors were scored when they
        were picked: ``score`` (TRL's scoring) runs on the on-policy rows only and the anchors keep their scores, so
        a verified anchor is never judged twice (a verifier timeout could turn it into a negative advantage)."""
        rows, group_size = len(prompts), self.trainer.num_generations
        keep = policy_rows(rows, group_size, self.slots_per_group)
        with seam.completion_columns_spread(self.trainer, keep, rows):
            scored = score(*([items[i] for i in keep] for items in (inputs, prompts, completions, completion_ids)))
        processes = self.trainer.accelerator.num_processes
        slots = self.slot_rows(rows, scored.device)
        anchor_scores = self.trainer.accelerator.gather(anchors.rewards_per_func.to(scored.device))
        rewards = scored.new_full((rows * processes, scored.size(1)), float("nan"))
        keep = torch.tensor(keep, device=scored.device, dtype=torch.long)
        for rank in range(processes):
            rewards[rank * rows + keep] = scored[rank * len(keep) : (rank + 1) * len(keep)]
            rewards[rank * rows + slots] = anchor_scores[rank * len(slots) : (rank + 1) * len(slots)].to(scored)
        return rewards

    def settle_rewards(self, rewards: torch.Tensor, rows: int, anchors: AnchorRound | None) -> None:
        """After TRL's scoring (``rewards``: all processes' rows): verify column anchors, flag the anchor rows in the
        completions table, and take empty anchor slots out of their groups (NaN, which TRL's statistics skip)."""
        trainer = self.trainer
        if anchors is not None and anchors.column:
            # a column anchor below anchor_reward_threshold counts as missing (scored by TRL as a group member)
            rank = trainer.accelerator.process_index
            local = rewards[rank * rows : (rank + 1) * rows][self.slot_rows(rows, rewards.device)]
            counts = verify_round(anchors, local, trainer.reward_weights.to(rewards.device),
                                  self.args.anchor_reward_threshold, self.funcs)
            offered, rejected = trainer.accelerator.reduce(torch.tensor(counts, device=rewards.device),
                                                           reduction="sum").tolist()
            seam.log_metric(trainer, "armor/column_anchor_rejected_frac", rejected / offered if offered else math.nan)
        if trainer.log_completions:
            seam.add_completion_column(trainer, "anchor", self.anchor_mask(rows, anchors, "cpu").tolist())
        if anchors is None:
            return
        rewards[trainer.accelerator.gather(self.empty_slots(rows, anchors, rewards.device).int()).bool()] = math.nan
        is_policy = torch.ones(rows, dtype=torch.bool, device=rewards.device)
        is_policy[self.slot_rows(rows, rewards.device)] = False
        totals = total_rewards(rewards, trainer.reward_weights)
        seam.log_metric(trainer, "armor/policy_reward_mean",
                        torch.nanmean(totals[is_policy.repeat(len(rewards) // rows)]).item())

    def mask_groups(self, output: dict, anchors: AnchorRound) -> torch.Tensor:
        """Mask empty anchor slots (and, with ``anchor_filter="drop"``, groups without an anchor) out of the loss;
        return the (rows,) anchor flag."""
        completion_mask, rows = output["completion_mask"], output["completion_ids"].size(0)
        device = completion_mask.device
        keep = ~self.empty_slots(rows, anchors, device)
        if self.args.anchor_filter == "drop":
            keep &= anchors.has_anchor.to(device).repeat_interleave(self.trainer.num_generations)
        if "importance_sampling_ratio" in output:  # vLLM correction: anchors were sampled by π_ref, not the engine
            output["importance_sampling_ratio"][self.slot_rows(rows, device)] = 1.0
        drop_rows(self.trainer, output, keep)
        if anchors.deferred is not None:  # their slots wait, empty, for the anchors drawn after the refill loop
            output[DEFERRED] = deferred_slots(self.empty_slots(rows, anchors, device), anchors.deferred,
                                              self.trainer.num_generations)
        return self.anchor_mask(rows, anchors, device)


def dropout_active(model) -> bool:
    """Whether ``model`` in its current mode drops anything: a dropout module with p > 0 in train mode (LoRA's
    dropout among them), or, in train mode, a dropout rate in its config (attention dropout is applied by the
    attention function from ``config.attention_dropout``, not by a module)."""
    if not model.training:
        return False
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {}
    return any(("dropout" in key or key.endswith("pdrop")) and isinstance(value, (int, float)) and value > 0
               for key, value in settings.items())


def reward_func_mask(names, reward_func_names: list[str]) -> torch.Tensor | None:
    """(F,) bool: the reward functions that decide whether a candidate is correct (None = all)."""
    if names is None:
        return None
    unknown = sorted(set(names) - set(reward_func_names))
    if unknown:
        raise ValueError(
            f"anchor_reward_funcs names {unknown}, which are not among this trainer's reward functions "
            f"{reward_func_names}."
        )
    return torch.tensor([name in names for name in reward_func_names])
