"""Property tests (hypothesis) for the Mixed Optimization math in armor_trl/algorithm/mixture.py.

Random inputs include −inf log-probs (tokens a policy cannot produce), log-probs down to −1e4, α near 0 and
near 1, and float64 / float32 / bf16 tensors. The oracle is computed per element in Python float64 from the
*same* (dtype-rounded) inputs with ``math.log``/``math.exp``, so it shares no code with the ``torch.logaddexp``
implementation.
"""

from __future__ import annotations

import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from armor_trl import mixed_logprobs, mixed_ratio, trust_region_bounds  # noqa: E402

INF = math.inf
PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Log-probabilities: impossible tokens (−inf), certain tokens (0), the usual range, and far tails.
logps = st.one_of(
    st.just(-INF),
    st.just(0.0),
    st.floats(min_value=-30.0, max_value=0.0),
    st.floats(min_value=-1e4, max_value=-30.0),
)
finite_logps = st.floats(min_value=-50.0, max_value=0.0)
alphas = st.one_of(
    st.floats(min_value=1e-6, max_value=1.0),
    st.sampled_from([1e-6, 1e-3, 0.5, 0.875, 0.9375, 1.0 - 1e-6, 1.0 - 1e-12, 1.0]),
)
mixing_alphas = alphas.filter(lambda a: a < 1.0)
# Probabilities down to 1e-30 (subnormal floats carry too few bits for a relative-precision oracle).
probabilities = st.one_of(st.just(0.0), st.just(1.0), st.floats(min_value=1e-30, max_value=1.0))
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
# Absolute error allowed on a log-prob, per unit of magnitude (a few ulps of the dtype).
LOG_TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2.0**-6}


