"""The summary of a study (:func:`armor_trl.app.experiments.study.run_study`): per-run metrics, per-arm mean ± std,
paired comparisons with the baselines and the primary / secondary comparisons with bootstrap CIs (hierarchical over
several warm checkpoints), all from :mod:`.stats`, gathered into the dict that becomes ``summary.json``, and
:func:`format_summary`, its ``summary.md``."""

from __future__ import annotations

import statistics

from armor_trl.app.experiments import stats

BASELINES = ("grpo", "grpo_small_lr")  # default: every other arm is compared with these, where they ran


def summarize_study(curves: dict, resamples: int = 10_000, baselines=BASELINES, primary=(), secondary=(),
                    mechanism_mode: str | None = None) -> dict:
    """``curves``: warm checkpoint → arm → seed → curves. One warm checkpoint: :func:`summarize` (today's numbers);
    several: :func:`summarize_warms`. ``primary`` and ``secondary``: [[arm, baseline], ...], each compared on
    :data:`.stats.PRIMARY` the same way, listed under their names; with ``mechanism_mode`` each of them also compares
    that mode's final share on every validation set (``mechanism``). ``anchor_diagnostic``: per arm that logged it
    (``anchor_mode_classifier``), :func:`.stats.anchor_diagnostic` over all its runs."""
    warms = list(curves)
    if len(warms) == 1:
        summary = summarize(curves[warms[0]], resamples, baselines)
        compare = lambda a, b: stats.paired_comparison(curves[warms[0]][a], curves[warms[0]][b], resamples)  # noqa: E731
    else:
        summary = summarize_warms(curves, resamples, baselines)
        compare = lambda a, b: stats.hierarchical_comparison(  # noqa: E731
            {w: curves[w][a] for w in warms}, {w: curves[w][b] for w in warms}, resamples)
    for name, pairs in (("primary", primary), ("secondary", secondary)):
        summary[name] = []
        for arm, base in pairs:
            result = compare(arm, base)
            summary[name].append({"arm": arm, "baseline": base,
                                  "metrics": {m: result["metrics"][m] for m in stats.PRIMARY}})
    summary["mechanism"] = [
        {"arm": arm, "baseline": base, "mode": mechanism_mode, "sets": stats.mode_share_comparison(
            {w: curves[w][arm] for w in warms}, {w: curves[w][base] for w in warms}, mechanism_mode, resamples)}
        for arm, base in (*primary, *secondary)] if mechanism_mode else []
    diagnostic = {arm: stats.anchor_diagnostic([c for w in warms for c in curves[w][arm].values()])
                  for arm in curves[warms[0]]}
    summary["anchor_diagnostic"] = {arm: d for arm, d in diagnostic.items() if d is not None}
    return summary


def summarize_warms(curves: dict, resamples: int = 10_000, baselines=BASELINES) -> dict:
    """:func:`summarize` over several warm checkpoints (``curves``: warm checkpoint → arm → seed → curves).
    ``table``: mean ± std over all runs; ``means``: per arm and metric of :data:`.stats.MEANS`, the mean of the
    warm checkpoints' means with its hierarchical CI, each warm checkpoint's mean and their std; ``comparisons``:
    :func:`.stats.hierarchical_comparison` (pairs share warm checkpoint and seed); ``per_warm``: each warm
    checkpoint's own table, paired comparisons and evaluation."""
    warms = list(curves)
    per_warm = {w: summarize(curves[w], resamples, baselines) for w in warms}
    arms = list(curves[warms[0]])
    pooled = summarize({arm: {(w, s): c for w in warms for s, c in curves[w][arm].items()} for arm in arms},
                       resamples, ())
    means = {arm: {m: stats.hierarchical_summary(
        {w: [r[m] for r in per_warm[w]["per_run"][arm].values() if r[m] is not None] for w in warms}, resamples)
        for m in stats.MEANS} for arm in arms}
    comparisons = {base: {arm: stats.hierarchical_comparison({w: curves[w][arm] for w in warms},
                                                             {w: curves[w][base] for w in warms}, resamples)
                          for arm in arms if arm != base} for base in baselines if base in arms}
    evaluation = {k: v for k, v in pooled["evaluation"].items() if k != "start_std_over_seeds"}
    within = [per_warm[w]["evaluation"].get("start_std_over_seeds") for w in warms]
    if None not in within:  # the same model with each seed's sampling, within each warm checkpoint: evaluation noise
        evaluation["start_std_over_seeds"] = statistics.fmean(within)
    evaluation["start_std_over_warms"] = stats.mean_std([per_warm[w]["evaluation"]["mean_start"] for w in warms])["std"]
    times = [per_warm[w]["run_time_s"] for w in warms]
    return {"per_run": {arm: {w: per_warm[w]["per_run"][arm] for w in warms} for arm in arms},
            "table": pooled["table"], "means": means, "comparisons": comparisons, "evaluation": evaluation,
            "at_points": pooled["at_points"],
            "resamples": resamples, "run_time_s": None if None in times else sum(times),
            "per_warm": {w: {k: per_warm[w][k] for k in ("table", "comparisons", "evaluation")} for w in warms}}


