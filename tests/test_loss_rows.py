"""Rows taken out of the loss (armor_trl/algorithm/loss_rows.py): for every loss_type TRL 1.16's GRPOTrainer accepts, a row the
gate (AnchorRollout.mask_groups) or dynamic sampling's filler takes out contributes nothing, and the loss divides by
what that loss type divides by, over the kept rows: checked against a hand computation of the loss."""

import pytest
import torch

from testing import make_trainer, numbers_dataset, scripted

TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# prompts n = 0..3 and the `scripted` reward: n % 3 == 0 always right, n % 3 == 1 always wrong, n % 3 == 2 alternating
NUMBERS = range(4)
CASES = [("gate", t) for t in TRL_LOSS_TYPES] + [("dynamic_sampling", t) for t in TRL_LOSS_TYPES]


def token_losses(trainer, loss_type, output):
    """Each token's loss at the round's own weights (ratio 1: no optimizer step since the rollout), by hand."""
    advantages = output["advantages"].unsqueeze(1)
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):  # -min(r·A, clip(r)·A) at r = 1
        return -advantages.expand_as(output["completion_mask"]).double()
    if loss_type == "sapo":  # -(4/τ)·σ(τ·(r − 1))·A at r = 1, τ chosen by the advantage's sign
        tau = torch.where(advantages > 0, trainer.args.sapo_temperature_pos, trainer.args.sapo_temperature_neg)
        return (-(2.0 / tau) * advantages).expand_as(output["completion_mask"]).double()
    logps = trainer._completion_logps(trainer.model, output).double()
    if loss_type == "cispo":  # -min(r, ε_high)·A·log π
        return -min(1.0, trainer.epsilon_high) * advantages * logps
    return -advantages * logps  # vespo: -φ(w)·A·log π, φ(1) = 1


def hand_loss(trainer, loss_type, output, kept):
    token_loss, mask = token_losses(trainer, loss_type, output)[kept], output["completion_mask"][kept].double()
    per_row = (token_loss * mask).sum(1)
    if loss_type in ("grpo", "sapo"):
        return (per_row / mask.sum(1).clamp(min=1)).mean()
    if loss_type == "luspo":
        return per_row.mean()
    if loss_type == "dr_grpo":
        return per_row.sum() / (len(per_row) * trainer.max_completion_length)
    return per_row.sum() / mask.sum()  # bnpo (one micro-batch), dapo, cispo, vespo


@pytest.mark.parametrize("path,loss_type", CASES, ids=[f"{p}-{t}" for p, t in CASES])
def test_rows_out_of_the_loss_leave_its_normaliser(path, loss_type, tiny_model_path, tiny_tokenizer, tmp_path):
    settings = dict(per_device_train_batch_size=16, num_generations=4, loss_type=loss_type, max_completion_length=6)
    if path == "gate":  # the group of n = 1 has no correct reference candidate: the gate drops it
        settings.update(use_mixed_ratio=False, anchor_filter="drop", anchor_num_samples=4)
    else:  # only n = 2's group has on-policy rewards that differ; one round, so the other three are masked fillers
        settings.update(use_anchors=False, use_mixed_ratio=False, dynamic_sampling=True, dynamic_sampling_max_rounds=1)
        if loss_type == "luspo":
            settings["importance_sampling_level"] = "sequence"
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(NUMBERS), tmp_path, reward_funcs=scripted,
                           **settings)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # one micro-batch: the whole generation batch
    inputs = next(iter(trainer.get_train_dataloader()))
    output = trainer._generate_and_score_completions(inputs)
    prompt_of_row = [int(row["prompt"].split("+")[0]) for row in inputs]
    if path == "gate":
        expected_kept = torch.tensor([n % 3 != 1 for n in prompt_of_row])
    else:  # the kept group first, then the fillers
        expected_kept = torch.arange(16) < 4
    kept = output["completion_mask"].bool().any(1)
    assert torch.equal(kept, expected_kept)  # what was taken out (no kept row happens to be all masked here)
    assert 0 < int(kept.sum()) < 16 and (output["advantages"][~kept] == 0).all()
    # Group advantages sum to about 0, and so would the loss at ratio 1: give the kept rows advantages that do not
    # (the normaliser is what is checked; the dropped rows keep what the code under test gave them)
    output["advantages"] = torch.where(kept, torch.linspace(-1.1, 2.0, 16), output["advantages"])
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, output)
    expected = hand_loss(trainer, loss_type, output, kept)
    assert expected.abs() > 1e-3  # the check has power
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)


def two_micro_batches(trainer, loss_type, **settings):
    """The generation batch of the dynamic-sampling case (16 rows, the 4 kept ones first), in TRL's buffer as two
    micro-batches of one optimizer step: every kept row in the first, none in the second."""
    from trl.trainer.utils import split_tensor_dict

    trainer.model.train()
    inputs = next(iter(trainer.get_train_dataloader()))
    output = trainer._generate_and_score_completions(inputs)
    kept = output["completion_mask"].bool().any(1)
    assert torch.equal(kept, torch.arange(16) < 4)
    output["advantages"] = torch.where(kept, torch.linspace(-1.1, 2.0, 16), output["advantages"])
    trainer._buffered_inputs = split_tensor_dict(output, 2)
    trainer.current_gradient_accumulation_steps = 2
    return output, kept


def step_loss(trainer):
    """The optimizer step's loss: TRL's losses of its two micro-batches (each already divided by the 2 steps), summed."""
    total = 0.0
    for step in range(2):
        trainer._step = step
        with torch.no_grad():
            total += trainer._compute_loss(trainer.model, trainer._buffered_inputs[step]).item()
    return total


DROPPED = dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4, max_completion_length=6,
               use_anchors=False, use_mixed_ratio=False, dynamic_sampling=True, dynamic_sampling_max_rounds=1)


@pytest.mark.parametrize("loss_type", ["bnpo", "grpo", "dr_grpo", "dapo"])
def test_a_micro_batch_whose_rows_were_all_taken_out_does_not_halve_the_step(loss_type, tiny_model_path,
                                                                             tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(NUMBERS), tmp_path, reward_funcs=scripted,
                           loss_type=loss_type, **DROPPED)
    output, kept = two_micro_batches(trainer, loss_type)
    expected = hand_loss(trainer, loss_type, output, kept)  # the step's loss over the kept rows (bnpo: one batch)
    assert expected.abs() > 1e-3
    assert step_loss(trainer) == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)


def test_the_entropy_bonus_of_a_step_counts_the_micro_batches_that_hold_kept_rows(tiny_model_path, tiny_tokenizer,
                                                                                  tmp_path):
    coef = 0.5
    losses = {}
    for c in (0.0, coef):
        trainer = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(NUMBERS), tmp_path / str(c),
                               reward_funcs=scripted, loss_type="dapo", entropy_coef=c, **DROPPED)
        output, kept = two_micro_batches(trainer, "dapo")
        losses[c] = step_loss(trainer)
    # the bonus is the mean entropy over the kept tokens (all in the first micro-batch), as in a step without drops
    _, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, torch.cat([output["prompt_ids"], output["completion_ids"]], 1),
        torch.cat([output["prompt_mask"], output["completion_mask"]], 1), output["completion_ids"].size(1),
        compute_entropy=True)
    mask = output["completion_mask"][kept].double()
    mean_entropy = (entropies[kept].detach().double() * mask).sum() / mask.sum()
    assert losses[coef] - losses[0.0] == pytest.approx(-coef * mean_entropy.item(), rel=1e-4)
