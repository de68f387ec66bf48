"""Anchor candidates only where they can matter, and drawn in waves (docs/algorithm.md, "Which groups get candidates").

Two savings on the K reference candidates per group of :class:`~armor_trl.rollout.anchor_rollout.AnchorRollout`, neither of
which changes what trains:

* **Eligibility** (``anchor_eligible_only``). Where a group can leave the batch whatever its anchor (dynamic
  sampling drops a group whose on-policy rewards are all equal; with ``anchor_gate_only`` and
  ``anchor_filter="keep"`` the anchor decides nothing), the round's on-policy rows are scored first
  (:func:`score_on_policy`) and candidates are drawn only for the groups whose fate the anchor can change
  (:func:`eligible_groups`). TRL's scoring of the round then reuses those rewards (:meth:`OnPolicyScores.reuse`):
  no reward function runs twice on a row. Eligible groups kept whatever their anchor (:func:`deferrable_groups`) can
  draw after the refill loop instead, if they train (:mod:`~armor_trl.rollout.deferred_anchors`).
* **Waves** (``anchor_sampling="lazy"``). Rejection sampling keeps the first candidate(s) that pass
  ``anchor_selection``; drawing all K at once spends the rest. :func:`draw_in_waves` draws one candidate per group,
  then one more only for the groups that still need one, up to K in all, with π_ref's weights loaded once for all
  waves. The j-th draw of a group is distributed as the eager path's j-th candidate, and a group stops at the
  first draws that the eager path would have picked, so the pick (a draw of π_ref given "verified") and the chance
  of finding one are the eager path's.

Collective calls (generation under ZeRO-3 or vLLM tensor parallelism, the reward gather) must be made by every
process with the same number of rows: eligibility is decided per group on each process, and every wave takes the
largest count of any process (:func:`agreed_count`), the others repeating one of their groups (discarded).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from armor_trl.integration import trl_seam as seam
from armor_trl.integration import trl_generation
from armor_trl.algorithm.advantages import dynamic_sampling_keep, total_rewards
from armor_trl.rollout.anchors import policy_rows, verified_mask
from armor_trl.reference.vllm_swap import reference_in_engine


# --- eligibility ---------------------------------------------------------------------------------------------------
def filters_groups(args) -> bool:
    """Whether this configuration has groups whose fate can be independent of their anchor (then the on-policy rows
    are scored first and only eligible groups get candidates): with ``anchor_eligible_only``, under dynamic sampling,
    or with ``anchor_gate_only`` and ``anchor_filter="keep"`` (the anchor neither joins the group nor gates it)."""
    if not getattr(args, "anchor_eligible_only", False):
        return False
    return bool(args.dynamic_sampling or (args.anchor_gate_only and args.anchor_filter == "keep"))


def eligible_groups(correctness: torch.Tensor, args, anchor_slots: int) -> torch.Tensor:
    """(groups,) bool: the groups whose fate in the batch an anchor can change.

    ``correctness`` (groups, on-policy rows) is what dynamic sampling judges (the verifier's weighted total, NaN where
    nothing scored). A group is eligible when the keep rule decides differently with and without an anchor, or when
    it is kept with one and the anchor joins the group (``anchor_slots`` > 0: it changes the advantages and the loss).
    Ineligible is what leaves the batch whatever its anchor: under dynamic sampling a group whose on-policy rewards
    are all equal (with ``dynamic_sampling_keep_unsolved``: all equal and solved), and with ``anchor_gate_only`` and
    ``anchor_filter="keep"`` without dynamic sampling, every group (the anchor decides nothing).
    """
    with_anchor, without = _kept_with_and_without(correctness, args)
    return (with_anchor != without) | (with_anchor & (anchor_slots > 0))


def deferrable_groups(correctness: torch.Tensor, args, anchor_slots: int) -> torch.Tensor:
    """(groups,) bool: the eligible groups whose keep decision does not depend on their anchor: kept with or without
    one, the anchor only joining the group (its advantages and loss). Under dynamic sampling their candidates can wait
    until the refill loop knows which groups train (:mod:`~armor_trl.rollout.deferred_anchors`). None under the
    authors' gate (``anchor_filter="drop"``: a group without an anchor is dropped); with ``anchor_filter="keep"`` the
    groups with mixed on-policy outcomes (the all-equal unsolved ones that ``dynamic_sampling_keep_unsolved`` keeps
    only with an anchor are not)."""
    with_anchor, without = _kept_with_and_without(correctness, args)
    return with_anchor & without & (anchor_slots > 0)


def _kept_with_and_without(correctness: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups,) bool twice: whether the keep rule keeps each group with an anchor, and without one."""
    groups = correctness.size(0)
    anchored = torch.ones(groups, dtype=torch.bool, device=correctness.device)
    if args.dynamic_sampling:
        on_policy = torch.ones(correctness.size(1), dtype=torch.bool)
        gate = args.anchor_filter == "drop"
        keep = [dynamic_sampling_keep(correctness, on_policy, args.anchor_reward_threshold, has, gate,
                                      args.dynamic_sampling_keep_unsolved)[0] for has in (anchored, ~anchored)]
    else:  # the gate alone: a group without an anchor is dropped ("drop") or trains as it is ("keep")
        keep = [anchored, anchored if args.anchor_filter == "keep" else ~anchored]
    return keep[0], keep[1]