def summarize(curves: dict, resamples: int = 10_000, baselines=BASELINES) -> dict:
    """Per-run metrics, per-arm mean ± std, paired comparisons with the baselines and one evaluation's noise."""
    per_run = {arm: {seed: stats.run_metrics(c["val"], c["train"]) for seed, c in runs.items()}
               for arm, runs in curves.items()}
    table = {}
    for arm, runs in per_run.items():
        table[arm] = {m: stats.mean_std([r[m] for r in runs.values()]) for m in stats.METRICS}
        found = [sum(c["anchors_found"]) / len(c["anchors_found"]) for c in curves[arm].values() if c["anchors_found"]]
        table[arm]["anchors_found"] = stats.mean_std(found)
        judged = [r["collapsed"] for r in runs.values() if r["collapsed"] is not None]
        table[arm]["collapsed"] = {"count": sum(judged), "n": len(judged)} if judged else None
        references = [stats.reference_accuracy(c["val"], c["ref_weights_step"]) for c in curves[arm].values()]
        table[arm]["ref_val_end"] = stats.mean_std([r["curve"][-1][1] for r in references if r["curve"]])
        unmeasured = sorted({s for r in references for s in r["unmeasured"]})
        if unmeasured:
            table[arm]["ref_unmeasured_steps"] = unmeasured
    comparisons = {}
    for base in baselines:
        if base not in curves:
            continue
        comparisons[base] = {arm: stats.paired_comparison(curves[arm], curves[base], resamples)
                             for arm in curves if arm != base}
    first = next(c for runs in curves.values() for c in runs.values())
    starts = [c["val"][0][1] for runs in curves.values() for c in runs.values()]
    start_seeds = {seed: c["val"][0][1] for runs in curves.values() for seed, c in runs.items()}
    evaluation = {"metric": first["val_key"], "problems": first["val_problems"], "samples": first["val_samples"],
                  "mean_start": sum(starts) / len(starts)}
    if first["val_problems"]:
        evaluation["se_binomial"] = stats.evaluation_se(evaluation["mean_start"], first["val_problems"],
                                                        first["val_samples"])
    if len(start_seeds) > 1:  # step 0 = the same model evaluated with each seed's sampling: pure evaluation noise
        evaluation["start_std_over_seeds"] = stats.mean_std(list(start_seeds.values()))["std"]
    times = [c.get("wall_time_s") for runs in curves.values() for c in runs.values()]
    run_time = sum(times) if times and None not in times else None
    return {"per_run": per_run, "table": table, "comparisons": comparisons, "evaluation": evaluation,
            "resamples": resamples, "run_time_s": run_time, "at_points": at_points(curves)}


POINTS = ("start", "peak", "end")  # where at_points reads a run's curves: step 0, its validation peak, its last step


def at_points(curves: dict) -> dict:
    """Per arm, the mean over runs of each pass@j and mode share of the held-out set at each run's start, validation
    peak (the step of its first maximum) and end: {arm: {"pass@j" | "mode/<m>": {point: mean}}}; {} where the runs
    logged neither (val_k 1, no val_mode_classifier)."""
    out = {}
    for arm, runs in curves.items():
        rows: dict[str, dict[str, list]] = {}
        for c in runs.values():
            values = [v for _, v in c["val"]]
            steps = {"start": c["val"][0][0], "peak": c["val"][values.index(max(values))][0], "end": c["val"][-1][0]}
            named = {**{f"pass@{j}": s for j, s in sorted(c.get("pass", {}).items())},
                     **{f"mode/{m}": s for m, s in c.get("modes", {}).items()},
                     **{f"{name}/mode/{m}": s for name, modes in (c.get("set_modes") or {}).items()
                        for m, s in modes.items()}}
            for name, curve in named.items():
                by_step = dict(curve)
                for point, step in steps.items():
                    if step in by_step:
                        rows.setdefault(name, {}).setdefault(point, []).append(by_step[step])
        if rows:
            out[arm] = {name: {point: statistics.fmean(v) for point, v in by_point.items()}
                        for name, by_point in rows.items()}
    return out


