"""The study's statistics, on plain curves (lists of ``(step, value)``); no training code.

Per run: start / peak / step of peak / final / minimum after the peak / area under the validation curve / final
training reward. Per arm: mean ± sample std over seeds. Between two arms: the paired difference per seed (same
seed = same evaluation sampling seed and RL seed), on the validation steps both runs have, with a percentile
bootstrap 95% confidence interval of the mean difference over seeds, and a verdict that follows the interval.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

METRICS = ("start", "peak", "peak_step", "final", "min_after_peak", "auc", "final_train_reward")
COMPARED = ("final", "auc", "min_after_peak", "peak", "final_train_reward")  # paired comparisons, in this order
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


def paired_comparison(arm: dict[int, dict], base: dict[int, dict], resamples: int = 10_000, seed: int = 0) -> dict:
    """``arm − base`` per seed for each metric of :data:`COMPARED` and at each shared validation step.

    ``arm`` and ``base`` map seed → ``{"val": curve, "train": curve}``; only seeds both have count. Each metric is
    computed on the validation (and training) steps the two runs of a seed share. Returns ``{"seeds",
    "metrics": {metric: {"diffs", "mean", "ci", "verdict"}}, "by_step": [{"step", "mean", "ci"}, ...]}``."""
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

    def summary(values):
        ci = bootstrap_ci(values, resamples, seed) if len(values) >= 2 else None
        return {"mean": statistics.fmean(values) if values else None, "ci": ci, "n": len(values)}

    metrics = {}
    for m in COMPARED:
        result = summary(diffs[m])
        metrics[m] = {"diffs": diffs[m], **result, "verdict": verdict(result["ci"])}
    steps = [{"step": step, **summary(values)} for step, values in sorted(by_step.items())]
    return {"seeds": seeds, "metrics": metrics, "by_step": steps}


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
