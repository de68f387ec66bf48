"""Deferred candidates (``anchor_deferred``, docs/algorithm.md, "Which groups get candidates"): under dynamic sampling,
the groups that train whatever their anchor draw their K candidates once per rollout batch, after the refill loop,
and only if they made the final batch.

With ``anchor_filter="keep"`` a group with mixed on-policy outcomes is kept with or without an anchor; the anchor only
joins it (:func:`~armor_trl.rollout.anchor_waves.deferrable_groups`). Drawn in its round, its candidates are spent
even when the batch then cuts the group (a round keeps more groups than the batch still needs), and every refill round
makes its own candidate call (with vLLM: its own swap of π_ref's weights into the engine). Deferred, the round
leaves the group's anchor slots empty (fillers, out of the loss, as for a group whose candidates all failed) and
:func:`place_deferred` draws the candidates of the batch's deferred groups in one call (one swap; with
``anchor_sampling="lazy"``, one set of waves). Groups whose keep decision depends on their anchor (the authors' gate,
``anchor_filter="drop"``; the all-equal unsolved groups ``dynamic_sampling_keep_unsolved`` keeps only with an anchor)
still draw in their round: the loop must know whether they train. With tools or ``environment_factory`` a deferred
group's candidates are whole trajectories through TRL's loop, from the group's chat prompt of its round, each in an
environment of its own reset with the group's row (:class:`~armor_trl.rollout.tool_anchors.ToolAnchorRollout`); the
anchor row takes its trajectory's ``tool_mask``.

What trains is what the in-round path trains: the same groups (their keep decision never reads the anchor), each
anchor drawn from the same π_ref (no optimizer step or reset happens within a rollout batch) with the same selection,
cache and cross-process padding (:meth:`~armor_trl.rollout.anchor_rollout.AnchorRollout.sample`), and the group's
advantages recomputed with it (dynamic sampling computes them after this). With a real sampler the random draws
differ, so a run is the in-round path's in distribution, not bit for bit.
"""

from __future__ import annotations

import torch

from armor_trl.algorithm.advantages import total_rewards
from armor_trl.algorithm.loss_rows import KEPT_ROWS
from armor_trl.integration import trl_seam as seam
from armor_trl.integration import trl_generation
from armor_trl.rollout.refill import put_rows

DEFERRED = "armor_deferred"  # (rows,) bool: the anchor slots of a round's deferred groups; travels with its rows


def deferred_slots(empty_slots: torch.Tensor, deferred: torch.Tensor, group_size: int) -> torch.Tensor:
    """(rows,) bool: the empty anchor slots of the deferred groups (``deferred``: (groups,) bool)."""
    return empty_slots & deferred.to(empty_slots.device).repeat_interleave(group_size)


def place_deferred(rollout, batch: dict, group_inputs: list[dict], kept: int):
    """Draw the anchors of the deferred groups among the first ``kept`` groups of ``batch`` (the groups that train;
    the others fill a short batch, out of the loss) and put each found one in its slot's row, in place. Collective:
    every process calls it. Returns (the draw's AnchorRound, the local rows that got an anchor), or None when no
    process had a deferred group to draw."""
    flags = batch.pop(DEFERRED, None)
    if flags is None:
        return None
    trainer = rollout.trainer
    group_size, slots = trainer.num_generations, rollout.slots_per_group
    groups = flags.numel() // group_size
    waiting = flags.view(groups, group_size).any(dim=1).cpu()
    waiting[kept:] = False
    total = trainer.accelerator.reduce(waiting.sum().float().to(trainer.accelerator.device), reduction="sum")
    if total.item() == 0:
        return None
    firsts = range(0, groups * group_size, group_size)
    prompt_ids = [batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist() for row in firsts]
    # fillers: what sample() leaves in the slots of groups it does not draw for; those rows are not touched here
    anchor_ids, anchors = rollout.sample(prompt_ids, group_inputs, eligible=waiting, fillers=[[]] * groups,
                                         after_loop=True)
    found = anchors.found.view(groups, slots).cpu()
    rows, ids, scores = [], [], []
    for g, slot in found.nonzero().tolist():
        rows.append(g * group_size + group_size - slots + slot)
        ids.append(anchor_ids[g * slots + slot])
        scores.append(anchors.rewards_per_func[g * slots + slot])
    if rows:
        values = anchor_rows(trainer, batch, ids, torch.stack(scores))
        # per-row fields of the rollout's own (with tools: each trajectory's tool_mask)
        extra = rollout.deferred_row_fields(ids, values["completion_ids"].size(1), values["completion_ids"].device)
        values.update({key: value for key, value in extra.items() if key in batch})
        put_rows(batch, rows, values, seam.pad_token_id(trainer))
    return anchors, rows


def anchor_rows(trainer, batch: dict, completion_ids: list, rewards_per_func: torch.Tensor) -> dict:
    """The batch fields of anchor rows (their completions, masks, rewards and flags) as a round would have made them:
    padded as TRL pads completions, masked where TRL masks truncated ones, never importance-corrected (vLLM), their
    old policy's log-probs left to the caller where the batch holds them."""
    device = batch["completion_ids"].device
    rows = len(completion_ids)
    ids = [torch.tensor(row, dtype=torch.long) for row in completion_ids]
    mask = [torch.ones(len(row), dtype=torch.long) for row in completion_ids]
    pad = seam.pad_token_id(trainer)
    values = {
        "completion_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=pad).to(device),
        "completion_mask": torch.nn.utils.rnn.pad_sequence(mask, batch_first=True).to(device),
    }
    truncated = torch.tensor([trl_generation.is_truncated(trainer, row) for row in completion_ids], device=device)
    values["completion_mask"] = values["completion_mask"] * (~truncated).unsqueeze(1).long()
    width = values["completion_ids"].size(1)
    if "sampling_per_token_logps" in batch:  # not sampled by the policy's engine: no correction (TRL reads NaN so)
        values["sampling_per_token_logps"] = torch.full((rows, width), float("nan"), device=device)
    if "importance_sampling_ratio" in batch:
        ratio = batch["importance_sampling_ratio"]
        per_token = ratio.size(1) == batch["completion_ids"].size(1) and ratio.size(1) > 1
        values["importance_sampling_ratio"] = ratio.new_ones((rows, width if per_token else ratio.size(1)))
    if "old_per_token_logps" in batch:  # (vLLM's correction computed them in the round, for the fillers)
        values["old_per_token_logps"] = torch.zeros((rows, width), device=device)
    weights, verifier = trainer.reward_weights, trainer.verifier_funcs
    rewards_per_func = rewards_per_func.to(weights.device)
    values["armor_reward"] = total_rewards(rewards_per_func, weights).to(device)
    correctness = values["armor_reward"]
    if verifier is not None:  # as dynamic sampling judges correctness (the verifier alone)
        correctness = total_rewards(rewards_per_func[:, verifier.to(weights.device)],
                                    weights[verifier.to(weights.device)]).to(device)
    values["armor_correctness"] = correctness
    values["armor_is_anchor"] = torch.ones(rows, dtype=torch.bool, device=device)
    values[KEPT_ROWS] = torch.ones(rows, dtype=torch.bool, device=device)
    return {key: value for key, value in values.items() if key in batch}
