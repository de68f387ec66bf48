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

ARMOR + KL (β > 0, ARMOR on): β means what it means in TRL without anchors, β × k3 per token of the rows the KL acts
on, under the loss type's own normalisation (per row, then over rows, for ``grpo`` and ``sapo``; per token for the
others; ...). TRL adds its KL term to the policy term's tokens and normalises both alike, over every row or loss token,
but the term acts on the on-policy rows in the loss only (0 on anchors, :func:`~armor_trl.algorithm.mixture.
kl_reference_logps`, and on rows taken out of the loss): :func:`kl_coefficient` scales β by what TRL's normaliser
counts over what it would count of those rows alone (:func:`count_on_policy`, per generation batch), so the term is
the same whatever the gate drops and however many anchor tokens a batch holds.

Like the rest of :mod:`armor_trl.algorithm`, nothing here imports TRL: what only TRL's private state knows (the
micro-batches of the current optimizer step, whether its loss adds an entropy bonus) is read by the caller through
:mod:`armor_trl.integration.trl_seam` and passed in; ``trainer`` is used for its public attributes only.
"""

from __future__ import annotations

import torch

ROW_COUNT_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo")  # TRL divides these by the micro-batch's row count
KEPT_ROWS = "armor_loss_row"  # (rows,) bool: the row is in the loss; travels with its row through TRL's shuffle
KEPT_SHARE = "armor_kept_row_share"  # 0-dim: kept rows / rows of the generation batch, over all processes
# ARMOR + KL's normalisers (count_on_policy): the generation batch's on-policy rows in the loss, over all processes
ON_POLICY_TOKENS = "armor_on_policy_tokens"  # 0-dim: their loss tokens
ON_POLICY_SHARE = "armor_on_policy_row_share"  # 0-dim: their share of the rows


def loss_mask(inputs: dict) -> torch.Tensor:
    """The tokens TRL's loss counts: the completion mask, times the tool mask where there is one."""
    return inputs["completion_mask"] * inputs.get("tool_mask", 1)


def on_policy_rows(inputs: dict) -> torch.Tensor:
    """(rows,) bool: the on-policy rows in the loss (not anchors, not taken out of the loss)."""
    on_policy = ~inputs["armor_is_anchor"].to(inputs["completion_mask"].device)
    return on_policy & inputs[KEPT_ROWS].to(on_policy.device) if KEPT_ROWS in inputs else on_policy


def on_policy_tokens(inputs: dict) -> torch.Tensor:
    """The loss tokens of the on-policy rows in the loss (anchors and rows taken out of the loss: 0)."""
    return loss_mask(inputs) * on_policy_rows(inputs).unsqueeze(1)


def drop_rows(trainer, output: dict, keep: torch.Tensor) -> None:
    """Take the local rows where ``keep`` is False (and those taken out before) out of ``output``'s loss, and set the
    normalisers over the kept rows (collective: every process calls it)."""
    completion_mask = output["completion_mask"]
    keep = keep.to(completion_mask.device) & output.get(KEPT_ROWS, torch.ones_like(keep)).to(completion_mask.device)
    output[KEPT_ROWS] = keep
    output["advantages"] = output["advantages"] * keep.to(output["advantages"].device)
    output["completion_mask"] = completion_mask * keep.unsqueeze(1).to(completion_mask.dtype)
    output["num_items_in_batch"] = trainer.accelerator.gather(loss_mask(output).sum()).sum()
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
    return share_holding(trainer, step_micro_batches, lambda batch: batch[KEPT_ROWS].any())


def share_holding(trainer, step_micro_batches: list[dict], holds) -> torch.Tensor:
    """The share of the step's micro-batches, over all processes, for which ``holds(micro-batch)`` (collective)."""
    held = sum(bool(holds(batch)) for batch in step_micro_batches)
    device = step_micro_batches[0]["advantages"].device
    counts = torch.tensor([float(held), float(len(step_micro_batches))], device=device)
    held, micro_batches = trainer.accelerator.reduce(counts, reduction="sum")
    return held / micro_batches


def count_on_policy(trainer, output: dict) -> None:
    """ARMOR + KL's normalisers for a generation batch (collective: every process calls it): its on-policy rows in the
    loss, their loss tokens (``ON_POLICY_TOKENS``) and their share of the rows (``ON_POLICY_SHARE``), all processes."""
    rows = on_policy_rows(output)
    counts = torch.stack([on_policy_tokens(output).sum(), rows.sum(), torch.tensor(len(rows), device=rows.device)])
    tokens, rows, all_rows = trainer.accelerator.reduce(counts.float(), reduction="sum")
    output[ON_POLICY_TOKENS], output[ON_POLICY_SHARE] = tokens, rows / all_rows


def kl_coefficient(loss_type: str, inputs: dict, beta: float, on_policy_micro_batches=None) -> float:
    """β for TRL's KL term in the loss of the micro-batch ``inputs``, so that ARMOR + KL's term is ``beta`` × k3 per
    on-policy token under ``loss_type``'s normalisation (the module's docstring): ``beta`` over the share of what TRL's
    normaliser counts that the on-policy rows in the loss hold. Row-count losses: their share of the generation
    batch's rows; ``bnpo``: of the micro-batch's loss tokens, times the share of the step's micro-batches holding such
    a token (``on_policy_micro_batches``, as for the policy term); the others: of the generation batch's loss tokens
    (``num_items_in_batch``). ``beta`` unchanged where :func:`count_on_policy` did not count, or nothing is on-policy
    (the term is 0)."""
    if not beta or ON_POLICY_SHARE not in inputs:
        return beta
    if loss_type in ROW_COUNT_LOSSES:
        share = inputs[ON_POLICY_SHARE]
    elif loss_type == "bnpo":
        share = on_policy_tokens(inputs).sum() / loss_mask(inputs).sum().clamp(min=1.0) * on_policy_micro_batches
    else:
        share = inputs[ON_POLICY_TOKENS] / inputs["num_items_in_batch"].clamp(min=1.0)
    share = float(share)
    return beta / share if share > 0 else beta


def kl_beta(trainer, inputs: dict, step_micro_batches: list[dict]) -> float:
    """The trainer's β for TRL's KL term in the loss of ``inputs`` (:func:`kl_coefficient`; collective under bnpo)."""
    beta, loss_type = trainer.args.beta, trainer.loss_type
    held = None
    if beta and loss_type == "bnpo" and ON_POLICY_SHARE in inputs:
        held = share_holding(trainer, step_micro_batches, lambda batch: on_policy_tokens(batch).any())
    return kl_coefficient(loss_type, inputs, beta, held)


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
    mask = loss_mask(inputs)
    if trainer.top_entropy_quantile < 1.0:  # the tokens TRL's bonus acts on (collective, as in TRL's loss)
        mask = mask * trainer.get_high_entropy_mask(entropies.detach(), mask, 1 - trainer.top_entropy_quantile)
    bonus = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / trainer.current_gradient_accumulation_steps
    scale = 1.0 / micro_batches_held.clamp(min=torch.finfo(micro_batches_held.dtype).tiny) - 1.0
    return -coef * scale * bonus
