"""The study's statistics over several warm checkpoints: the hierarchical bootstrap (warm checkpoints resampled, then
seeds within each) against hand-written loops and enumerated bootstrap distributions, its reduction to the seed
bootstrap with one warm checkpoint, and comparisons paired by (warm checkpoint, seed) with the per-warm signs."""

from __future__ import annotations

import itertools
import math
import statistics

import numpy as np
import pytest

from armor_trl.app.experiments import stats


def _enumerated(groups, level=0.95):
    """Every equally likely hierarchical resample (warm checkpoints, then each drawn one's values), enumerated:
    (mean, std, (low, high) quantiles) of the mean of the drawn groups' means."""
    means = []
    for warms in itertools.product(range(len(groups)), repeat=len(groups)):
        for picks in itertools.product(*[itertools.product(groups[g], repeat=len(groups[g])) for g in warms]):
            means.append(statistics.fmean(statistics.fmean(p) for p in picks))
    means.sort()
    tail = (1 - level) / 2
    quantiles = tuple(means[math.ceil(q * len(means)) - 1] for q in (tail, 1 - tail))
    return statistics.fmean(means), statistics.pstdev(means), quantiles


def test_one_warm_checkpoint_is_exactly_the_seed_bootstrap():
    values = [0.1, -0.05, 0.2, 0.03, 0.12]
    for seed in (0, 3):
        assert stats.hierarchical_ci([values], resamples=2000, seed=seed) == stats.bootstrap_ci(values, 2000, seed)
    assert stats.hierarchical_ci([[], values]) == stats.bootstrap_ci(values)  # an empty warm checkpoint is left out
    with pytest.raises(ValueError, match="no values"):
        stats.hierarchical_ci([[], []])


def test_resampling_plan_matches_a_hand_written_loop():
    groups = [[0.1, 0.2, 0.3], [1.0, 2.0], [5.0, 6.0, 7.0, 8.0]]
    sizes = [len(g) for g in groups]
    warm, picks, valid = stats.hierarchical_sample(sizes, 50, np.random.default_rng(5))
    rng = np.random.default_rng(5)  # the documented draw order: warm checkpoints, then one uniform per pick
    drawn_warms = rng.integers(0, 3, size=(50, 3))
    uniforms = rng.random((50, 3, 4))
    assert (warm == drawn_warms).all()
    expected_means = []
    for r in range(50):
        group_means = []
        for j in range(3):
            g = drawn_warms[r, j]
            seeds = [int(uniforms[r, j, k] * sizes[g]) for k in range(sizes[g])]
            assert picks[r, j, : sizes[g]].tolist() == seeds and valid[r, j].tolist() == [k < sizes[g] for k in range(4)]
            assert all(0 <= s < sizes[g] for s in seeds)
            group_means.append(statistics.fmean(groups[g][s] for s in seeds))
        expected_means.append(statistics.fmean(group_means))
    assert stats.hierarchical_means(groups, 50, seed=5) == pytest.approx(expected_means)
    # every warm checkpoint is drawn about equally often
    counts = np.bincount(stats.hierarchical_sample(sizes, 6000, np.random.default_rng(0))[0].ravel(), minlength=3)
    assert counts.sum() == 18_000 and (abs(counts - 6000) < 300).all()


def test_warm_offsets_widen_the_interval_where_a_seed_bootstrap_would_not():
    # three warm checkpoints whose runs sit at 0.00, 0.05 and 0.10, no seed noise: drawing warm checkpoint 0 three
    # times has probability 1/27 > 2.5%, so the 95% interval is exactly [0.00, 0.10]
    groups = [[0.0] * 3, [0.05] * 3, [0.1] * 3]
    assert _enumerated([[0.0], [0.05], [0.1]])[2] == pytest.approx((0.0, 0.1))
    low, high = stats.hierarchical_ci(groups)
    assert (low, high) == pytest.approx((0.0, 0.1)) and low <= 0.01
    # pooling the 9 runs as if they were independent seeds: 0.05 ± 1.96·0.0136, which excludes 0.01
    pooled = stats.bootstrap_ci([v for g in groups for v in g])
    assert pooled[0] > 0.015 and pooled[1] < 0.085