def as_tensor(values, dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def rounded(values, dtype) -> list[float]:
    """The inputs as the function sees them (rounded to ``dtype``), back in Python floats."""
    return as_tensor(values, dtype).double().tolist()


def oracle_mix(a: float, b: float, alpha: float) -> float:
    """log(α·e^a + (1−α)·e^b) in Python float64, shifted by the larger weighted term; −inf when both vanish."""
    terms = [math.log(w) + x for w, x in ((alpha, a), (1.0 - alpha, b)) if w > 0 and x > -INF]
    if not terms:
        return -INF
    m = max(terms)
    return m + math.log(sum(math.exp(t - m) for t in terms))


def log_tol(dtype, *values: float) -> float:
    scale = max([1.0] + [abs(v) for v in values if math.isfinite(v)])
    return LOG_TOL[dtype] * scale


# --- mixed_logprobs ----------------------------------------------------------------------------------------------
@PROPERTY_SETTINGS
@given(pairs=st.lists(st.tuples(logps, logps), min_size=1, max_size=16), alpha=alphas, dtype=st.sampled_from(list(DTYPES)))
def test_mixed_logprobs_matches_the_mixture_and_stays_between_its_inputs(pairs, alpha, dtype):
    dtype = DTYPES[dtype]
    logp, ref = rounded([a for a, _ in pairs], dtype), rounded([b for _, b in pairs], dtype)
    out = mixed_logprobs(as_tensor(logp, dtype), as_tensor(ref, dtype), alpha)
    assert out.dtype == dtype
    assert not torch.isnan(out).any(), "mixed log-probs must never be NaN"
    for a, b, got in zip(logp, ref, out.double().tolist()):
        expected = oracle_mix(a, b, alpha)
        if expected == -INF:
            assert got == -INF, (a, b, got)
            continue
        assert math.isfinite(got), f"finite mixture {expected} came out as {got} for ({a}, {b}, α={alpha})"
        tol = log_tol(dtype, a, b, expected)
        # log form of exp(mixed) = α·exp(logp) + (1−α)·exp(ref_logp)
        assert abs(got - expected) <= tol, (a, b, alpha, got, expected)
        # a convex mixture in probability space lies between its components ...
        lo = min(a, b) if alpha < 1.0 else a
        assert lo - tol <= got <= max(a, b) + tol, (a, b, alpha, got)
        # ... and above each weighted component
        assert got >= max(a + math.log(alpha), b + math.log1p(-alpha) if alpha < 1.0 else -INF) - tol
        if expected > -30.0 and dtype != torch.bfloat16:  # probability-space form, where exp does not underflow
            p = alpha * math.exp(a) + (1.0 - alpha) * math.exp(b)
            assert math.exp(got) == pytest.approx(p, rel=10 * LOG_TOL[dtype] * max(1.0, abs(expected)))


@PROPERTY_SETTINGS
@given(pairs=st.lists(st.tuples(logps, logps), min_size=1, max_size=16), dtype=st.sampled_from(list(DTYPES)))
def test_alpha_one_returns_logp_exactly(pairs, dtype):
    dtype = DTYPES[dtype]
    logp, ref = as_tensor([a for a, _ in pairs], dtype), as_tensor([b for _, b in pairs], dtype)
    out = mixed_logprobs(logp, ref, 1.0)
    assert out.dtype == logp.dtype and torch.equal(out, logp)
    old = logp.flip(0)
    expected = torch.exp(logp - old)
    assert torch.equal(torch.nan_to_num(mixed_ratio(logp, old, ref, 1.0)), torch.nan_to_num(expected))


@PROPERTY_SETTINGS
@given(pairs=st.lists(st.tuples(logps, logps), min_size=1, max_size=16), alpha=mixing_alphas)
def test_mixture_is_symmetric_in_its_components(pairs, alpha):
    logp = as_tensor([a for a, _ in pairs], torch.float64)
    ref = as_tensor([b for _, b in pairs], torch.float64)
    swapped = mixed_logprobs(ref, logp, 1.0 - alpha) if 1.0 - alpha > 0 else None
    if swapped is None:
        return
    # α and 1−α are not exact complements in floating point when α is tiny; compare with a matching tolerance
    torch.testing.assert_close(mixed_logprobs(logp, ref, alpha), swapped, rtol=1e-9, atol=1e-9)


@PROPERTY_SETTINGS
@given(
    pairs=st.lists(st.tuples(finite_logps, logps), min_size=1, max_size=16),
    alpha=alphas,
    dtype=st.sampled_from(["float64", "float32"]),
)
def test_gradient_wrt_logp_is_the_policy_share_of_the_mixture(pairs, alpha, dtype):
    dtype = DTYPES[dtype]
    logp_values, ref_values = rounded([a for a, _ in pairs], dtype), rounded([b for _, b in pairs], dtype)
    logp = as_tensor(logp_values, dtype).requires_grad_(True)
    mixed_logprobs(logp, as_tensor(ref_values, dtype), alpha).sum().backward()
    grad = logp.grad.double().tolist()
    for a, b, g in zip(logp_values, ref_values, grad):
        assert math.isfinite(g) and -1e-6 <= g <= 1.0 + 1e-6, (a, b, alpha, g)
        share = math.exp(math.log(alpha) + a - oracle_mix(a, b, alpha))  # α·π / π_mix
        assert g == pytest.approx(share, rel=1e-4, abs=1e-6), (a, b, alpha, g, share)


@PROPERTY_SETTINGS
@given(
    triples=st.lists(st.tuples(finite_logps, finite_logps, logps), min_size=1, max_size=16),
    alpha=alphas,
    dtype=st.sampled_from(list(DTYPES)),
)
def test_mixed_ratio_is_the_ratio_of_mixtures(triples, alpha, dtype):
    dtype = DTYPES[dtype]
    new = rounded([t[0] for t in triples], dtype)
    old = rounded([t[1] for t in triples], dtype)
    ref = rounded([t[2] for t in triples], dtype)
    ratio = mixed_ratio(as_tensor(new, dtype), as_tensor(old, dtype), as_tensor(ref, dtype), alpha)
    assert ratio.dtype == dtype and torch.isfinite(ratio).all() and (ratio > 0).all()
    same = mixed_ratio(as_tensor(old, dtype), as_tensor(old, dtype), as_tensor(ref, dtype), alpha)
    assert torch.equal(same, torch.ones_like(same)), "r_mix must be exactly 1 when π_θ = π_old"
    for n, o, r, got in zip(new, old, ref, ratio.double().tolist()):
        mix_new, mix_old = oracle_mix(n, r, alpha), oracle_mix(o, r, alpha)
        tol = log_tol(dtype, mix_new, mix_old) * 2
        assert abs(math.log(got) - (mix_new - mix_old)) <= tol, (n, o, r, alpha, got)


@PROPERTY_SETTINGS
@given(alpha=st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True), st.just(math.nan)))
def test_alpha_outside_the_unit_interval_is_refused(alpha):
    x = torch.zeros(2)
    with pytest.raises(ValueError):
        mixed_logprobs(x, x, alpha)
    with pytest.raises(ValueError):
        trust_region_bounds(x, x, alpha, 0.2, 0.28)


# --- trust_region_bounds -----------------------------------------------------------------------------------------
eps_lows = st.floats(min_value=0.01, max_value=0.9)
eps_highs = st.floats(min_value=0.01, max_value=2.0)


