"""The study's statistics, on plain curves (lists of ``(step, value)``); no training code.

Per run: start / peak / step of peak / final / minimum after the peak / area under the validation curve / final
training reward. Per arm: mean ± sample std over seeds. Between two arms: the paired difference per seed (same
seed = same evaluation sampling seed and RL seed), on the validation steps both runs have, with a percentile
bootstrap 95% confidence interval of the mean difference over seeds, and a verdict that follows the interval.

With several warm checkpoints (warm-up seeds) runs are keyed (warm checkpoint, seed) and pairs share both; the
interval is a hierarchical bootstrap: warm checkpoints resampled with replacement, then seeds within each chosen
one (:func:`hierarchical_ci`). With one warm checkpoint it is exactly the seed bootstrap (:func:`bootstrap_ci`).
"""

from __future__ import annotations

import math
import statistics

import numpy as np

METRICS = ("start", "peak", "peak_step", "final", "min_after_peak", "auc", "final_train_reward")
COMPARED = ("final", "auc", "min_after_peak", "peak", "final_train_reward")  # paired comparisons, in this order
PRIMARY = ("final", "auc", "min_after_peak")  # issue 16's primary metrics: final held-out accuracy, area, minimum
MEANS = ("start", "peak", "final", "min_after_peak", "auc")  # per-arm means given a hierarchical CI (several warms)
TRAIN_TAIL = 0.1  # final training reward: mean of the last 10% of logged values (one step's reward is noisy)
COLLAPSE_DROP = 0.10  # issue 11's criterion: validation ends this far below its peak, and below its start,
# while the training reward rose (mean of the last 10% of logged values above the mean of the first 10%)


def auc(curve: list[tuple[int, float]]) -> float:
    """Area under the curve by the trapezoid rule, divided by its step span: the curve's average height (so it
    reads as an accuracy). A single point is its own value."""
    if len(curve) == 1:
        return curve[0][1]
    area = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in zip(curve, curve[1:]))
    return area / (curve[-1][0] - curve[0][0])


def run_metrics(val: list[tuple[int, float]], train: list[tuple[int, float]]) -> dict:
    """The summary numbers of one run (the peak is the first maximum; ``final_train_reward`` and ``collapsed`` are
    None without training rewards). ``collapsed``: the final validation is at least :data:`COLLAPSE_DROP` below the
    peak and below the start while the training reward rose."""
    if not val:
        raise ValueError("a run without validation points has no summary")
    values = [v for _, v in val]
    peak_index = values.index(max(values))
    rewards = [v for _, v in train]
    tail_size = max(1, math.ceil(len(train) * TRAIN_TAIL))
    tail, head = rewards[-tail_size:], rewards[:tail_size]
    collapsed = None
    if rewards:
        collapsed = (values[-1] <= values[peak_index] - COLLAPSE_DROP and values[-1] < values[0]
                     and statistics.fmean(tail) > statistics.fmean(head))
    return {
        "start": values[0],
        "peak": values[peak_index],
        "peak_step": val[peak_index][0],
        "final": values[-1],
        "min_after_peak": min(values[peak_index:]),
        "auc": auc(val),
        "final_train_reward": statistics.fmean(tail) if tail else None,
        "collapsed": collapsed,
    }


