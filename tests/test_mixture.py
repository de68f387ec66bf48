"""The math of Mixed Optimization against the formulas of ARMOR.md, and the KL estimators used in validation."""

import itertools
import math

import pytest
import torch

from armor_trl import mixed_logprobs, mixed_ratio, trust_region_bounds
from armor_trl.algorithm.mixture import default_alpha, k3_kl, kl_estimate, sequence_log_ratios


def direct_mixture(logp, ref_logp, alpha):
    return torch.log(alpha * torch.exp(logp.double()) + (1 - alpha) * torch.exp(ref_logp.double()))


@pytest.mark.parametrize("alpha", [0.05, 0.5, 0.875, 0.9375, 0.999])
def test_mixed_logprobs_matches_direct_formula(alpha):
    torch.manual_seed(0)
    logp = -torch.rand(64) * 10
    ref_logp = -torch.rand(64) * 10
    expected = direct_mixture(logp, ref_logp, alpha)
    torch.testing.assert_close(mixed_logprobs(logp, ref_logp, alpha).double(), expected, rtol=1e-6, atol=1e-6)


def test_mixed_logprobs_is_finite_for_very_negative_inputs():
    logp = torch.tensor([-1e4, -500.0, -1e4])
    ref_logp = torch.tensor([-1e4, -1e4, -700.0])
    out = mixed_logprobs(logp, ref_logp, 0.9)
    assert torch.isfinite(out).all()
    # log(α e^a + (1−α) e^b) with a ≫ b is a + log α
    assert out[1].item() == pytest.approx(-500.0 + math.log(0.9), abs=1e-4)


def test_mixed_logprobs_with_minus_infinity():
    inf = float("inf")
    logp = torch.tensor([-inf, -2.0, -inf])
    ref_logp = torch.tensor([-3.0, -inf, -inf])
    out = mixed_logprobs(logp, ref_logp, 0.75)
    assert out[0].item() == pytest.approx(-3.0 + math.log(0.25))
    assert out[1].item() == pytest.approx(-2.0 + math.log(0.75))
    assert out[2].item() == -inf


def test_gradient_flows_through_policy_term_only_and_is_finite():
    logp = torch.tensor([-1.0, -5.0, -50.0], requires_grad=True)
    ref_logp = torch.tensor([-1.0, -0.1, -2.0])
    alpha = 0.8
    mixed_logprobs(logp, ref_logp, alpha).sum().backward()
    # d/dlogp log(α p + (1−α) q) = α p / (α p + (1−α) q)
    p, q = logp.detach().exp(), ref_logp.exp()
    torch.testing.assert_close(logp.grad, alpha * p / (alpha * p + (1 - alpha) * q))
    assert torch.isfinite(logp.grad).all()


def test_alpha_one_gives_back_the_ordinary_ratio_exactly():
    torch.manual_seed(1)
    logp, old, ref = -torch.rand(32) * 5, -torch.rand(32) * 5, -torch.rand(32) * 5
    assert torch.equal(mixed_logprobs(logp, ref, 1.0), logp)
    assert torch.equal(mixed_ratio(logp, old, ref, 1.0), torch.exp(logp - old))


def test_mixed_ratio_is_ratio_of_mixtures():
    p, p_old, q, alpha = torch.tensor([0.3]), torch.tensor([0.2]), torch.tensor([0.6]), 0.7
    expected = (alpha * p + (1 - alpha) * q) / (alpha * p_old + (1 - alpha) * q)
    torch.testing.assert_close(mixed_ratio(p.log(), p_old.log(), q.log(), alpha), expected)


@pytest.mark.parametrize("alpha", [0.5, 0.875, 0.9375, 1.0])
def test_trust_region_bounds_put_the_mixed_ratio_on_the_clip_edges(alpha):
    old = torch.tensor([0.3, 0.05, 0.6])
    ref = torch.tensor([0.1, 0.4, 0.2])
    eps_low, eps_high = 0.2, 0.28
    lower, upper = trust_region_bounds(old, ref, alpha, eps_low, eps_high)
    torch.testing.assert_close(mixed_ratio(upper.log(), old.log(), ref.log(), alpha), torch.full_like(old, 1 + eps_high))
    valid = lower > 0
    torch.testing.assert_close(
        mixed_ratio(lower[valid].log(), old[valid].log(), ref[valid].log(), alpha),
        torch.full_like(old[valid], 1 - eps_low),
    )