@PROPERTY_SETTINGS
@given(
    pairs=st.lists(st.tuples(probabilities, probabilities, probabilities), min_size=1, max_size=16),
    alpha=alphas,
    eps_low=eps_lows,
    eps_high=eps_highs,
    dtype=st.sampled_from(["float64", "float32"]),
)
def test_trust_region_bounds_put_the_mixed_ratio_on_the_clip_edges(pairs, alpha, eps_low, eps_high, dtype):
    dtype = DTYPES[dtype]
    old, ref, probe = (rounded([t[i] for t in pairs], dtype) for i in range(3))
    lower, upper = trust_region_bounds(as_tensor(old, dtype), as_tensor(ref, dtype), alpha, eps_low, eps_high)
    assert lower.dtype == dtype and upper.dtype == dtype
    assert torch.isfinite(lower).all() and torch.isfinite(upper).all()
    rtol = 1e-9 if dtype == torch.float64 else 1e-5
    tiny = torch.finfo(dtype).tiny  # below it (subnormals) a float keeps too few bits for a relative check
    weight = (1.0 - alpha) / alpha

    def r_mix(p, o, r):  # through the function the trainer uses, from log-probs
        logs = [math.log(v) if v > 0 else -INF for v in (p, o, r)]
        t = [torch.tensor([v], dtype=torch.float64) for v in logs]
        return mixed_ratio(t[0], t[1], t[2], alpha).item()

    for o, r, p, lo, hi in zip(old, ref, probe, lower.double().tolist(), upper.double().tolist()):
        # the raw formulas, and the trust region contains π_old and widens with π_ref
        scale = rtol * (o + weight * r) + tiny
        assert lo == pytest.approx((1 - eps_low) * o - eps_low * weight * r, rel=rtol, abs=scale)
        assert hi == pytest.approx((1 + eps_high) * o + eps_high * weight * r, rel=rtol, abs=scale)
        assert lo <= o <= hi or (o == 0 and r == 0)
        if o == 0 and r == 0:
            continue  # π_mix,old = 0: the ratio is undefined (such a token was never sampled)
        if tiny / rtol < lo <= 1:
            event("lower bound is a valid probability")
            assert r_mix(lo, o, r) == pytest.approx(1 - eps_low, rel=10 * rtol)
        if tiny / rtol < hi <= 1:
            event("upper bound is a valid probability")
            assert r_mix(hi, o, r) == pytest.approx(1 + eps_high, rel=10 * rtol)
        # a probe probability lies inside the bounds exactly when r_mix lies inside the clip range
        if dtype == torch.float64:
            ratio = r_mix(p, o, r)
            margin = 1e-9 * (1 + ratio)
            if lo + 1e-9 < p < hi - 1e-9:
                assert 1 - eps_low - margin <= ratio <= 1 + eps_high + margin
            elif p < lo - 1e-9 or p > hi + 1e-9:
                assert ratio < 1 - eps_low + margin or ratio > 1 + eps_high - margin


@PROPERTY_SETTINGS
@given(
    pairs=st.lists(st.tuples(probabilities, probabilities), min_size=1, max_size=16),
    alpha=alphas,
    eps_low=eps_lows,
    eps_high=eps_highs,
)
def test_trust_region_bounds_in_bf16_are_close_and_still_hit_the_clip_edges(pairs, alpha, eps_low, eps_high):
    old, ref = rounded([a for a, _ in pairs], torch.bfloat16), rounded([b for _, b in pairs], torch.bfloat16)
    lower, upper = trust_region_bounds(
        as_tensor(old, torch.bfloat16), as_tensor(ref, torch.bfloat16), alpha, eps_low, eps_high
    )
    assert lower.dtype == torch.bfloat16 and torch.isfinite(lower).all() and torch.isfinite(upper).all()
    exact_lower, exact_upper = trust_region_bounds(as_tensor(old, torch.float64), as_tensor(ref, torch.float64), alpha, eps_low, eps_high)
    weight = (1.0 - alpha) / alpha
    for o, r, lo, hi, elo, ehi in zip(
        old, ref, lower.double().tolist(), upper.double().tolist(), exact_lower.tolist(), exact_upper.tolist()
    ):
        scale = o + weight * r  # the magnitude of the terms; cancellation makes relative error meaningless
        assert abs(lo - elo) <= 2.0**-6 * scale + 1e-30 and abs(hi - ehi) <= 2.0**-6 * scale + 1e-30
        mix_old = alpha * o + (1 - alpha) * r
        if mix_old <= 0:
            continue
        # plugged back (in float64, to isolate the bounds' own bf16 error): r_mix within ~3 bf16 ulps of the edge
        if 0 < lo <= 1:
            assert (alpha * lo + (1 - alpha) * r) / mix_old == pytest.approx(1 - eps_low, abs=3 * 2.0**-8)
        if 0 < hi <= 1:
            assert (alpha * hi + (1 - alpha) * r) / mix_old == pytest.approx(1 + eps_high, abs=3 * 2.0**-8 * (1 + eps_high))


@PROPERTY_SETTINGS
@given(
    old=st.floats(min_value=1e-6, max_value=1.0),
    ref_small=st.floats(min_value=0.0, max_value=1.0),
    ref_big=st.floats(min_value=0.0, max_value=1.0),
    alpha=mixing_alphas,
    eps_low=eps_lows,
    eps_high=eps_highs,
)
def test_trust_region_widens_where_the_reference_puts_mass(old, ref_small, ref_big, alpha, eps_low, eps_high):
    ref_small, ref_big = sorted((ref_small, ref_big))
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    lo_small, hi_small = trust_region_bounds(t(old), t(ref_small), alpha, eps_low, eps_high)
    lo_big, hi_big = trust_region_bounds(t(old), t(ref_big), alpha, eps_low, eps_high)
    assert lo_big.item() <= lo_small.item() and hi_big.item() >= hi_small.item()
    # with no reference mass it is PPO's multiplicative region
    lo0, hi0 = trust_region_bounds(t(old), t(0.0), alpha, eps_low, eps_high)
    assert lo0.item() == pytest.approx((1 - eps_low) * old) and hi0.item() == pytest.approx((1 + eps_high) * old)