# --- the on-policy rows, scored first ----------------------------------------------------------------------------------
@dataclass
class OnPolicyScores:
    """A round's on-policy rows as scored before its candidates were drawn: what TRL's scoring of the round reuses."""

    completion_ids: list  # local on-policy rows, in row order
    completions: list  # decoded as TRL decodes them for the reward functions
    rewards: torch.Tensor  # (all processes' on-policy rows, reward functions), as TRL's _calculate_rewards returns
    inputs: list | None = None  # the input rows (fields) the reward functions were given, copied; None: not compared

    def reuse(self, trainer, completions: list, completion_ids: list, inputs: list | None = None) -> torch.Tensor | None:
        """The stored rewards when TRL asks to score exactly these rows with the same fields (all processes must
        agree), else None."""
        same = [list(ids) for ids in completion_ids] == self.completion_ids and completions == self.completions
        if same and self.inputs is not None and inputs is not None:
            # a reward function reads the row's fields too (a rollout_func's extra fields among them)
            same = len(inputs) == len(self.inputs) and all(map(same_fields, inputs, self.inputs))
        flag = torch.tensor([float(same)], device=trainer.accelerator.device)
        if trainer.accelerator.num_processes > 1:
            flag = trainer.accelerator.gather(flag).min().view(1)
        return self.rewards if flag.item() == 1.0 else None


def same_fields(row: dict, other: dict) -> bool:
    """Whether two input rows hand the reward functions the same fields (values compared by identity first: an image
    or a tensor need not support ``==``)."""
    if row.keys() != other.keys():
        return False
    for key, value in row.items():
        if value is other[key]:
            continue
        try:
            if not bool(value == other[key]):
                return False
        except (TypeError, ValueError, RuntimeError):  # not comparable as a whole (an array, a tensor): other rows
            return False
    return True


def score_on_policy(trainer, inputs: list[dict], prompt_ids: list, on_policy_ids: list, group_size: int,
                    slots: int, row_fields=None) -> OnPolicyScores:
    """Score a round's on-policy rows with TRL's own scoring (``GRPOTrainer._calculate_rewards``: reward functions,
    their logged metrics and completion columns, the gather over processes), as TRL would score them later.
    ``row_fields(completion_ids)``: the fields TRL adds to a row's inputs before it scores them (a rollout_func's
    extra fields), which this early scoring must hand the reward functions too."""
    rows = len(inputs)
    keep = policy_rows(rows, group_size, slots)
    kept_inputs = [dict(inputs[i]) for i in keep]
    if row_fields is not None:
        kept_inputs = [{**row, **row_fields(ids)} for row, ids in zip(kept_inputs, on_policy_ids)]
    prompts = [row["prompt"] for row in kept_inputs]
    completions = trl_generation.decode_for_rewards(trainer, [prompt_ids[i] for i in keep], on_policy_ids, prompts)
    with seam.completion_columns_spread(trainer, keep, rows):
        rewards = trl_generation.score(trainer, kept_inputs, prompts, completions, on_policy_ids)
    return OnPolicyScores([list(ids) for ids in on_policy_ids], completions, rewards,
                          [dict(row) for row in kept_inputs])