def test_trust_region_widens_where_the_reference_puts_mass():
    old = torch.tensor([0.2, 0.2])
    ref = torch.tensor([0.0, 0.5])
    lower, upper = trust_region_bounds(old, ref, 0.9, 0.2, 0.28)
    # no reference mass: the ordinary PPO region (1 ± ε)·π_old
    torch.testing.assert_close(lower[0], torch.tensor(0.16))
    torch.testing.assert_close(upper[0], torch.tensor(0.256))
    assert upper[1] > upper[0] and lower[1] < lower[0]


def test_invalid_alpha_is_refused():
    with pytest.raises(ValueError, match="alpha"):
        mixed_logprobs(torch.zeros(1), torch.zeros(1), 0.0)
    with pytest.raises(ValueError, match="alpha"):
        trust_region_bounds(torch.ones(1), torch.ones(1), 1.5, 0.2, 0.2)


def test_default_alpha_matches_group_composition():
    assert default_alpha(16) == 0.9375
    assert default_alpha(8) == 0.875


def test_k3_kl_is_nonnegative_and_zero_on_equal_inputs():
    torch.manual_seed(2)
    a, b = -torch.rand(100) * 4, -torch.rand(100) * 4
    assert (k3_kl(a, b) >= 0).all()
    assert torch.equal(k3_kl(a, a), torch.zeros_like(a))


def test_public_names_are_the_functions_whatever_was_imported_first():
    import armor_trl
    import armor_trl.algorithm.mixture  # noqa: F401  (a submodule import sets a package attribute of its name)
    import armor_trl.trainer  # noqa: F401

    assert callable(armor_trl.mixed_ratio) and callable(armor_trl.mixed_logprobs)
    assert armor_trl.mixed_ratio is armor_trl.algorithm.mixture.mixed_ratio


# --- KL over completions: two scripted "models" emitting 2 tokens, each from its own categorical per position ----
P = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]])  # p(token | position)
Q = torch.tensor([[0.3, 0.3, 0.4], [0.25, 0.25, 0.5]])


def token_logps(model, completions):
    """Per-token log-probs of each completion (rows of token ids) under a scripted model."""
    return torch.stack([model[t].log()[completions[:, t]] for t in range(completions.size(1))], dim=1)


def exact_kl(a, b):
    return (a * (a / b).log()).sum().item()  # tokens are independent: the sequence KL is the sum over positions


def test_kl_estimators_equal_the_exact_kl_when_enumerating_every_completion():
    completions = torch.tensor(list(itertools.product(range(3), repeat=2)))
    weights = token_logps(P, completions).sum(1).exp()  # p(y) of each of the 9 completions
    mask = torch.ones_like(completions)
    log_ratio = sequence_log_ratios(token_logps(P, completions), token_logps(Q, completions), mask)
    assert math.isclose((weights * log_ratio).sum().item(), exact_kl(P, Q), rel_tol=1e-5)  # reverse-type: on p
    q_weights = token_logps(Q, completions).sum(1).exp()
    reverse_direction = sequence_log_ratios(token_logps(Q, completions), token_logps(P, completions), mask)
    assert math.isclose((q_weights * reverse_direction).sum().item(), exact_kl(Q, P), rel_tol=1e-5)


def test_kl_estimate_from_samples_converges_and_ignores_masked_tokens():
    generator = torch.Generator().manual_seed(0)
    samples = torch.stack([torch.multinomial(P[t], 20000, replacement=True, generator=generator) for t in range(2)], 1)
    estimate = kl_estimate(token_logps(P, samples), token_logps(Q, samples), torch.ones_like(samples))
    assert abs(estimate - exact_kl(P, Q)) < 0.02  # standard error here is about 0.005
    # a third, masked position (padding) holding anything, even -inf, leaves the estimate as it was
    padded = torch.cat([token_logps(P, samples), torch.full((20000, 1), -math.inf)], 1)
    other = torch.cat([token_logps(Q, samples), torch.zeros(20000, 1)], 1)
    mask = torch.cat([torch.ones_like(samples), torch.zeros(20000, 1, dtype=samples.dtype)], 1)
    assert kl_estimate(padded, other, mask) == estimate
