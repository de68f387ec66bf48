"""The log-prob passes over the batch that trains, once per row: the old policy's where dynamic sampling left TRL's
pass out of its rounds (the rows of dropped groups would never use them), and π_ref's where the loss needs them (the
mixed ratio, off-policy importance sampling, ARMOR + KL)."""

from __future__ import annotations

import torch

from armor_trl.algorithm.loss_rows import KEPT_ROWS, count_on_policy
from armor_trl.integration import trl_generation


def skips_round_logps(trainer) -> bool:
    """Whether TRL's pass for the old policy's log-probs is left out of a training round: under dynamic sampling
    the rows of dropped groups would never use them, so they are computed once for the batch that trains
    (unless TRL reads them within the round: vLLM's importance-sampling correction, or β ≠ 0, whose reference
    pass TRL makes there too)."""
    return (trainer.model.training and trainer.dynamic_sampling is not None and trainer.beta == 0.0
            and not trl_generation.vllm_correction(trainer))


def add_logprobs(trainer, output: dict) -> None:
    """The log-probs of the batch that trains, once per row: the old policy's where a round left them out
    (:func:`skips_round_logps`), π_ref's where the loss needs them (the mixed ratio, off-policy IS, β ≠ 0)."""
    args = trainer.args
    if skips_round_logps(trainer) and trl_generation.old_logps_needed(trainer):
        output["old_per_token_logps"] = trainer._completion_logps(trainer.model, output)
    if not trainer.armor_active:
        return
    if args.beta != 0.0:  # ARMOR + KL's normalisers, over the rows that train
        count_on_policy(trainer, output)
    rollout = trainer.anchor_rollout
    same_call = args.use_anchors and rollout is not None and rollout.same_call_round  # (every round of a batch alike)
    needs_ref_logps = args.use_mixed_ratio or args.off_policy_ratio or args.beta != 0.0  # (β: ARMOR + KL)
    if needs_ref_logps and same_call and "old_per_token_logps" in output:
        # π_ref holds the weights that generated this batch: its log-probs are the old policy's, already computed
        output["armor_ref_logps"] = output["old_per_token_logps"]
    elif needs_ref_logps:
        reference = trainer.reference
        model = reference.model if reference.kind == "full" else trainer.model
        with reference.active(trainer.unwrapped_policy()):
            output["armor_ref_logps"] = trainer._completion_logps(model, output)
    if "armor_ref_logps" in output and KEPT_ROWS in output:
        # a row out of the loss (an empty anchor slot, a dropped group) was scored with its completion masked from
        # attention: its π_ref log-probs mean nothing, so it carries 0, marked by KEPT_ROWS (False) beside it
        kept = output[KEPT_ROWS].to(output["armor_ref_logps"].device).unsqueeze(1)
        output["armor_ref_logps"] = torch.where(kept, output["armor_ref_logps"], 0.0)
    if args.off_policy_ratio:
        if output.get("old_per_token_logps") is None:
            output["old_per_token_logps"] = trainer._completion_logps(trainer.model, output)
        # ordinary off-policy IS on anchor tokens: their "old" policy is π_ref, so TRL's ratio is π_θ/π_ref
        output["old_per_token_logps"] = torch.where(output["armor_is_anchor"].unsqueeze(1), output["armor_ref_logps"],
                                                    output["old_per_token_logps"])
