"""The mixed ratio r_mix under every loss type of TRL 1.16 and both importance-sampling levels (docs/algorithm.md, "The
mixed ratio in each of TRL's losses").

ARMOR hands TRL's own loss mixture log-probs (armor_trl/algorithm/mixture.py); these tests check what TRL's loss then computes,
loss and gradient, against a float64 hand computation written from the definitions, in the multi-update regime
(num_iterations = 2, the policy moved away from π_old so that the clip binds), with anchors and a group the gate
drops. At α = 1 its loss and gradient are GRPOTrainer's on the same round (anchors included), and without anchors
it trains exactly as GRPOTrainer does with that loss. With ARMOR at its defaults it trains with each of them (what
TRL's own test_train_loss_types / test_train_sequence_importance_sampling check for GRPOTrainer, here on the local
tiny model: TRL's test file needs the hub's models and datasets).
"""

import math

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from armor_trl import ArmorConfig, ArmorGRPOTrainer
from armor_trl.config import SUPPORTED_LOSS_TYPES
from armor_trl.algorithm.loss_rows import KEPT_ROWS
from testing import (cpu_args, has_digit_reward, logged, loss_and_gradient, make_trainer, moved, numbers_dataset,
                     scripted, trainable_state)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LEVELS = ("token", "sequence")
CASES = [(loss, level) for loss in LOSS_TYPES for level in LEVELS]
IDS = [f"{loss}-{level}" for loss, level in CASES]
ALPHA = 0.6
CISPO_EPS_MAX = 1.05  # CISPO's cap ε_max on the IS weight (TRL's epsilon_high): binding for some tokens here


def test_every_trl_loss_type_is_supported():
    assert set(SUPPORTED_LOSS_TYPES) == set(LOSS_TYPES)
    for loss, level in CASES:
        assert ArmorConfig(output_dir="unused", loss_type=loss, importance_sampling_level=level).armor_enabled


# --- the hand computation --------------------------------------------------------------------------------------------
def hand_loss_and_gradient(logp, batch, args, loss_type, level, max_completion_length):
    """TRL's loss for ``loss_type`` on the mixed ratio, and its gradient with respect to the policy's per-token
    log-probs ``logp``, in float64 from the definitions (probabilities, not logaddexp; derivatives by hand)."""
    logp, old, ref = logp.double(), batch["old_per_token_logps"].double(), batch["armor_ref_logps"].double()
    mask, kept = batch["completion_mask"].double(), batch[KEPT_ROWS]
    adv = batch["advantages"].double().unsqueeze(1)  # as the round left them: 0 on dropped rows

    def mix(x):
        return torch.log(ALPHA * torch.exp(x) + (1 - ALPHA) * torch.exp(ref))

    log_ratio = mix(logp) - mix(old)  # log r_mix per token
    share = ALPHA * torch.exp(logp) / torch.exp(mix(logp))  # w = ∂ log π_mix / ∂ log π_θ
    lengths = mask.sum(1, keepdim=True)
    if level == "token":
        ratio, ratio_of = torch.exp(log_ratio), None
    else:  # GSPO: exp of the length-normalised log-ratio, one per row
        ratio = torch.exp((log_ratio * mask).sum(1, keepdim=True) / lengths.clamp(min=1)).expand_as(mask)
        ratio_of = mask / lengths.clamp(min=1)  # ∂ (row's mean log-ratio) / ∂ log r_mix(t)

    # each token's loss L and ∂L/∂(log-ratio the loss sees) or, for the stop-gradient weights, ∂L/∂ log π_mix
    eps_low, eps_high = args.epsilon, args.epsilon_high
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):  # -min(r·A, clip(r)·A)
        clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
        unclipped_is_min = ratio * adv <= clipped * adv
        token_loss = -torch.where(unclipped_is_min, ratio * adv, clipped * adv)
        d_log_ratio, d_mix = torch.where(unclipped_is_min, -ratio * adv, 0.0), None
    elif loss_type == "sapo":  # -(4/τ)·σ(τ(r − 1))·A, τ by the advantage's sign
        tau = torch.where(adv > 0, args.sapo_temperature_pos, args.sapo_temperature_neg).double()
        gate = torch.sigmoid(tau * (ratio - 1))
        token_loss = -(4 / tau) * gate * adv
        d_log_ratio, d_mix = -4 * gate * (1 - gate) * ratio * adv, None
    elif loss_type == "cispo":  # -sg(min(r, ε_max))·A·log π_mix
        weight = ratio.clamp(max=eps_high)
        token_loss = -weight * adv * mix(logp)
        d_log_ratio, d_mix = None, -weight * adv
    else:  # vespo: -sg(φ(W))·A·log π_mix, W = exp(Σ_t log r_mix), φ(W) = e^λ·W^k·e^(−λW), (k, λ) by sign(A)
        seq_log_ratio = (log_ratio * mask).sum(1, keepdim=True)
        assert seq_log_ratio.abs().max() < math.log(1e8)  # TRL clamps log W to [log 1e-8, 20]: not reached here
        k = torch.where(adv >= 0, args.vespo_k_pos, args.vespo_k_neg).double()
        lam = torch.where(adv >= 0, args.vespo_lambda_pos, args.vespo_lambda_neg).double()
        w_seq = torch.exp(seq_log_ratio)
        phi = torch.exp(lam) * w_seq**k * torch.exp(-lam * w_seq)
        token_loss = -phi * adv * mix(logp)
        d_log_ratio, d_mix = None, -phi * adv

    # each token's weight c in the loss, over the rows the gate kept
    rows = kept.sum().double()
    if loss_type in ("grpo", "sapo"):
        weight = mask / lengths.clamp(min=1) / rows
    elif loss_type == "luspo":
        weight = mask / rows
    elif loss_type == "dr_grpo":
        weight = mask / (rows * max_completion_length)
    else:  # bnpo (one micro-batch), dapo, cispo, vespo: the kept tokens
        weight = mask / mask.sum()
    loss = (weight * token_loss).sum()
    if d_mix is not None:
        gradient = weight * d_mix * share
    elif level == "token":
        gradient = weight * d_log_ratio * share
    else:  # a row's ratio moves with each of its tokens' log-ratios by 1/length
        gradient = (weight * d_log_ratio).sum(1, keepdim=True) * ratio_of * share
    return loss, gradient, ratio


