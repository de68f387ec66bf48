"""Rows taken out of a generation batch's loss, and the loss's normalisers over the rows that stay in.

Empty anchor slots and the groups the gate drops (:meth:`~armor_trl.rollout.anchor_rollout.AnchorRollout.mask_groups`), and
the filler groups of a batch that dynamic sampling could not complete (:class:`~armor_trl.rollout.dynamic_sampling.
DynamicSampling`), stay in the batch so that its shape stays TRL's, with advantage 0 and completion mask 0: they add
nothing to the loss. What TRL's loss divides by must then count the kept rows only. By ``loss_type``:

* ``dapo``, ``cispo``, ``vespo``: the generation batch's token count ``num_items_in_batch``, recomputed here;
* ``bnpo``: the micro-batch's token count, which masked rows already leave out; but TRL averages the micro-batches of
  an optimizer step (by dividing each by the gradient accumulation steps, and across processes), and a micro-batch
  whose rows were all taken out adds 0 while it counts: 16 rows, 2 micro-batches, the 4 kept rows all in one would
  take half a step. :func:`micro_batch_share` is the share of the step's micro-batches (all processes) that hold a
  kept row, and :func:`over_kept_rows` divides bnpo's advantages by it, so the step is the mean over those;
* ``grpo``, ``sapo``, ``luspo``: the micro-batch's row count, and ``dr_grpo``: rows × ``max_completion_length``; both
  count masked rows, so a batch with half its rows dropped would take half a step. :func:`over_kept_rows` divides
  the advantages in the loss by the kept rows' share of the generation batch (all processes): each of these losses is
  positively homogeneous in the advantages (the clipped surrogate, SAPO's sign-chosen gate, the plain weights), so
  the loss becomes the same mean over the kept rows, and is unchanged when every row is kept.

TRL's entropy bonus (``entropy_coef``, ``use_adaptive_entropy``) is a per-micro-batch token mean as well, whatever
the loss type: :func:`entropy_bonus_correction` scales it by the same share. The micro-batches of an optimizer step are
those of TRL's buffered generation batch: exact when an optimizer step lies within one generation batch
(``steps_per_generation`` a multiple of the gradient accumulation steps; TRL's default makes them equal); otherwise
each generation batch's micro-batches stand for the step's. The MoE router's auxiliary loss is computed from every
row's forward pass, taken out of the loss or not, so no micro-batch adds 0 to it: it keeps TRL's normaliser.

TRL's own masking (e.g. ``mask_truncated_completions``) keeps TRL's definitions. With β ≠ 0 (ARMOR off) the KL term
of a row-count loss keeps TRL's normaliser.

Like the rest of :mod:`armor_trl.algorithm`, nothing here imports TRL: what only TRL's private state knows (the
micro-batches of the current optimizer step, whether its loss adds an entropy bonus) is read by the caller through
:mod:`armor_trl.integration.trl_seam` and passed in; ``trainer`` is used for its public attributes only.
"""

from __future__ import annotations

import torch

ROW_COUNT_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo")  # TRL divides these by the micro-batch's row count
KEPT_ROWS = "armor_loss_row"  # (rows,) bool: the row is in the loss; travels with its row through TRL's shuffle
KEPT_SHARE = "armor_kept_row_share"  # 0-dim: kept rows / rows of the generation batch, over all processes


def drop_rows(trainer, output: dict, keep: torch.Tensor) -> None:
    """Take the local rows where ``keep`` is False (and those taken out before) out of ``output``'s loss, and set the
    normalisers over the kept rows (collective: every process calls it)."""
    completion_mask = output["completion_mask"]
    keep = keep.to(completion_mask.device) & output.get(KEPT_ROWS, torch.ones_like(keep)).to(completion_mask.device)
    output[KEPT_ROWS] = keep
    output["advantages"] = output["advantages"] * keep.to(output["advantages"].device)
    output["completion_mask"] = completion_mask * keep.unsqueeze(1).to(completion_mask.dtype)
    loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
    output["num_items_in_batch"] = trainer.accelerator.gather(loss_mask.sum()).sum()
    counts = torch.tensor([keep.sum().item(), keep.numel()], dtype=torch.float, device=completion_mask.device)
    kept, rows = trainer.accelerator.reduce(counts, reduction="sum")
    output[KEPT_SHARE] = kept / rows


def needs_micro_batch_share(loss_type: str, entropy_bonus: bool, inputs: dict) -> bool:
    """Whether the loss of ``inputs`` needs :func:`micro_batch_share` (the same answer on every process);
    ``entropy_bonus``: whether TRL's loss adds its entropy bonus."""
    return KEPT_ROWS in inputs and (loss_type == "bnpo" or entropy_bonus)


def micro_batch_share(trainer, inputs: dict, step_micro_batches: list[dict],
                      entropy_bonus: bool) -> torch.Tensor | None:
    """The share of the current optimizer step's micro-batches (``step_micro_batches``: this process's, ``inputs``
    among them), over all processes, that hold a row in the loss; None where no row was taken out of the loss or
    nothing divides by it (collective: every process calls it for every micro-batch)."""
    if not needs_micro_batch_share(trainer.loss_type, entropy_bonus, inputs):
        return None
    held = sum(bool(batch[KEPT_ROWS].any()) for batch in step_micro_batches)
    counts = torch.tensor([float(held), float(len(step_micro_batches))], device=inputs["advantages"].device)
    held, micro_batches = trainer.accelerator.reduce(counts, reduction="sum")
    return held / micro_batches


def over_kept_rows(loss_type: str, inputs: dict, micro_batches_held: torch.Tensor | None = None) -> dict:
    """``inputs`` for TRL's loss, with the advantages divided by the kept rows' share where ``loss_type`` divides by
    a row count, and for ``bnpo`` by the share of the step's micro-batches that hold a kept row
    (``micro_batches_held``, :func:`micro_batch_share`); unchanged otherwise (see the module's docstring)."""
    share = micro_batches_held if loss_type == "bnpo" else inputs.get(KEPT_SHARE)
    if share is None or (loss_type not in ROW_COUNT_LOSSES and loss_type != "bnpo"):
        return inputs
    # share 0: every row dropped, every advantage 0, and 0 it stays
    return {**inputs, "advantages": inputs["advantages"] / share.clamp(min=torch.finfo(share.dtype).tiny)}


def entropy_bonus_correction(trainer, inputs: dict, entropies, micro_batches_held, coef: float):
    """What to add to TRL's loss so that its entropy bonus, ``coef`` × the micro-batch's mean entropy over its loss
    tokens ÷ the accumulation steps, counts only the step's micro-batches that hold a kept row (0 where nothing is
    to correct). ``coef``: the coefficient TRL applied in this micro-batch (read before TRL's loss; 0 without a
    bonus)."""
    if micro_batches_held is None or entropies is None or not coef:
        return 0.0
    mask = inputs["completion_mask"]
    if inputs.get("tool_mask") is not None:
        mask = mask * inputs["tool_mask"]
    if trainer.top_entropy_quantile < 1.0:  # the tokens TRL's bonus acts on (collective, as in TRL's loss)
        mask = mask * trainer.get_high_entropy_mask(entropies.detach(), mask, 1 - trainer.top_entropy_quantile)
    bonus = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / trainer.current_gradient_accumulation_steps
    scale = 1.0 / micro_batches_held.clamp(min=torch.finfo(micro_batches_held.dtype).tiny) - 1.0
    return -coef * scale * bonus
