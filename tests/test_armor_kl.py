"""ARMOR + KL (β ≠ 0 with ARMOR on): TRL's KL term, of π_θ against ARMOR's π_ref on the on-policy rows."""

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from armor_trl import ArmorConfig, mixed_logprobs
from armor_trl.algorithm.mixture import k3_kl, kl_reference_logps
from testing import cpu_args, has_digit_reward, logged, make_trainer


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