def round_in_the_multi_update_regime(trainer):
    """A generation round of the numbers prompts 0..3 (anchors; the gate drops n = 1's group, whose reference candidates
    are all wrong) by a policy that has moved away from π_ref, the policy then moved away from π_old; in float64."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # one micro-batch: the whole generation batch
    moved(trainer, 0.05, seed=1)  # trained since π_ref was taken: π_old ≠ π_ref
    inputs = next(iter(trainer.get_train_dataloader()))
    batch = trainer._generate_and_score_completions(inputs)
    kept = batch[KEPT_ROWS]
    prompt_of_row = torch.tensor([int(row["prompt"].split("+")[0]) for row in inputs])
    assert torch.equal(kept, prompt_of_row % 3 != 1)  # the gate dropped n = 1's group, and only it
    assert (batch["completion_mask"][~kept] == 0).all() and (batch["advantages"][~kept] == 0).all()
    assert batch["armor_is_anchor"][kept].sum() == 3  # one anchor in each kept group
    assert "old_per_token_logps" in batch  # M > 1: TRL keeps π_old's log-probs
    # advantages of both signs on the kept rows that do not sum to 0 (the dropped rows keep what the round gave them)
    batch["advantages"] = torch.where(kept, torch.linspace(-1.1, 2.0, len(kept)), batch["advantages"])
    for name in ("old_per_token_logps", "armor_ref_logps", "advantages"):
        batch[name] = batch[name].double()
    moved(trainer, 0.1, seed=2)  # optimizer steps since the rollout: π_θ ≠ π_old
    return batch


@pytest.mark.parametrize("loss_type,level", CASES, ids=IDS)
def test_loss_and_gradient_are_the_hand_computed_ones(loss_type, level, tiny_model_path, tiny_tokenizer, tmp_path,
                                                      monkeypatch):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset(range(4)), tmp_path, reward_funcs=scripted,
        per_device_train_batch_size=16, num_generations=4, max_completion_length=6, anchor_filter="drop",
        anchor_num_samples=4, armor_alpha=ALPHA, num_iterations=2, loss_type=loss_type, importance_sampling_level=level,
        epsilon_high=CISPO_EPS_MAX if loss_type == "cispo" else 0.28,
    )
    batch = round_in_the_multi_update_regime(trainer)
    loss, gradient, logp = loss_and_gradient(trainer, batch, monkeypatch)

    expected_loss, expected_gradient, ratio = hand_loss_and_gradient(logp, batch, trainer.args, loss_type, level,
                                                                     trainer.max_completion_length)
    assert loss.dtype == torch.float64 and expected_loss.abs() > 1e-3  # float64 throughout; the check has power
    torch.testing.assert_close(loss, expected_loss, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(gradient, expected_gradient, rtol=1e-7, atol=1e-10)
    # the regime: the ratio far from 1; the clip (where the loss has one) binds on some tokens and not on others
    mask, adv = batch["completion_mask"].bool(), batch["advantages"].unsqueeze(1)
    assert (ratio[mask] - 1).abs().max() > 0.2  # beyond ε_low: room for the clip to bind (checked next)
    if loss_type == "cispo":
        binds = ratio > CISPO_EPS_MAX
    elif loss_type not in ("sapo", "vespo"):
        binds = ((ratio < 1 - 0.2) & (adv < 0)) | ((ratio > 1.28) & (adv > 0))
    else:
        binds = None
    if binds is not None:
        assert (binds & mask).any() and (~binds & mask).any()
    # rows the gate dropped get no gradient, anchors and on-policy rows do
    kept, anchor = batch[KEPT_ROWS], batch["armor_is_anchor"]
    assert (gradient[~kept] == 0).all()
    assert gradient[kept & anchor].abs().sum() > 0 and gradient[kept & ~anchor].abs().sum() > 0


@pytest.mark.parametrize("loss_type,level", CASES, ids=IDS)
def test_at_alpha_one_the_loss_and_gradient_are_trls_own(loss_type, level, tiny_model_path, tiny_tokenizer, tmp_path,
                                                         monkeypatch):
    # the same round and weights: ArmorGRPOTrainer's loss at α = 1 against GRPOTrainer._compute_loss itself. Every
    # prompt finds an anchor (n % 3 != 1), so no row leaves the loss (ARMOR's normaliser over kept rows is TRL's)
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset([0, 2, 3, 5]), tmp_path, reward_funcs=scripted,
        per_device_train_batch_size=16, num_generations=4, max_completion_length=6, anchor_filter="drop",
        anchor_num_samples=4, armor_alpha=1.0, num_iterations=2, loss_type=loss_type, importance_sampling_level=level,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    assert batch["armor_is_anchor"].sum() == 4 and batch[KEPT_ROWS].all() and "old_per_token_logps" in batch
    batch["advantages"] = torch.linspace(-1.1, 2.0, len(batch["advantages"]))
    moved(trainer, 0.05, seed=2)
    armor = loss_and_gradient(trainer, batch, monkeypatch)
    trl = loss_and_gradient(trainer, batch, monkeypatch, lambda model, inputs: GRPOTrainer._compute_loss(
        trainer, model, inputs))
    assert all(torch.equal(a, b) for a, b in zip(armor, trl))
    assert armor[1].abs().sum() > 0


@pytest.mark.parametrize("loss_type,level", CASES, ids=IDS)
def test_at_alpha_one_training_is_grpo_trainers_with_that_loss(loss_type, level, tiny_model_path, tiny_tokenizer,
                                                               prompt_dataset, tmp_path):
    common = cpu_args(max_steps=2, num_iterations=2, epsilon_high=0.28, loss_type=loss_type,
                      importance_sampling_level=level, learning_rate=0.1)
    grpo = GRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward,
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo"), **common), train_dataset=prompt_dataset,
                       processing_class=tiny_tokenizer)
    grpo.train()
    armor = ArmorGRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward,
                             args=ArmorConfig(output_dir=str(tmp_path / "armor"), use_anchors=False, armor_alpha=1.0,
                                              **common),
                             train_dataset=prompt_dataset, processing_class=tiny_tokenizer)
    armor.train()
    assert armor.reference is not None and armor.args.use_mixed_ratio  # the mixture is on, with α = 1
    for (name, param), other in zip(grpo.model.named_parameters(), armor.model.parameters()):
        assert torch.equal(param, other), name
    assert logged(grpo, "loss") == logged(armor, "loss")


@pytest.mark.parametrize("loss_type,level", CASES, ids=IDS)
def test_armor_at_its_defaults_trains_with_every_loss_type_and_level(loss_type, level, tiny_model_path, tiny_tokenizer,
                                                                     prompt_dataset, tmp_path):
    # TRL's test_train_loss_types / test_train_sequence_importance_sampling, with ArmorGRPOTrainer and ARMOR's defaults
    # (anchors, the mixed ratio); several optimizer steps per rollout batch (gradient accumulation, num_iterations)
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, loss_type=loss_type,
                           importance_sampling_level=level, learning_rate=0.1, per_device_train_batch_size=4,
                           gradient_accumulation_steps=2, num_iterations=2, max_steps=2, anchor_filter="keep")
    before = trainable_state(trainer)
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    after = trainable_state(trainer)
    assert all(not torch.equal(before[name], after[name]) for name in before)
    assert logged(trainer, "armor/anchor_found_frac") and logged(trainer, "armor/ratio_policy_mean")