def test_hierarchical_bootstrap_matches_the_enumerated_distribution():
    groups = [[0.0, 0.02], [0.1, 0.14]]  # 4 warm draws × 16 seed draws = 64 equally likely resamples
    mean, std, quantiles = _enumerated(groups)
    assert mean == pytest.approx(0.065) and quantiles == pytest.approx((0.005, 0.13))
    means = stats.hierarchical_means(groups, 20_000, seed=0)
    assert means.mean() == pytest.approx(mean, abs=0.002) and means.std() == pytest.approx(std, rel=0.05)
    assert stats.hierarchical_ci(groups, 20_000, seed=0) == pytest.approx(quantiles, abs=0.005)


def test_grand_mean_weighs_every_warm_checkpoint_the_same():
    assert stats.grand_mean([[0.0, 0.0, 0.0], [0.3]]) == pytest.approx(0.15)  # not the pooled 0.075
    # a warm checkpoint with many seeds does not dominate the resampled means either
    assert stats.hierarchical_means([[0.0] * 6, [0.3]], 4000).mean() == pytest.approx(0.15, abs=0.01)


def test_hierarchical_summary_says_whether_the_sign_holds_on_every_warm_checkpoint():
    result = stats.hierarchical_summary({0: [0.1, 0.2], 1: [0.05], 2: [0.3, 0.1, 0.2]}, resamples=500)
    assert result["mean"] == pytest.approx(statistics.fmean([0.15, 0.05, 0.2]))
    assert result["per_warm"] == pytest.approx({0: 0.15, 1: 0.05, 2: 0.2}) and result["n"] == 6
    assert result["between_warm_std"] == pytest.approx(statistics.stdev([0.15, 0.05, 0.2]))
    assert result["sign_holds_on_every_warm"] is True and result["ci"][0] > 0
    flipped = stats.hierarchical_summary({0: [0.1, 0.2], 1: [-0.05], 2: [0.3]}, resamples=500)
    assert flipped["mean"] > 0 and flipped["sign_holds_on_every_warm"] is False
    assert stats.hierarchical_summary({0: [0.0], 1: [0.0]})["sign_holds_on_every_warm"] is False  # no sign at all
    assert stats.hierarchical_summary({0: [0.2], 1: []})["ci"] is None  # one value: no interval
    assert stats.hierarchical_summary({0: [], 1: []})["mean"] is None


def _curves(vals, steps=(0, 10, 20)):
    return {"val": list(zip(steps, vals)), "train": [(5, 0.5), (15, 0.7)]}


def test_comparison_pairs_runs_by_warm_checkpoint_and_seed():
    base = {0: {0: _curves([0.5, 0.6, 0.4]), 1: _curves([0.5, 0.5, 0.3])},
            7: {0: _curves([0.3, 0.3, 0.3]), 1: _curves([0.3, 0.4, 0.2]), 2: _curves([0.1, 0.1, 0.1])}}
    arm = {0: {0: _curves([0.5, 0.6, 0.5]), 1: _curves([0.5, 0.6, 0.45])},
           7: {0: _curves([0.3, 0.3, 0.25]), 1: _curves([0.3, 0.4, 0.3])}}  # warm 7, seed 2: no partner
    result = stats.hierarchical_comparison(arm, base, resamples=2000, seed=1)
    assert result["runs"] == [[0, 0], [0, 1], [7, 0], [7, 1]]
    final = result["metrics"]["final"]
    assert final["diffs"][0] == pytest.approx([0.1, 0.15]) and final["diffs"][7] == pytest.approx([-0.05, 0.1])
    assert final["per_warm"] == pytest.approx({0: 0.125, 7: 0.025})
    assert final["mean"] == pytest.approx(0.075) and final["n"] == 4 and final["sign_holds_on_every_warm"] is True
    assert final["verdict"] == stats.verdict(final["ci"])
    assert final["ci"] == pytest.approx(stats.hierarchical_ci([[0.1, 0.15], [-0.05, 0.1]], 2000, 1))
    peak = result["metrics"]["peak"]  # warm 0: +0.0 / +0.1, warm 7: 0 / 0
    assert peak["per_warm"] == pytest.approx({0: 0.05, 7: 0.0}) and peak["sign_holds_on_every_warm"] is False
    assert [s["step"] for s in result["by_step"]] == [0, 10, 20]
    assert result["by_step"][-1]["mean"] == pytest.approx(0.075) and result["by_step"][-1]["n"] == 4

    # one warm checkpoint: the same numbers as the seed-paired comparison
    single = stats.hierarchical_comparison({0: arm[0]}, {0: base[0]}, resamples=2000, seed=1)
    paired = stats.paired_comparison(arm[0], base[0], resamples=2000, seed=1)
    for m in stats.COMPARED:
        assert single["metrics"][m]["mean"] == paired["metrics"][m]["mean"]
        assert single["metrics"][m]["ci"] == paired["metrics"][m]["ci"]
    assert [(s["mean"], s["ci"]) for s in single["by_step"]] == [(s["mean"], s["ci"]) for s in paired["by_step"]]