def mode_criterion(runs: dict, general_mode: str, min_collapsed: int, min_warm_checkpoints: int) -> dict:
    """The mode testbed's plain-GRPO criterion (issue 16 item 2) on ``runs`` (warm checkpoint → seed → curves as
    :func:`armor_trl.app.experiments.runner.read_curves` gives them). Per warm checkpoint: how many runs collapsed
    (:func:`run_metrics`), the held-out share of ``general_mode`` at step 0 and at the last validation (means over
    its runs), and ``met``: at least ``min_collapsed`` runs collapsed and the mean share fell. ``met`` overall: on at
    least ``min_warm_checkpoints`` warm checkpoints; None (not judged) when a warm checkpoint has fewer than
    ``min_collapsed`` runs (a study of fewer seeds than the criterion was set for) or there are fewer warm
    checkpoints than ``min_warm_checkpoints``."""
    per_warm = {}
    for warm, seeds in runs.items():
        flags = [run_metrics(c["val"], c["train"])["collapsed"] for c in seeds.values()]
        shares = [c["modes"].get(general_mode) or [] for c in seeds.values()]
        if any(not curve for curve in shares):
            raise ValueError(f"mode criterion: a run of warm checkpoint {warm} logged no share of mode "
                             f"{general_mode!r} (val_mode_classifier, and a mode it returns).")
        start = statistics.fmean(curve[0][1] for curve in shares)
        end = statistics.fmean(curve[-1][1] for curve in shares)
        collapsed = sum(bool(f) for f in flags)
        per_warm[warm] = {"collapsed": collapsed, "runs": len(flags), "share_start": start, "share_end": end,
                          "share_falls": end < start, "met": collapsed >= min_collapsed and end < start}
    met = sum(w["met"] for w in per_warm.values())
    judged = len(per_warm) >= min_warm_checkpoints and all(w["runs"] >= min_collapsed for w in per_warm.values())
    return {"general_mode": general_mode, "min_collapsed": min_collapsed,
            "min_warm_checkpoints": min_warm_checkpoints, "per_warm": per_warm, "warm_checkpoints_met": met,
            "met": met >= min_warm_checkpoints if judged else None}


def carry_mix_criterion(runs: dict, val_drop: float = 0.05, mode_drop: float = 0.10, min_warm_checkpoints: int = 2,
                        mode_set: str = "train_carry", general_mode: str = "carrying") -> dict:
    """The carry-mix variant's plain-GRPO criterion (docs/preregistration/mode_testbed_carry_mix.md) on ``runs``
    (warm checkpoint → seed → curves as :func:`armor_trl.app.experiments.runner.read_curves` gives them). Per warm
    checkpoint, on the means over its runs (first vs last validation): the held-out accuracy falls by at least
    ``val_drop`` and ``general_mode``'s share on the validation set ``mode_set`` falls by at least ``mode_drop``;
    ``met`` overall when both hold on at least ``min_warm_checkpoints`` warm checkpoints."""
    per_warm = {}
    for warm, seeds in runs.items():
        shares = [c.get("set_modes", {}).get(mode_set, {}).get(general_mode) or [] for c in seeds.values()]
        if any(not curve for curve in shares):
            raise ValueError(f"carry-mix criterion: a run of warm checkpoint {warm} logged no share of mode "
                             f"{general_mode!r} on validation set {mode_set!r} (val/{mode_set}/mode/{general_mode}).")
        val_start = statistics.fmean(c["val"][0][1] for c in seeds.values())
        val_end = statistics.fmean(c["val"][-1][1] for c in seeds.values())
        share_start = statistics.fmean(curve[0][1] for curve in shares)
        share_end = statistics.fmean(curve[-1][1] for curve in shares)
        val_falls, share_falls = val_end <= val_start - val_drop, share_end <= share_start - mode_drop
        per_warm[warm] = {"runs": len(shares), "val_start": val_start, "val_end": val_end, "share_start": share_start,
                          "share_end": share_end, "val_falls": val_falls, "share_falls": share_falls,
                          "met": val_falls and share_falls}
    met = sum(w["met"] for w in per_warm.values())
    return {"val_drop": val_drop, "mode_drop": mode_drop, "mode_set": mode_set, "general_mode": general_mode,
            "min_warm_checkpoints": min_warm_checkpoints, "per_warm": per_warm, "warm_checkpoints_met": met,
            "met": met >= min_warm_checkpoints if len(per_warm) >= min_warm_checkpoints else None}


def final_mode_shares(curves: dict, mode: str) -> dict:
    """``mode``'s share at the run's last validation on each validation set that logged it: ``{"held-out": share,
    "<set>": share}`` (the held-out set's ``val/mode/<mode>``, a named set's ``val/<set>/mode/<mode>``)."""
    shares = {}
    if curves.get("modes", {}).get(mode):
        shares["held-out"] = curves["modes"][mode][-1][1]
    for name, modes in (curves.get("set_modes") or {}).items():
        if modes.get(mode):
            shares[name] = modes[mode][-1][1]
    return shares


