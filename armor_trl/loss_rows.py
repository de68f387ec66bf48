"""Rows taken out of a generation batch's loss, and the loss's normalisers over the rows that stay in.

Empty anchor slots and the groups the gate drops (:meth:`~armor_trl.anchor_rollout.AnchorRollout.mask_groups`), and
the filler groups of a batch that dynamic sampling could not complete (:class:`~armor_trl.dynamic_sampling.
DynamicSampling`), stay in the batch so that its shape stays TRL's, with advantage 0 and completion mask 0: they add
nothing to the loss. What TRL's loss divides by must then count the kept rows only. By ``loss_type``:

* ``dapo``, ``cispo``, ``vespo``: the generation batch's token count ``num_items_in_batch``, recomputed here;
* ``bnpo``: the micro-batch's token count, which masked rows already leave out;
* ``grpo``, ``sapo``, ``luspo``: the micro-batch's row count, and ``dr_grpo``: rows × ``max_completion_length``; both
  count masked rows, so a batch with half its rows dropped would take half a step. :func:`over_kept_rows` divides
  the advantages in the loss by the kept rows' share of the generation batch (all processes): each of these losses is
  positively homogeneous in the advantages (the clipped surrogate, SAPO's sign-chosen gate, the plain weights), so
  the loss becomes the same mean over the kept rows, and is unchanged when every row is kept.

TRL's own masking (e.g. ``mask_truncated_completions``) keeps TRL's definitions. With β ≠ 0 (ARMOR off) the KL term
of a row-count loss keeps TRL's normaliser.
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


def over_kept_rows(loss_type: str, inputs: dict) -> dict:
    """``inputs`` for TRL's loss, with the advantages divided by the kept rows' share where ``loss_type`` divides by
    a row count (see the module's docstring); unchanged otherwise."""
    share = inputs.get(KEPT_SHARE)
    if share is None or loss_type not in ROW_COUNT_LOSSES:
        return inputs
    # share 0: every row dropped, every advantage 0, and 0 it stays
    return {**inputs, "advantages": inputs["advantages"] / share.clamp(min=torch.finfo(share.dtype).tiny)}