def test_primary_metrics_are_per_run_metrics():
    assert set(stats.PRIMARY) <= set(stats.COMPARED) and set(stats.MEANS) <= set(stats.METRICS)
    m = stats.run_metrics([(0, 0.4), (10, 0.6), (20, 0.3), (30, 0.35)], [])
    assert (m["final"], m["min_after_peak"], m["auc"]) == pytest.approx((0.35, 0.3, (5 + 4.5 + 3.25) / 30))


def _run(val, share, train=((1, 0.2), (2, 0.9))):
    """read_curves' shape for one run: held-out curve, on-policy rewards, the general mode's share curve."""
    steps = [s for s, _ in val]
    return {"val": list(val), "train": list(train), "modes": {"carrying": list(zip(steps, share))}}


def test_mode_criterion_counts_collapses_and_the_general_modes_share_per_warm_checkpoint():
    collapsing = _run([(0, 0.5), (40, 0.6), (80, 0.3)], [0.5, 0.5, 0.2])   # 0.3 <= 0.6 - 0.1 and < 0.5
    shallow = _run([(0, 0.5), (40, 0.55), (80, 0.48)], [0.5, 0.5, 0.6])    # 0.48 > 0.55 - 0.1: no collapse
    no_reward_rise = _run([(0, 0.5), (80, 0.1)], [0.5, 0.1], train=((1, 0.9), (2, 0.2)))
    runs = {0: {s: collapsing for s in range(5)},                                 # 5/5, share 0.5 -> 0.2: met
            1: {0: collapsing, 1: collapsing, 2: collapsing, 3: shallow, 4: no_reward_rise},  # 3/5: not met
            2: {0: collapsing, 1: collapsing, 2: collapsing, 3: collapsing, 4: shallow}}       # 4/5, share falls
    result = stats.mode_criterion(runs, "carrying", min_collapsed=4, min_warm_checkpoints=2)
    assert {w: (r["collapsed"], r["met"]) for w, r in result["per_warm"].items()} == {0: (5, True), 1: (3, False),
                                                                                       2: (4, True)}
    assert result["per_warm"][2]["share_start"] == pytest.approx(0.5)
    assert result["per_warm"][2]["share_end"] == pytest.approx((4 * 0.2 + 0.6) / 5)
    assert result["warm_checkpoints_met"] == 2 and result["met"]
    # every run collapses but the general mode's share rises: the criterion is not met anywhere
    rising = {w: {s: _run([(0, 0.5), (80, 0.1)], [0.4, 0.7]) for s in range(5)} for w in range(3)}
    result = stats.mode_criterion(rising, "carrying", 4, 2)
    assert all(r["collapsed"] == 5 and not r["share_falls"] for r in result["per_warm"].values()) and not result["met"]
    # three runs per warm checkpoint cannot show 4 collapses: not judged, rather than "not met"
    three = {w: dict(list(seeds.items())[:3]) for w, seeds in runs.items()}
    assert stats.mode_criterion(three, "carrying", 4, 2)["met"] is None
    assert stats.mode_criterion({0: runs[0]}, "carrying", 4, 2)["met"] is None  # one warm checkpoint of the two
    with pytest.raises(ValueError, match="logged no share of mode 'worked'"):
        stats.mode_criterion(runs, "worked", 4, 2)


