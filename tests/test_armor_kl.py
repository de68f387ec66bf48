"""ARMOR + KL (β ≠ 0 with ARMOR on): TRL's KL term, of π_θ against ARMOR's π_ref on the on-policy rows."""

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from armor_trl import ArmorConfig, mixed_logprobs
from armor_trl.algorithm.loss_rows import KEPT_ROWS
from armor_trl.algorithm.mixture import k3_kl, kl_reference_logps
from testing import (cpu_args, has_digit_reward, logged, loss_and_gradient, make_trainer, moved, numbers_dataset,
                     scripted)


def test_trls_kl_of_the_mixture_against_the_shifted_reference_is_the_kl_of_the_policy():
    """TRL computes k3(loss log-probs, reference input); with the mixture as the loss's log-probs and
    kl_reference_logps as the input, that is k3(π_θ, π_ref) on on-policy rows, in value and gradient, and 0 on anchors."""
    torch.manual_seed(0)
    logp = (torch.rand(4, 6) * -3).requires_grad_()
    ref = torch.rand(4, 6) * -3
    on_policy = torch.tensor([True, True, True, False])
    loss_logp = mixed_logprobs(logp, ref, 0.75)
    trl_kl = k3_kl(loss_logp, kl_reference_logps(ref, logp, loss_logp, on_policy))
    want = k3_kl(logp, ref)
    torch.testing.assert_close(trl_kl[:3], want[:3], rtol=0, atol=1e-6)
    assert torch.equal(trl_kl[3], torch.zeros(6))
    (grad,) = torch.autograd.grad(trl_kl.sum(), logp)
    logp_again = logp.detach().clone().requires_grad_()
    (want_grad,) = torch.autograd.grad(k3_kl(logp_again, ref)[:3].sum(), logp_again)
    torch.testing.assert_close(grad[:3], want_grad[:3], rtol=0, atol=1e-6)
    assert torch.equal(grad[3], torch.zeros(6))  # anchors: no KL gradient


@pytest.mark.parametrize("loss_type, bias_correction", [("dapo", True), ("dapo", False), ("grpo", True),
                                                        ("bnpo", True), ("dr_grpo", False)])