def mode_share_comparison(arm: dict, base: dict, mode: str, resamples: int = 10_000, seed: int = 0) -> dict:
    """``arm − base`` of ``mode``'s final share on each validation set (:func:`final_mode_shares`), paired by (warm
    checkpoint, seed): ``arm`` and ``base`` map warm checkpoint → seed → curves. Per set: :func:`hierarchical_summary`
    of the differences and its verdict."""
    diffs: dict[str, dict] = {}
    for warm in sorted(set(arm) & set(base)):
        for run_seed in sorted(set(arm[warm]) & set(base[warm])):
            a, b = final_mode_shares(arm[warm][run_seed], mode), final_mode_shares(base[warm][run_seed], mode)
            for name in a.keys() & b.keys():
                diffs.setdefault(name, {}).setdefault(warm, []).append(a[name] - b[name])
    out = {}
    for name, groups in diffs.items():
        result = hierarchical_summary(groups, resamples, seed)
        out[name] = {"diffs": groups, **result, "verdict": verdict(result["ci"])}
    return out


def mode_share_series(series_by_mode: dict, mode: str) -> list[tuple[int, float]]:
    """``mode``'s share (a key of the anchor mode diagnostic: ``<mode>``, or ``<type>/<mode>`` split by prompt type) at
    every round that had rows of its prompt type, 0 where those rows had another mode. A round is a logged step where
    some mode of the same prompt type was logged: a round without rows of that type (no carry prompt among the kept
    groups, say) has no share, it is not a share of 0. The overall shares (no type) count every round with rows."""
    prompt_type = mode.rpartition("/")[0]
    values = dict(series_by_mode.get(mode, []))
    rounds = {step for key, curve in series_by_mode.items() if key.rpartition("/")[0] == prompt_type
              for step, _ in curve}
    return [(step, values.get(step, 0.0)) for step in sorted(rounds)]


def anchor_diagnostic(runs: list[dict]) -> dict | None:
    """The anchor mode diagnostic of an arm's runs (curves as read_curves gives them): per mode, the mean over runs
    of each run's mean share among the kept anchors and among the kept on-policy rows, a prompt type's share averaged
    over the rounds that had rows of that type (:func:`mode_share_series`); the mean count of kept anchors per logged
    step and their mean advantage. None when the runs logged no diagnostic."""
    runs = [c for c in runs if c.get("anchors_kept")]
    if not runs:
        return None

    def run_mean(curve):
        return statistics.fmean(v for _, v in curve) if curve else None

    def over_runs(values):
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else None

    def share_mean(series_by_mode: dict, mode: str):
        return run_mean(mode_share_series(series_by_mode, mode))

    modes = sorted({m for c in runs for m in (*c.get("anchor_modes", {}), *c.get("policy_modes", {}))})
    return {
        "runs": len(runs),
        "anchor_modes": {m: over_runs(share_mean(c.get("anchor_modes", {}), m) for c in runs) for m in modes},
        "policy_modes": {m: over_runs(share_mean(c.get("policy_modes", {}), m) for c in runs) for m in modes},
        "anchors_kept": over_runs(run_mean(c["anchors_kept"]) for c in runs),
        "kept_anchor_advantage": over_runs(run_mean(c.get("kept_anchor_advantage")) for c in runs),
    }


def reference_accuracy(val: list[tuple[int, float]], weights_steps: list[tuple[int, float]]) -> dict:
    """The validation accuracy of π_ref itself over a run: π_ref holds the policy weights of some earlier step (the
    start, a reset, a rolled-back checkpoint), so its accuracy is the policy's validation at that step — the same
    weights, evaluated then. ``curve``: (step, that accuracy) at each logged step whose source step was validated;
    ``unmeasured``: source steps without a validation (resets between validations)."""
    accuracy = dict(val)
    curve, unmeasured = [], set()
    for step, source in weights_steps:
        if int(source) in accuracy:
            curve.append((step, accuracy[int(source)]))
        else:
            unmeasured.add(int(source))
    return {"curve": curve, "sources": sorted({int(s) for _, s in weights_steps}), "unmeasured": sorted(unmeasured)}


def mean_std(values: list[float]) -> dict | None:
    """Mean and sample standard deviation (0 for one value); None when there are no values."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def bootstrap_ci(values: list[float], resamples: int = 10_000, seed: int = 0, level: float = 0.95) -> tuple:
    """Percentile bootstrap interval of the mean: resample the values (seeds) with replacement ``resamples`` times
    with a seeded generator; the interval can never be wider than the values' range."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("bootstrap of no values")
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def verdict(ci: tuple | None) -> str:
    """'higher' / 'lower' when the whole interval lies above / below zero, else 'no detectable difference'."""
    if ci is None:
        return "no detectable difference (fewer than 2 paired seeds)"
    if ci[0] > 0:
        return "higher"
    if ci[1] < 0:
        return "lower"
    return "no detectable difference"