def carry_mix_run(val, share):
    return {"val": list(enumerate(val)), "set_modes": {"train_carry": {"carrying": list(enumerate(share))}}}


def test_carry_mix_criterion_needs_both_falls_on_enough_warm_checkpoints():
    from armor_trl.app.experiments.stats import carry_mix_criterion

    falls = {0: carry_mix_run([0.35, 0.25], [0.6, 0.4]), 1: carry_mix_run([0.33, 0.29], [0.6, 0.5])}
    only_val = {0: carry_mix_run([0.35, 0.20], [0.6, 0.58]), 1: carry_mix_run([0.35, 0.20], [0.6, 0.55])}
    result = carry_mix_criterion({"a": falls, "b": falls, "c": only_val})
    assert round(result["per_warm"]["a"]["val_start"], 6) == 0.34 and round(result["per_warm"]["a"]["val_end"], 6) == 0.27
    assert [result["per_warm"][w]["met"] for w in "abc"] == [True, True, False]  # means: -0.07 and -0.15
    assert result["warm_checkpoints_met"] == 2 and result["met"] is True
    assert carry_mix_criterion({"a": falls, "c": only_val, "d": only_val})["met"] is False
    assert carry_mix_criterion({"a": falls})["met"] is None  # fewer warm checkpoints than the rule needs
    with pytest.raises(ValueError, match="val/train_carry/mode/carrying"):
        carry_mix_criterion({"a": {0: {"val": [(0, 0.3)], "set_modes": {}}}})


def diagnostic_run(anchor_modes, policy_modes, kept=2.0):
    steps = sorted({s for curve in (*anchor_modes.values(), *policy_modes.values()) for s, _ in curve})
    return {"anchor_modes": anchor_modes, "policy_modes": policy_modes, "anchors_kept": [(s, kept) for s in steps],
            "kept_anchor_advantage": [(s, 1.0) for s in steps]}


def test_a_prompt_types_share_is_averaged_over_the_rounds_that_had_rows_of_that_type():
    # three rounds with anchors; carry-prompt anchors only in round 2, where they all carry: the carry-prompt share is
    # 1, not 1/3 (a round without carry-prompt rows has no share, it is not a share of 0)
    anchors = {"worked": [(0, 1.0), (1, 1.0), (2, 0.5)], "carrying": [(2, 0.5)],
               "no_carry/worked": [(0, 1.0), (1, 1.0), (2, 1.0)], "carry/carrying": [(2, 1.0)]}
    # on-policy carry-prompt rows in rounds 0 and 2: carrying half of the time in round 0, never in round 2
    policy = {"worked": [(0, 0.75), (1, 1.0), (2, 0.75)], "carrying": [(0, 0.25)], "direct": [(2, 0.25)],
              "no_carry/worked": [(0, 1.0), (1, 1.0), (2, 1.0)],
              "carry/carrying": [(0, 0.5)], "carry/worked": [(0, 0.5), (2, 0.5)], "carry/direct": [(2, 0.5)]}
    diagnostic = stats.anchor_diagnostic([diagnostic_run(anchors, policy)])
    assert diagnostic["anchor_modes"]["carry/carrying"] == pytest.approx(1.0)
    assert diagnostic["policy_modes"]["carry/carrying"] == pytest.approx(0.25)  # (0.5 + 0) / 2 rounds
    assert diagnostic["policy_modes"]["carry/worked"] == pytest.approx(0.5)
    assert diagnostic["policy_modes"]["carry/direct"] == pytest.approx(0.25)
    # each prompt type's shares add up to 1, like the overall ones (the overall average is over every round)
    for modes in (diagnostic["anchor_modes"], diagnostic["policy_modes"]):
        for prompt_type in ("carry", "no_carry", ""):
            assert sum(v for m, v in modes.items() if m.rpartition("/")[0] == prompt_type) == pytest.approx(1.0)
    assert diagnostic["anchor_modes"]["carrying"] == pytest.approx(0.5 / 3)
    assert diagnostic["policy_modes"]["carrying"] == pytest.approx(0.25 / 3)
