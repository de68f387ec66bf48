"""DAPO's dynamic sampling with refill, over the trainer's generation rounds (docs/algorithm.md, "The authors' code").

A round is generated and scored by TRL (with anchors, when ARMOR is on); groups whose on-policy samples are all
correct or all wrong (and, with ``anchor_filter="drop"``, groups without an anchor) are dropped, and further rounds
on prompts drawn by :class:`~armor_trl.rollout.refill.RefillSampler` refill the batch until it holds its number of groups or
``dynamic_sampling_max_rounds`` is reached. A refill round generates what is missing (:func:`refill_groups`; with
``dynamic_sampling_refill="batch"`` a whole generation batch): the batch is the same either way, the first kept
groups of the same prompt stream. Correctness is judged by the verifier alone: the reward functions named in
``anchor_reward_funcs`` (all when None), so a shaping reward (format, length) cannot keep a group whose answers are
all wrong.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from armor_trl.integration import trl_seam as seam
from armor_trl.algorithm.advantages import DROP_REASONS, dynamic_sampling_keep, group_advantages
from armor_trl.algorithm.loss_rows import drop_rows
from armor_trl.rollout.refill import RefillSampler, concat_rows, take_rows

logger = logging.get_logger(__name__)


def group_rows(groups: list[int], group_size: int) -> list[int]:
    """Row indices of the given groups (G consecutive rows each)."""
    return [g * group_size + j for g in groups for j in range(group_size)]


def advantages_across_processes(trainer, local_rewards: torch.Tensor, local_keep: torch.Tensor) -> torch.Tensor:
    """Group advantages over all processes' rows (collective), returned for this process's rows."""
    rewards, keep = trainer.accelerator.gather(local_rewards), trainer.accelerator.gather(local_keep)
    advantages = group_advantages(rewards, trainer.num_generations, trainer.scale_rewards,
                                  trainer.args.advantage_quantile, keep, trainer.args.advantage_quantile_interpolation)
    rank, rows = trainer.accelerator.process_index, len(local_rewards)
    return advantages[rank * rows : (rank + 1) * rows]


def refill_groups(missing: int, generated: int, kept: int, batch_groups: int, whole_batch: bool,
                  most: int | None = None) -> int:
    """Groups per process of the next refill round: ``missing`` (the most any process still misses) over the share
    of groups kept so far (``kept`` of ``generated``, all processes, this batch's rounds), rounded up, at most a
    generation batch's ``batch_groups`` (or ``most``, where it is larger: ``dynamic_sampling_refill_max_groups``); a
    whole batch when ``whole_batch`` or nothing was kept yet."""
    if whole_batch or kept == 0:
        return batch_groups
    return min(max(batch_groups, most or 0), -(-missing * generated // kept))


class DynamicSampling:
    """Builds a generation batch of kept groups from as many rounds as needed (collective: every process runs the same
    number of rounds)."""

    def __init__(self, trainer, train_dataset):
        args = trainer.args
        if args.per_device_train_batch_size * args.steps_per_generation % trainer.num_generations:
            raise ValueError(
                "dynamic_sampling=True needs per_device_train_batch_size * steps_per_generation to be a multiple of "
                f"num_generations ({trainer.num_generations}), so that every group lives on one process."
            )
        size = len(train_dataset) if hasattr(train_dataset, "__len__") else None
        if size is None:
            if args.dynamic_sampling_max_rounds > 1:
                raise ValueError(
                    "dynamic_sampling refill draws prompts by index, which an IterableDataset cannot give: set "
                    "dynamic_sampling_max_rounds=1 (drop without refill) or use a map-style Dataset."
                )
            size = 1
        self.trainer, self.args, self.dataset = trainer, args, train_dataset
        self.refill = RefillSampler(size, args.seed)
        self._warned_short = False

    def register(self, state) -> None:
        state.register("refill", self.refill.state_dict, self.refill.load_state_dict)

    def round_keep(self, output: dict, anchors, anchor_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule's decision for each local group of a round, and the reason of each drop."""
        group_size = self.trainer.num_generations
        correctness = output["armor_correctness"].view(-1, group_size)
        on_policy = torch.ones(group_size, dtype=torch.bool)
        has_anchor, gate = None, False
        if anchors is not None:
            on_policy[group_size - anchor_slots :] = False
            has_anchor = anchors.has_anchor.to(correctness.device)
            gate = self.args.anchor_filter == "drop"
        return dynamic_sampling_keep(correctness, on_policy, self.args.anchor_reward_threshold, has_anchor, gate,
                                     self.args.dynamic_sampling_keep_unsolved)

    def batch(self, score_round, inputs: list[dict], complete=None) -> dict:
        """``score_round(inputs)`` -> (TRL's output with ``armor_reward`` / ``armor_correctness``, the round's
        anchors or None, anchor slots per group); returns the batch of kept groups with advantages recomputed.
        ``complete(batch, group_inputs, kept)``, when given, finishes the batch before its advantages are computed
        (the deferred anchors): ``group_inputs`` holds each group's input row, the first ``kept`` groups train."""
        trainer, group_size = self.trainer, self.trainer.num_generations
        target, device = len(inputs) // group_size, trainer.accelerator.device
        kept, spare, kept_groups, spare_groups = [], [], 0, 0
        kept_inputs, spare_inputs = [], []
        counts = torch.zeros(1 + len(DROP_REASONS), device=device)  # groups generated, dropped per reason
        rounds = 0
        while True:
            output, anchors, anchor_slots = score_round(inputs)
            rounds += 1
            keep, reasons = self.round_keep(output, anchors, anchor_slots)
            counts[0] += len(keep)
            for code in DROP_REASONS:
                counts[code] += (reasons == code).sum()
            take = keep.nonzero().flatten().tolist()[: target - kept_groups]
            dropped = (~keep).nonzero().flatten().tolist()[: target - spare_groups]
            if take:
                kept.append(take_rows(output, group_rows(take, group_size)))
                kept_inputs += [inputs[g * group_size] for g in take]
                kept_groups += len(take)
            if dropped:
                spare.append(take_rows(output, group_rows(dropped, group_size)))
                spare_inputs += [inputs[g * group_size] for g in dropped]
                spare_groups += len(dropped)
            short = target - kept_groups
            if rounds >= self.args.dynamic_sampling_max_rounds:
                break
            # one collective: each process's shortfall and its groups generated and dropped in this batch's rounds
            agreed = trainer.accelerator.gather(torch.cat([torch.tensor([float(short)], device=device), counts]))
            agreed = agreed.view(trainer.accelerator.num_processes, -1)
            missing, generated = int(agreed[:, 0].max().item()), int(agreed[:, 1].sum().item())
            if missing == 0:
                break
            last = rounds + 1 >= self.args.dynamic_sampling_max_rounds
            size = refill_groups(missing, generated, generated - int(agreed[:, 2:].sum().item()), target,
                                 whole_batch=last or self.args.dynamic_sampling_refill == "batch",
                                 most=self.args.dynamic_sampling_refill_max_groups)
            indices = self.refill.draw(size, trainer.accelerator.process_index, trainer.accelerator.num_processes)
            inputs = [dict(self.dataset[i]) for i in indices for _ in range(group_size)]
        parts = kept
        if short > 0:  # still short: fill the batch with dropped groups, masked out of the loss
            filler = concat_rows(spare, seam.pad_token_id(trainer))
            parts = kept + [take_rows(filler, list(range(short * group_size)))]
        batch = concat_rows(parts, seam.pad_token_id(trainer))
        if complete is not None:
            complete(batch, kept_inputs + spare_inputs[: max(short, 0)], kept_groups)
        keep = torch.arange(target, device=device) < kept_groups
        batch["advantages"] = advantages_across_processes(trainer, batch["armor_reward"], keep)
        row_keep = keep.repeat_interleave(group_size)
        drop_rows(trainer, batch, row_keep)
        if "armor_is_anchor" in batch:
            batch["armor_is_anchor"] = batch["armor_is_anchor"] & row_keep
        self._log(counts, rounds, short)
        return batch

    def _log(self, counts: torch.Tensor, rounds: int, short: int) -> None:
        trainer = self.trainer
        generated, *dropped = trainer.accelerator.reduce(counts, reduction="sum").tolist()
        short_total = int(trainer.accelerator.reduce(torch.tensor(float(short), device=counts.device), reduction="sum"))
        seam.log_metric(trainer, "armor/generation_rounds", rounds)
        seam.log_metric(trainer, "armor/prompts_per_step", generated)
        seam.log_metric(trainer, "armor/groups_kept_frac", 1.0 - sum(dropped) / generated)
        for name, value in zip(DROP_REASONS.values(), dropped):
            seam.log_metric(trainer, f"armor/dropped_{name}_frac", value / generated)
        seam.log_metric(trainer, "armor/batch_short_groups", short_total)
        if short_total and not self._warned_short:
            self._warned_short = True
            logger.warning(
                f"Dynamic sampling kept too few groups after {rounds} generation rounds "
                f"(dynamic_sampling_max_rounds={self.args.dynamic_sampling_max_rounds}): {short_total} group(s) of the "
                "batch are masked out of the loss. armor/batch_short_groups tracks this (warned once)."
            )