def matched(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> tuple[list, list]:
    """Both curves restricted to the steps they share."""
    common = {s for s, _ in a} & {s for s, _ in b}
    return [p for p in a if p[0] in common], [p for p in b if p[0] in common]


def paired_diffs(arm: dict[int, dict], base: dict[int, dict]) -> tuple[list, dict, dict]:
    """(seeds both have, {metric: [arm − base per seed]}, {step: [arm − base per seed]}); each metric on the
    validation (and training) steps the two runs of a seed share."""
    seeds = sorted(set(arm) & set(base))
    diffs = {m: [] for m in COMPARED}
    by_step: dict[int, list[float]] = {}
    for s in seeds:
        val_a, val_b = matched(arm[s]["val"], base[s]["val"])
        train_a, train_b = matched(arm[s]["train"], base[s]["train"])
        if not val_a:
            continue
        ma, mb = run_metrics(val_a, train_a), run_metrics(val_b, train_b)
        for m in COMPARED:
            if ma[m] is not None and mb[m] is not None:
                diffs[m].append(ma[m] - mb[m])
        for (step, va), (_, vb) in zip(val_a, val_b):
            by_step.setdefault(step, []).append(va - vb)
    return seeds, diffs, by_step


def paired_comparison(arm: dict[int, dict], base: dict[int, dict], resamples: int = 10_000, seed: int = 0) -> dict:
    """``arm − base`` per seed for each metric of :data:`COMPARED` and at each shared validation step.

    ``arm`` and ``base`` map seed → ``{"val": curve, "train": curve}``; only seeds both have count. Each metric is
    computed on the validation (and training) steps the two runs of a seed share. Returns ``{"seeds",
    "metrics": {metric: {"diffs", "mean", "ci", "verdict"}}, "by_step": [{"step", "mean", "ci"}, ...]}``."""
    seeds, diffs, by_step = paired_diffs(arm, base)

    def summary(values):
        ci = bootstrap_ci(values, resamples, seed) if len(values) >= 2 else None
        return {"mean": statistics.fmean(values) if values else None, "ci": ci, "n": len(values)}

    metrics = {}
    for m in COMPARED:
        result = summary(diffs[m])
        metrics[m] = {"diffs": diffs[m], **result, "verdict": verdict(result["ci"])}
    steps = [{"step": step, **summary(values)} for step, values in sorted(by_step.items())]
    return {"seeds": seeds, "metrics": metrics, "by_step": steps}


# --- several warm checkpoints: the hierarchical bootstrap --------------------------------------------------------
def hierarchical_sample(sizes: list[int], resamples: int, rng: np.random.Generator) -> tuple:
    """The resampling plan for groups of ``sizes`` values (one group per warm checkpoint): ``warm`` (resamples, W),
    the groups drawn with replacement; ``picks`` (resamples, W, max size), for each drawn group that many of its
    values drawn with replacement (``floor(u · size)``, u uniform, so one array serves groups of any size);
    ``valid`` marks the picks within each drawn group's size. Draw order: ``warm`` first, then ``u``."""
    sizes = np.asarray(sizes)
    warm = rng.integers(0, len(sizes), size=(resamples, len(sizes)))
    drawn = sizes[warm][..., None]
    picks = (rng.random((resamples, len(sizes), sizes.max())) * drawn).astype(int)
    valid = np.arange(sizes.max()) < drawn
    return warm, np.where(valid, picks, 0), valid


def grand_mean(groups: list[list[float]]) -> float:
    """The mean of the groups' means: every warm checkpoint weighs the same, whatever its number of seeds (with
    equal numbers it is the mean of all values)."""
    return statistics.fmean(statistics.fmean(g) for g in groups)


def hierarchical_means(groups: list[list[float]], resamples: int = 10_000, seed: int = 0) -> np.ndarray:
    """The bootstrap distribution of :func:`grand_mean`: per resample, draw W groups with replacement, then each
    drawn group's values with replacement (:func:`hierarchical_sample`), and take the mean of the drawn groups'
    means."""
    sizes = [len(g) for g in groups]
    table = np.zeros((len(groups), max(sizes)))
    for i, g in enumerate(groups):
        table[i, : len(g)] = g
    warm, picks, valid = hierarchical_sample(sizes, resamples, np.random.default_rng(seed))
    values = table[warm[..., None], picks]
    return ((values * valid).sum(axis=-1) / np.asarray(sizes)[warm]).mean(axis=1)


def hierarchical_ci(groups: list[list[float]], resamples: int = 10_000, seed: int = 0, level: float = 0.95) -> tuple:
    """Percentile interval of :func:`grand_mean` under the hierarchical bootstrap; empty groups are left out. With
    one group it is :func:`bootstrap_ci` of its values, the same numbers as a study with one warm checkpoint."""
    groups = [list(g) for g in groups if len(g)]
    if not groups:
        raise ValueError("bootstrap of no values")
    if len(groups) == 1:
        return bootstrap_ci(groups[0], resamples, seed, level)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(hierarchical_means(groups, resamples, seed), [tail, 100 - tail])
    return float(low), float(high)


def _sign(value: float) -> int:
    return (value > 0) - (value < 0)


def hierarchical_summary(groups: dict, resamples: int = 10_000, seed: int = 0) -> dict:
    """``groups`` maps warm checkpoint → values: the grand mean, its hierarchical CI (None with fewer than 2
    values), the mean per warm checkpoint, their std (between warm checkpoints) and whether every warm
    checkpoint's mean has the grand mean's (non-zero) sign."""
    kept = {w: list(v) for w, v in groups.items() if len(v)}
    n = sum(len(v) for v in kept.values())
    if not kept:
        return {"mean": None, "ci": None, "n": 0, "per_warm": {}, "between_warm_std": None,
                "sign_holds_on_every_warm": None}
    per_warm = {w: statistics.fmean(v) for w, v in kept.items()}
    mean = grand_mean(list(kept.values()))
    return {"mean": mean, "ci": hierarchical_ci(list(kept.values()), resamples, seed) if n >= 2 else None, "n": n,
            "per_warm": per_warm,
            "between_warm_std": statistics.stdev(per_warm.values()) if len(per_warm) > 1 else 0.0,
            "sign_holds_on_every_warm": _sign(mean) != 0 and all(_sign(v) == _sign(mean) for v in per_warm.values())}


def hierarchical_comparison(arm: dict, base: dict, resamples: int = 10_000, seed: int = 0) -> dict:
    """:func:`paired_comparison` over several warm checkpoints: ``arm`` and ``base`` map warm checkpoint → seed →
    curves; runs are paired by (warm checkpoint, seed). Each metric: :func:`hierarchical_summary` of the paired
    differences plus ``diffs`` per warm checkpoint and a verdict that follows the interval."""
    warms = sorted(set(arm) & set(base))
    paired = {w: paired_diffs(arm[w], base[w]) for w in warms}
    metrics = {}
    for m in COMPARED:
        diffs = {w: paired[w][1][m] for w in warms}
        result = hierarchical_summary(diffs, resamples, seed)
        metrics[m] = {"diffs": diffs, **result, "verdict": verdict(result["ci"])}
    steps = sorted({step for w in warms for step in paired[w][2]})
    by_step = []
    for step in steps:
        result = hierarchical_summary({w: paired[w][2].get(step, []) for w in warms}, resamples, seed)
        by_step.append({"step": step, **{k: result[k] for k in ("mean", "ci", "n")}})
    return {"runs": [[w, s] for w in warms for s in paired[w][0]], "metrics": metrics, "by_step": by_step}


def trailing_mean(values, window: int) -> np.ndarray:
    """Mean of each value and up to ``window − 1`` values before it (fewer at the start)."""
    sums = np.cumsum(np.insert(np.asarray(values, dtype=float), 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    counts = np.minimum(ends, window)
    return (sums[ends] - sums[ends - counts]) / counts


def evaluation_se(accuracy: float, problems: int, samples: int) -> float:
    """Standard error of one avg@k evaluation of a fixed problem set from sampling alone: sqrt(p(1−p)/(N·k)) at
    accuracy p, N problems and k samples each. An upper bound: problems the model nearly always (or never) solves
    add less than p(1−p). It does not include which problems were drawn into the set."""
    return math.sqrt(accuracy * (1 - accuracy) / (problems * samples))
