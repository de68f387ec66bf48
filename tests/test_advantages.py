"""Group advantages (GRPO mean baseline, QAE quantile baseline, batch std over kept groups) and DAPO's keep rule."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.trainer.utils import nanstd as trl_nanstd

from armor_trl.algorithm.advantages import (
    ALL_CORRECT, ALL_WRONG, KEPT, NO_ANCHOR, dynamic_sampling_keep, group_advantages, group_quantile, nanstd,
)

nan = float("nan")


def direct_advantages(rewards, group_size, scale, quantile, keep):
    """The formula written out group by group, in plain Python (NaN rows are no members)."""
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]

    def std(values):
        values = [v for v in values if not math.isnan(v)]
        if len(values) < 2:
            return nan
        mean = sum(values) / len(values)
        return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))

    def baseline(values):
        values = sorted(v for v in values if not math.isnan(v))
        if not values:
            return nan
        if quantile is None:
            return sum(values) / len(values)
        position = quantile * (len(values) - 1)
        low, high = math.floor(position), math.ceil(position)
        return values[low] + (values[high] - values[low]) * (position - low)

    batch_std = std([v for g, values in enumerate(groups) if keep[g] for v in values])
    out = []
    for g, values in enumerate(groups):
        scale_by = {"group": std(values), "batch": batch_std, "none": None}[scale]
        for v in values:
            a = v - baseline(values)
            if scale_by is not None:
                a = a / (scale_by + 1e-4)
            out.append(0.0 if not keep[g] or math.isnan(a) else a)
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 6).flatmap(
        lambda g: st.tuples(
            st.just(g),
            st.lists(st.lists(st.one_of(st.floats(-2, 2), st.just(nan)), min_size=g, max_size=g), min_size=1, max_size=5),
        )
    ),
    st.sampled_from(["group", "batch", "none"]),
    st.one_of(st.none(), st.floats(0, 1)),
    st.data(),
)
def test_advantages_equal_the_formula(groups, scale, quantile, data):
    group_size, rows = groups
    rewards = [v for row in rows for v in row]
    keep = data.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)))
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), group_size, scale, quantile, torch.tensor(keep),
                           interpolation="linear")
    assert got.tolist() == pytest.approx(direct_advantages(rewards, group_size, scale, quantile, keep), abs=1e-9)


def test_qae_baseline_is_the_group_quantile():
    # linear: K = 0.4 of [0, 0, 1, 1, 1]: position 1.6 -> 0 + 0.6 * 1 = 0.6; no std scaling
    advantages = group_advantages(torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]), 5, "none", quantile=0.4,
                                  interpolation="linear")
    assert advantages.tolist() == pytest.approx([-0.6, -0.6, 0.4, 0.4, 0.4])
    # inverted_cdf (default): the smallest reward with >= 40% of the group at or below it: 0
    advantages = group_advantages(torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]), 5, "none", quantile=0.4)
    assert advantages.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_qae_default_baseline_is_one_of_the_two_regimes_for_binary_rewards():
    # the case: G = 16, K = 0.45, 9/16 correct; linear interpolation gives 0.75, QAE's definition 1 or 0
    rewards = torch.tensor([0.0] * 7 + [1.0] * 9)
    assert group_quantile(rewards.view(1, -1), 0.45, "linear").item() == pytest.approx(0.75)
    for group_size in range(2, 21):
        for correct in range(group_size + 1):
            rewards = torch.tensor([0.0] * (group_size - correct) + [1.0] * correct).view(1, -1)
            p = correct / group_size
            expected = 0.0 if p <= 1 - 0.45 + 1e-12 else 1.0  # QAE: baseline 0 iff p <= 1 - K
            assert group_quantile(rewards, 0.45).item() == expected, (group_size, correct)


@given(st.lists(st.one_of(st.floats(-5, 5), st.just(float("nan"))), min_size=1, max_size=12),
       st.floats(0.0, 1.0))
def test_inverted_cdf_quantile_is_the_smallest_value_covering_k(values, k):
    got = group_quantile(torch.tensor([values], dtype=torch.float64), k).item()
    present = sorted(v for v in values if v == v)
    if not present:
        assert got != got  # NaN: no member
        return
    covering = [v for v in present if sum(w <= v for w in present) >= k * len(present)]
    assert got == min(covering)


def test_nanstd_matches_trl():
    values = torch.tensor([[1.0, nan, 3.0, 4.0], [nan, nan, 2.0, nan]])
    assert torch.allclose(nanstd(values, dim=1), trl_nanstd(values, dim=1), equal_nan=True)
    assert torch.allclose(nanstd(values), trl_nanstd(values))


def test_dropped_groups_stay_out_of_the_batch_std():
    rewards = torch.tensor([0.0, 1.0, 5.0, 5.0])  # group 1 is all-equal and dropped
    kept_only = group_advantages(torch.tensor([0.0, 1.0]), 2, "batch")
    both = group_advantages(rewards, 2, "batch", keep=torch.tensor([True, False]))
    assert both[:2].tolist() == kept_only.tolist() and both[2:].tolist() == [0.0, 0.0]


ON_POLICY = torch.tensor([True, True, True, False])  # G = 4, the last row is the anchor


@pytest.mark.parametrize(
    "rewards, has_anchor, gate, keep_unsolved, keep, reason",
    [
        ([1, 0, 1, 1], True, True, False, True, KEPT),  # mixed on-policy samples, anchor found
        ([1, 1, 1, 1], True, True, False, False, ALL_CORRECT),
        ([0, 0, 0, 1], True, True, False, False, ALL_WRONG),  # the anchor's reward does not count
        ([0, 0, 0, 1], True, True, True, True, KEPT),  # weak_filter keeps it: it has an anchor
        ([0, 0, 0, nan], False, True, True, False, ALL_WRONG),  # ... but not without one
        ([1, 0, 1, nan], False, True, False, False, NO_ANCHOR),  # the gate
        ([1, 0, 1, nan], False, False, False, True, KEPT),  # anchor_filter="keep": no gate
        ([nan, nan, nan, nan], False, False, False, False, ALL_WRONG),  # nothing scored: no signal
    ],
)
def test_dynamic_sampling_rule(rewards, has_anchor, gate, keep_unsolved, keep, reason):
    got_keep, got_reason = dynamic_sampling_keep(
        torch.tensor([rewards], dtype=torch.float), ON_POLICY, 1.0, torch.tensor([has_anchor]), gate, keep_unsolved
    )
    assert (got_keep.item(), got_reason.item()) == (keep, reason)


def test_without_anchors_the_test_is_over_all_samples():
    keep, reasons = dynamic_sampling_keep(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), torch.ones(4, dtype=torch.bool), 1.0)
    assert keep.item() and reasons.item() == KEPT