def _cell(value: dict | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if "count" in value:
        return f"{value['count']}/{value['n']}"
    text = f"{value['mean']:.{digits}f}"
    return text + (f" ± {value['std']:.{digits}f}" if value["n"] > 1 else "")


def _ci_text(result: dict, digits: int = 3, sign: str = "+") -> str:
    ci = result["ci"]
    return "–" if ci is None else f"[{ci[0]:{sign}.{digits}f}, {ci[1]:{sign}.{digits}f}]"


def _comparison_rows(arm: str, comparison: dict, metrics, multi: bool) -> list[str]:
    rows = []
    for metric in metrics:
        result = comparison["metrics"][metric]
        mean = "–" if result["mean"] is None else f"{result['mean']:+.3f}"
        cells = [arm, metric, mean, _ci_text(result), str(result["n"])]
        if multi:
            agree = result["sign_holds_on_every_warm"]
            cells += [" / ".join(f"{v:+.3f}" for v in result["per_warm"].values()) or "–",
                      "–" if agree is None else ("yes" if agree else "no")]
        rows.append("| " + " | ".join(cells + [result["verdict"]]) + " |")
    return rows


def format_summary(summary: dict) -> str:
    multi = "per_warm" in summary
    ev = summary["evaluation"]
    columns = [*stats.METRICS, "anchors_found", "ref_val_end", "collapsed"]
    over = "all runs (warm checkpoints × seeds)" if multi else "seeds"
    lines = [f"# Study: {', '.join(summary['arms'])} × "
             + (f"warm-up seeds {summary['warmup_seeds']} × " if multi else "") + f"seeds {summary['seeds']}", "",
             f"Recipe `{summary['recipe']}`{' (smoke)' if summary['smoke'] else ''}, "
             + (f"models (warm-up seed: warm checkpoint) {', '.join(f'{w}: `{p}`' for w, p in summary['model'].items())}. "
                if multi else f"model `{summary['model']}`. ") +
             f"Validation: {ev['metric']} on {ev['problems']} held-out problems × {ev['samples']} samples. "
             f"Mean ± sample std over {over}; `auc` = area under the validation curve / step span (trapezoid rule); "
             "`final_train_reward` = mean of the last 10% of logged on-policy rewards; `collapsed` = seeds whose final "
             f"validation is ≥ {stats.COLLAPSE_DROP} below its peak and below its start while training reward rose; "
             "`ref_val_end` = held-out accuracy of the π_ref in use at the end (the run's validation at the step "
             "whose weights π_ref holds; reference.png plots it over the run).",
             "",
             "| arm | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for arm, row in summary["table"].items():
        lines.append(f"| {arm} | " + " | ".join(_cell(row[c], 0 if c == "peak_step" else 3) for c in columns) + " |")
    for arm, row in summary["table"].items():
        if row.get("ref_unmeasured_steps"):
            steps = row["ref_unmeasured_steps"]
            lines += ["", f"{arm}: π_ref held the weights of step(s) {steps[:8]}{' …' if len(steps) > 8 else ''}, "
                      "which were not validated, so its accuracy there is not in `ref_val_end` or reference.png "
                      "(validate at the reset steps: val_every_steps dividing ref_reset_steps)."]
    noise = []
    if "se_binomial" in ev:
        noise.append(f"sampling standard error of one evaluation ≤ {ev['se_binomial']:.4f} (sqrt(p(1−p)/(N·k)) at "
                     f"p = {ev['mean_start']:.3f})")
    if "start_std_over_seeds" in ev:
        noise.append(f"measured: std of the step-0 evaluation of the same model over seeds = "
                     f"{ev['start_std_over_seeds']:.4f}")
    if noise:
        lines += ["", "Evaluation noise: " + "; ".join(noise) + "."]
    if multi:
        lines += ["", f"Warm checkpoints: the mean step-0 evaluation differs across them by a std of "
                  f"{ev['start_std_over_warms']:.4f}.", "",
                  "## Means with hierarchical 95% CIs (the mean of the warm checkpoints' means)", "",
                  "| arm | " + " | ".join(stats.MEANS) + " |", "|" + "---|" * (len(stats.MEANS) + 1)]
        for arm, row in summary["means"].items():
            lines.append(f"| {arm} | " + " | ".join(
                "–" if row[m]["mean"] is None else f"{row[m]['mean']:.3f} {_ci_text(row[m], sign='')}"
                for m in stats.MEANS) + " |")
        records = {r["seed"]: r for r in summary.get("warmups", [])}
        per_warm_columns = ("start", "peak", "final", "min_after_peak", "auc", "collapsed")
        for w, part in summary["per_warm"].items():
            record = records.get(w)
            lines += ["", f"## Warm checkpoint {w} (warm-up seed {w})" + (
                f": {record['steps']} warm-up steps" + calibration_text(record) if record else ""), "",
                "| arm | " + " | ".join(per_warm_columns) + " |", "|" + "---|" * (len(per_warm_columns) + 1)]
            for arm, row in part["table"].items():
                lines.append(f"| {arm} | " + " | ".join(_cell(row[c]) for c in per_warm_columns) + " |")
    header = ["| arm | metric | mean diff | 95% CI | " + ("runs | per warm | sign on every warm | " if multi else
                                                        "seeds | ") + "verdict |",
              "|---|---|---|---|---|" + ("---|---|" if multi else "") + "---|"]
    pairing = "same warm checkpoint and seed" if multi else "same seed"
    for name in ("primary", "secondary"):
        if summary.get(name):
            lines += ["", f"## {name.capitalize()} comparisons ({pairing}, shared validation steps)", "", *header]
            for entry in summary[name]:
                lines += _comparison_rows(f"{entry['arm']} − {entry['baseline']}", entry, stats.PRIMARY, multi)
    if summary.get("mechanism"):
        mode = summary["mechanism"][0]["mode"]
        lines += ["", f"## The general mode's final share: `{mode}` at the last validation, per validation set "
                  f"({pairing})", "", "| arm | validation set | mean diff | 95% CI | runs | " + (
                      "per warm | sign on every warm | " if multi else "") + "verdict |",
                  "|---|---|---|---|---|" + ("---|---|" if multi else "") + "---|"]
        for entry in summary["mechanism"]:
            for set_name, result in sorted(entry["sets"].items()):
                cells = [f"{entry['arm']} − {entry['baseline']}", set_name, f"{result['mean']:+.3f}",
                         _ci_text(result), str(result["n"])]
                if multi:
                    agree = result["sign_holds_on_every_warm"]
                    cells += [" / ".join(f"{v:+.3f}" for v in result["per_warm"].values()) or "–",
                              "–" if agree is None else ("yes" if agree else "no")]
                lines.append("| " + " | ".join(cells + [result["verdict"]]) + " |")
    if summary.get("anchor_diagnostic"):
        modes = list(dict.fromkeys(m for d in summary["anchor_diagnostic"].values() for m in d["anchor_modes"]))
        lines += ["", "## Anchor mode diagnostic (anchor_mode_classifier): each mode's share among the anchors / among "
                  "the on-policy rows of the groups the gate kept (mean over rounds, then runs; a prompt type's share "
                  "<type>/<mode> over the rounds that had rows of that type); kept anchors per logged step and their "
                  "mean advantage", "",
                  "| arm | runs | " + " | ".join(f"{m}: anchors / on-policy" for m in modes)
                  + " | kept anchors per log | kept anchors' advantage |", "|" + "---|" * (len(modes) + 4)]
        for arm, d in summary["anchor_diagnostic"].items():
            cells = [f"{d['anchor_modes'].get(m) or 0:.3f} / {d['policy_modes'].get(m) or 0:.3f}" for m in modes]
            adv = d["kept_anchor_advantage"]
            lines.append(f"| {arm} | {d['runs']} | " + " | ".join(cells) + f" | {d['anchors_kept']:.1f} | "
                         + ("–" if adv is None else f"{adv:+.3f}") + " |")
    for base, by_arm in summary["comparisons"].items():
        lines += ["", f"## Paired differences: arm − {base} ({pairing}, shared validation steps)", "", *header]
        for arm, comparison in by_arm.items():
            lines += _comparison_rows(arm, comparison, comparison["metrics"], multi)
    if multi:
        lines += ["", f"Confidence intervals: hierarchical percentile bootstrap ({summary['resamples']} resamples, "
                  "seeded): warm checkpoints drawn with replacement, then seeds within each drawn one; the estimate "
                  "is the mean of the warm checkpoints' means. `per warm`: the mean difference on each warm "
                  "checkpoint; `sign on every warm`: every one of them has the overall mean's (non-zero) sign. With "
                  f"{len(summary['per_warm'])} warm checkpoints the interval knows the warm-up's variance only "
                  "from those few: a finding that holds on every warm checkpoint is the stronger statement."]
    else:
        lines += ["", f"Confidence intervals: percentile bootstrap of the mean paired difference over seeds "
                  f"({summary['resamples']} resamples, seeded). With few seeds it is narrow and optimistic: it never "
                  "extends beyond the smallest and largest per-seed difference (with 3 seeds it is exactly that "
                  "range), so 'higher'/'lower' then means only that every seed agreed."]
    if summary.get("at_points"):
        names = list(dict.fromkeys(n for rows in summary["at_points"].values() for n in rows))
        lines += ["", "## pass@j and mode shares at each run's start / validation peak / end (held-out unless a set is named; mean over "
                  "runs)", "", "| arm | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
        for arm, rows in summary["at_points"].items():
            lines.append(f"| {arm} | " + " | ".join(
                " / ".join(f"{rows[n][p]:.3f}" if p in rows.get(n, {}) else "–" for p in POINTS) for n in names) + " |")
    if summary.get("criterion"):
        c = summary["criterion"]
        lines += ["", f"## The plain-GRPO criterion ({c['arm']}): at least {c['min_collapsed']} runs collapse and the "
                  f"held-out share of `{c['general_mode']}` falls, on at least {c['min_warm_checkpoints']} warm "
                  f"checkpoints: " + ({True: "met", False: "NOT met"}.get(c["met"], "not judged here (fewer runs or "
                                              "warm checkpoints than it counts)"))
                  + f" ({c['warm_checkpoints_met']} of {len(c['per_warm'])})", "", f"| warm checkpoint | collapsed | {c['general_mode']} share start → "
                  "end | met |", "|---|---|---|---|"]
        for w, row in c["per_warm"].items():
            lines.append(f"| {w} | {row['collapsed']}/{row['runs']} | {row['share_start']:.3f} → "
                         f"{row['share_end']:.3f} | {'yes' if row['met'] else 'no'} |")
    for alias, choice in (summary.get("selection") or {}).items():
        scores = ", ".join(f"{arm} {score['mean']:.3f}" for arm, score in choice["scores"].items()
                           if score["mean"] is not None)
        lines += ["", f"`{alias}` = `{choice['chosen']}`: the best mean {choice['metric']} among {choice['among']} "
                  f"on tuning seeds {choice['tuning_seeds']} (never reporting seeds): {scores}."]
    lines += ["", f"{summary['runs_executed']} run(s) executed now ({summary['workers']} worker(s)), "
              f"{summary['wall_time_s']:.0f} s."]
    if summary.get("run_time_s") is not None:
        runs = sum(len(s) for s in summary["per_run"].values()) if not multi else sum(
            len(seeds) for by_warm in summary["per_run"].values() for seeds in by_warm.values())
        lines[-1] += (f" All {runs} runs took {summary['run_time_s']:.0f} "
                      "s of run time in all (each run's own wall time, summed; parallel runs overlap).")
    if summary.get("warmups") and not multi:
        record = summary["warmups"][0]
        lines[-1] += (f" Warm checkpoint: warm-up seed {record['seed']}, {record['steps']} steps"
                      + calibration_text(record, target=True) + ".")
    if summary.get("machine"):
        m, times = summary["machine"], [r["wall_time_s"] for r in summary.get("runs", []) if r["wall_time_s"]]
        lines += ["", f"Machine: {m['cpu_model']}, {m['cpu_cores']} cores, {m['torch_threads_per_run']} torch "
                  f"thread(s) per run" + (f"; run wall time {statistics.fmean(times):.0f} s on average "
                                          f"({min(times):.0f}–{max(times):.0f} s, {len(times)} runs)." if times else ".")]
    git = summary.get("git") or {}
    if git.get("commit"):
        lines[-1] += f" Code: commit {git['commit'][:12]}{' (with uncommitted changes)' if git['uncommitted_changes'] else ''}."
    if git.get("preregistration"):
        reg = git["preregistration"]
        lines[-1] += (f" Pre-registration: `{reg['file']}` at commit {reg['commit'] or '(none: not committed)'}"
                      f"{' (with uncommitted changes)' if reg['uncommitted_changes'] else ''}.")
    return "\n".join(lines) + "\n"


def calibration_text(record: dict, target: bool = False) -> str:
    """", calibration avg@4 0.312 (target 0.3)" of a warm-up record; "" for a warm-up that stops after a fixed number
    of steps (the tool agent's), whose start point the runs' step-0 validation measures."""
    if record.get("calibration_avg@4") is None:
        return ""
    return (f", calibration avg@4 {record['calibration_avg@4']:.3f}"
            + (f" (target {record['target_accuracy']})" if target else ""))