def round_eligibility(trainer, scores: OnPolicyScores, groups: int, slots: int,
                      defers: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(groups,) bool: :func:`eligible_groups` of this process's groups, judged by the verifier as dynamic sampling
    judges them (``anchor_reward_funcs``; all reward functions when None); and, where ``defers``, which of them are
    :func:`deferrable_groups` (else None)."""
    rank, local = trainer.accelerator.process_index, len(scores.completion_ids)
    rewards = scores.rewards[rank * local : (rank + 1) * local]
    weights, verifier = trainer.reward_weights.to(rewards.device), trainer.verifier_funcs
    if verifier is not None:
        rewards, weights = rewards[:, verifier.to(rewards.device)], weights[verifier.to(rewards.device)]
    correctness = total_rewards(rewards, weights).view(groups, -1).cpu()
    eligible = eligible_groups(correctness, trainer.args, slots)
    return eligible, deferrable_groups(correctness, trainer.args, slots) & eligible if defers else None


# --- waves ------------------------------------------------------------------------------------------------------------
def agreed_count(trainer, local: int) -> int:
    """The largest ``local`` of all processes (collective when there are several)."""
    if trainer.accelerator.num_processes == 1:
        return local
    count = torch.tensor([local], device=trainer.accelerator.device)
    return int(trainer.accelerator.gather(count).max())


def picks_needed(args, anchor_slots: int, cached: bool) -> int:
    """Picks after which a group draws no more: its anchor slots, or (anchor cache) as many verified candidates as the
    eager path's round would keep for the prompt (``anchor_cache_per_prompt``)."""
    needed = max(anchor_slots, 1)
    return max(needed, args.anchor_cache_per_prompt) if cached else needed


def draw_in_waves(rollout, group_prompt_ids: list, group_inputs: list, used: list, k: int,
                  candidates: dict | None, needed: int):
    """Candidates for the groups ``used`` (indices into the round's groups), one draw per group and wave, a group
    leaving once it holds ``needed`` picks of ``anchor_selection`` (or K draws).

    Returns ``(candidate_ids, rewards, drawn, generated, scored)`` laid out as the eager path's K candidates per used
    group: candidate ids (None where not drawn), (len(used) × K, reward functions) rewards (NaN where not drawn), the
    (len(used) × K,) drawn mask, and the candidate rows this process generated and scored (padding draws included).
    ``candidates``: {group: its K candidates} already generated (a same-call round): the waves then only score them.
    """
    trainer = rollout.trainer
    candidate_ids, drawn = [None] * (len(used) * k), torch.zeros(len(used) * k, dtype=torch.bool)
    rewards, generated, scored_rows = None, 0, 0
    pending = list(range(len(used)))  # positions in used
    with reference_held(rollout, candidates is None):
        for wave in range(k):
            count = agreed_count(trainer, len(pending))
            if count == 0:
                break
            positions = pending + [pending[0] if pending else None] * (count - len(pending))  # padding, discarded
            groups = [used[p] if p is not None else (used[0] if used else 0) for p in positions]
            prompt_ids = [group_prompt_ids[g] for g in groups]
            if candidates is None:
                ids = rollout._reference_candidates(prompt_ids, 1)
                generated += len(ids)
            else:
                ids = [candidates[g][wave] for g in groups]
            _, scored = rollout._score_candidates(prompt_ids, [group_inputs[g] for g in groups], 1, ids)
            scored_rows += len(ids)
            if rewards is None:
                rewards = torch.full((len(used) * k, scored.size(1)), float("nan"), device=scored.device)
            for row, position in enumerate(positions[: len(pending)]):
                index = position * k + wave
                candidate_ids[index], rewards[index], drawn[index] = ids[row], scored[row], True
            picks = _picks(rollout, rewards, drawn, k)
            pending = [p for p in pending if picks[p] < needed]
    if rewards is None:  # nothing drawn anywhere
        rewards = torch.full((len(used) * k, len(trainer.reward_weights)), float("nan"))
    return candidate_ids, rewards, drawn, generated, scored_rows


def _picks(rollout, rewards: torch.Tensor, drawn: torch.Tensor, k: int) -> list[int]:
    """Per used group, how many of its drawn candidates ``anchor_selection`` would pick."""
    args, mask = rollout.args, drawn.to(rewards.device)
    verified = verified_mask(rewards, rollout.trainer.reward_weights.to(rewards.device), args.anchor_reward_threshold,
                             rollout.funcs) & mask
    picks = {"correct": verified, "any": mask, "incorrect": mask & ~verified}[args.anchor_selection]
    return picks.view(-1, k).sum(dim=1).tolist()


@contextlib.contextmanager
def reference_held(rollout, generating: bool):
    """π_ref's weights loaded once for all waves of a round: with the policy's vLLM engine (colocate), the swap to
    π_ref and back happens around the block, not around each wave (the engine's swap is re-entrant)."""
    trainer = rollout.trainer
    if not generating or not trainer.use_vllm or trainer.reference_server is not None:
        yield
        return
    with reference_in_engine(trainer):
        yield