def test_alpha_one_without_anchors_and_beta_matches_grpo_trainer_with_that_beta(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, loss_type, bias_correction):
    common = cpu_args(max_steps=2, num_iterations=2, epsilon_high=0.28, beta=0.1, loss_type=loss_type,
                      use_bias_correction_kl=bias_correction)
    grpo = GRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward,
                       args=GRPOConfig(output_dir=str(tmp_path / "g"), **common), train_dataset=prompt_dataset,
                       processing_class=tiny_tokenizer)
    grpo.train()
    armor = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "a", use_anchors=False,
                         armor_alpha=1.0, max_steps=2, num_iterations=2, beta=0.1, loss_type=loss_type,
                         use_bias_correction_kl=bias_correction)
    assert armor.ref_model is None and armor.beta == 0.0  # TRL built no reference of its own, β only in the loss
    armor.train()
    for (name, p), q in zip(grpo.model.named_parameters(), armor.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    assert logged(armor, "kl") and logged(armor, "kl") == pytest.approx(logged(grpo, "kl"), abs=1e-6)


def test_armor_with_kl_trains_differently_from_armor_alone_and_logs_the_kl(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    runs = {}
    for beta in (0.0, 0.5):
        trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / str(beta), max_steps=3,
                               num_iterations=2, beta=beta)
        trainer.train()
        runs[beta] = trainer
    assert not logged(runs[0.0], "kl") and len(logged(runs[0.5], "kl")) == 3
    assert logged(runs[0.5], "kl")[0] == 0.0  # π_θ = π_ref before the first update
    assert any(not torch.equal(p, q) for p, q in zip(runs[0.0].model.parameters(), runs[0.5].model.parameters()))
    assert runs[0.5].ref_model is None and runs[0.5].args.beta == 0.5


@pytest.mark.parametrize("overrides, field", [
    (dict(sync_ref_model=True), "sync_ref_model"),
    (dict(collapse_guard="armor"), "collapse_guard"),
])
def test_what_cannot_go_with_armor_and_kl_is_refused_naming_it(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        ArmorConfig(output_dir=str(tmp_path), **cpu_args(beta=0.1, **overrides))


def test_a_negative_beta_is_refused(tmp_path):
    with pytest.raises(ValueError, match="beta must be >= 0.0"):
        ArmorConfig(output_dir=str(tmp_path), **cpu_args(beta=-0.1))


# --- what β means with ARMOR on: per on-policy token, under each loss type's own normalisation ----------------------
KL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo", "cispo", "vespo")
ALPHA, BETA = 0.6, 0.3


def round_with_a_dropped_group_and_an_anchor(trainer):
    """8 rows: the gate drops n = 1's group (its reference candidates are all wrong), n = 2's group trains with 3
    on-policy rows and its anchor; π_ref ≠ π_old ≠ π_θ; old, reference log-probs and advantages in float64."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # one micro-batch: the whole generation batch
    moved(trainer, 0.05, seed=1)
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    kept, anchor = batch[KEPT_ROWS], batch["armor_is_anchor"]
    assert len(kept) == 8 and kept.sum() == 4 and anchor[kept].sum() == 1 and not anchor[~kept].any()
    batch["advantages"] = torch.where(kept, torch.linspace(-1.1, 2.0, len(kept)), batch["advantages"])
    for name in ("old_per_token_logps", "armor_ref_logps", "advantages"):
        batch[name] = batch[name].double()
    moved(trainer, 0.1, seed=2)
    return batch


def kl_by_definition(logp, batch, loss_type, max_completion_length, bias_correction):
    """β × k3(π_θ, π_ref), weighted by the mixed ratio with TRL's bias correction, over the on-policy tokens that
    train, normalised as ``loss_type`` normalises its tokens (per row then over rows, per token, ...); in float64."""
    ref, old, mask = batch["armor_ref_logps"], batch["old_per_token_logps"], batch["completion_mask"].double()
    on_policy = (batch[KEPT_ROWS] & ~batch["armor_is_anchor"]).double().unsqueeze(1)
    mask = mask * on_policy
    logp = logp.clone().requires_grad_(True)

    def mix(x):
        return torch.log(ALPHA * torch.exp(x) + (1 - ALPHA) * torch.exp(ref))

    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    if bias_correction:
        k3 = k3 * torch.exp(mix(logp) - mix(old))
    rows, tokens = on_policy.sum(), mask.sum()
    if loss_type in ("grpo", "sapo"):
        value = ((k3 * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / rows
    elif loss_type == "luspo":
        value = (k3 * mask).sum() / rows
    elif loss_type == "dr_grpo":
        value = (k3 * mask).sum() / (rows * max_completion_length)
    else:  # bnpo (one micro-batch), dapo, cispo, vespo: per token
        value = (k3 * mask).sum() / tokens
    value = BETA * value
    (gradient,) = torch.autograd.grad(value, logp)
    return value.detach(), gradient


@pytest.mark.parametrize("loss_type, bias_correction", [(loss, True) for loss in KL_LOSS_TYPES] + [("dapo", False)])
def test_beta_acts_per_on_policy_token_whatever_the_gate_drops_under_every_loss_type(
        loss_type, bias_correction, tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    """With the gate dropping 4 of 8 rows and an anchor in the batch, the KL term's part of the loss (the loss with β
    less the loss with β = 0, in value and in gradient) is β × the mean k3 per on-policy token under the loss type's
    own normalisation: dropped rows and anchor tokens (where the term is 0) leave its normaliser, as rows do from the
    policy term."""
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset([1, 2]), tmp_path, reward_funcs=scripted,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=6, anchor_filter="drop",
        armor_alpha=ALPHA, num_iterations=2, loss_type=loss_type, beta=BETA, use_bias_correction_kl=bias_correction,
    )
    batch = round_with_a_dropped_group_and_an_anchor(trainer)
    monkeypatch.setattr(trainer.args, "beta", BETA)
    with_kl, gradient_with_kl, logp = loss_and_gradient(trainer, batch, monkeypatch)
    monkeypatch.setattr(trainer.args, "beta", 0.0)
    without, gradient_without, logp_again = loss_and_gradient(trainer, batch, monkeypatch)
    assert torch.equal(logp, logp_again)
    expected, expected_gradient = kl_by_definition(logp, batch, loss_type, trainer.max_completion_length,
                                                   bias_correction)
    assert expected > 1e-4  # the check has power
    torch.testing.assert_close(with_kl - without, expected, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(gradient_with_kl - gradient_without, expected_gradient, rtol=1e-7, atol=1e-12)
