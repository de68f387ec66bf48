"""From raw runs to numbers: per-variant medians and ranges, ratios to the baselines paired by repetition, targets."""

from __future__ import annotations

import statistics

from benchmarks import anchor_work
from benchmarks.config import BenchConfig
from benchmarks.instruments import PARTS, WORK

# logged metrics averaged over the measured steps in the summary
SUMMARY_METRICS = (
    "armor/anchor_found_frac", "armor/anchor_cache_hit_frac", "completions/mean_length",
    "armor/generation_rounds", "armor/groups_kept_frac", "armor/anchor_same_call",
)


def stats(values: list) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "n": 0}
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "min": values[0], "max": values[-1], "q1": q[0], "q3": q[2],
            "n": len(values)}


def _measured(run: dict, warmup: int) -> list:
    return run["steps"][warmup:] or run["steps"][-1:]


def summarize(runs: list, warmup: int, bench: BenchConfig) -> dict:
    by_variant: dict = {}
    for run in runs:
        by_variant.setdefault(run["config"], []).append(run)
    summary = {name: _entry(bench.variants[name], variant_runs, warmup) for name, variant_runs in by_variant.items()}
    for name, entry in summary.items():
        for base in bench.baselines:
            if base in summary:
                entry["vs_" + base] = _ratios(entry, summary[base], by_variant[name], by_variant[base])
    anchor_work.with_ratios(summary, bench)
    return summary


def _entry(variant, runs: list, warmup: int) -> dict:
    """One variant's summary over its repetitions (each run's median over its measured steps first)."""
    per_run_step, per_run_cpu, pooled = [], [], []
    per_run_split, per_run_split_cpu = {p: [] for p in PARTS}, {p: [] for p in PARTS}
    no_candidate_steps, measured_count = [], 0
    for run in runs:
        measured = _measured(run, warmup)
        measured_count += len(measured)
        step_times = [s["step_s"] for s in measured]
        pooled += step_times
        run["median_step_s"] = statistics.median(step_times)
        run["median_cpu_s"] = statistics.median(s["cpu_s"] for s in measured)
        per_run_step.append(run["median_step_s"])
        per_run_cpu.append(run["median_cpu_s"])
        for part in PARTS:
            per_run_split[part].append(statistics.median(s["split"].get(part, 0.0) for s in measured))
            per_run_split_cpu[part].append(statistics.median(s["split_cpu"].get(part, 0.0) for s in measured))
        if variant.armor:  # steps in which every group's anchor came from the cache: no reference generate call
            no_candidate_steps += [s["step_s"] for s in measured if s["raw"].get("anchor_generate", 0.0) == 0.0]
    entry = {
        "description": variant.description,
        "measured_steps": measured_count,
        "step_s": stats(per_run_step),
        "cpu_s": stats(per_run_cpu),
        "step_s_pooled": stats(pooled),
        # mean over every measured step: the throughput figure (cache steps are bimodal: with/without a call)
        "step_s_mean": statistics.mean(pooled),
        "cpu_s_mean": statistics.mean(s["cpu_s"] for r in runs for s in _measured(r, warmup)),
        "split_s": {p: statistics.median(v) for p, v in per_run_split.items()},
        "split_cpu_s": {p: statistics.median(v) for p, v in per_run_split_cpu.items()},
        "peak_rss_mb": stats([r["peak_rss_mb"] for r in runs]),
        "rss_growth_mb": stats([r["peak_rss_mb"] - r["rss_start_mb"] for r in runs]),
        "trainable_params": runs[0]["trainable_params"],
    }
    step_median = entry["step_s"]["median"]
    entry["split_share"] = {p: v / step_median for p, v in entry["split_s"].items()} if step_median else {}
    if variant.armor:
        entry["steps_without_candidate_generation"] = {
            "share": len(no_candidate_steps) / measured_count,
            "median_step_s": statistics.median(no_candidate_steps) if no_candidate_steps else None,
        }
    resets = [t for r in runs for t in r.get("reset_s", [])]
    if resets:
        entry["reset_s"] = stats(resets)
        entry["reset_over_step"] = entry["reset_s"]["median"] / step_median
        entry["reset_kind"] = runs[0]["reset_kind"]
        entry["reset_params"] = runs[0]["reset_params"]
    done = work_per_step(runs, lambda run: warmup)
    if done is not None:
        entry["work"] = done
    work = anchor_work.summarize(runs, lambda run: warmup)
    if work is not None:
        entry["anchor_work"] = work
    for key in SUMMARY_METRICS:
        values = [v for r in runs for v in r.get("metrics", {}).get(key, [])[warmup:]]
        if values:
            entry.setdefault("metrics", {})[key] = statistics.mean(values)
    whatif = [r["whatif_merged_generation"] for r in runs if "whatif_merged_generation" in r]
    if whatif:
        entry["whatif_merged_generation"] = {
            "separate_s": statistics.median(w["separate_s"] for w in whatif),
            "merged_s": statistics.median(w["merged_s"] for w in whatif),
            "rows": whatif[0]["rows"],
        }
    rows = [r["whatif_generate_rows"] for r in runs if "whatif_generate_rows" in r]
    if rows:
        entry["whatif_generate_rows"] = {n: statistics.median(r[n] for r in rows) for n in rows[0]}
    return entry


def _paired(runs: list, base_runs: list, key: str) -> dict:
    """Spread of the per-repetition ratios (each run over the baseline's run of the same round)."""
    ratios = []
    for run in runs:
        partner = [r for r in base_runs if r["rep"] == run["rep"]]
        if partner:
            ratios.append(run[key] / partner[0][key])
    return stats(ratios)


def _ratios(entry: dict, base: dict, runs: list, base_runs: list) -> dict:
    """Ratios of medians (and of means) to a baseline, with the paired per-repetition spread."""
    return {
        "step": entry["step_s"]["median"] / base["step_s"]["median"],
        "step_paired": _paired(runs, base_runs, "median_step_s"),
        "cpu": entry["cpu_s"]["median"] / base["cpu_s"]["median"],
        "step_mean": entry["step_s_mean"] / base["step_s_mean"],
        "cpu_mean": entry["cpu_s_mean"] / base["cpu_s_mean"],
        "cpu_paired": _paired(runs, base_runs, "median_cpu_s"),
        "rss": entry["peak_rss_mb"]["median"] / base["peak_rss_mb"]["median"],
        "rss_paired": _paired(runs, base_runs, "peak_rss_mb"),
        "rss_growth": entry["rss_growth_mb"]["median"] / base["rss_growth_mb"]["median"],
    }


def check_targets(summary: dict, bench: BenchConfig) -> list:
    rows = []
    for target in bench.targets:
        if target.variant not in summary or target.base not in summary:
            continue
        cpu = mean = spread = None
        if target.quantity == "lora_reset":
            value = summary[target.variant].get("reset_over_step")
        else:
            ratios = summary[target.variant]["vs_" + target.base]
            value = ratios[target.quantity]
            spread = [ratios[target.quantity + "_paired"]["min"], ratios[target.quantity + "_paired"]["max"]]
            if target.quantity == "step":
                cpu, mean = ratios["cpu"], ratios["step_mean"]
        below = value < target.bound if target.quantity == "lora_reset" else value <= target.bound
        met = None if value is None else bool(below)
        rows.append({"target": target.label, "bound": target.bound, "measured": value, "paired_min_max": spread,
                     "measured_cpu_time": cpu, "measured_mean_step": mean, "met": met})
    return rows


def anchor_break_even(summary: dict, pregeneration: dict | None, batch: int, g: int, prompts: int) -> dict | None:
    """After how many epochs the bulk pass costs less than armor_full's online anchor sampling."""
    if pregeneration is None or "armor_full" not in summary:
        return None
    split = summary["armor_full"]["split_s"]
    online_per_step = split["anchor_gen"] + split["anchor_score"]
    steps_per_epoch = prompts / (batch // g)
    per_epoch = online_per_step * steps_per_epoch
    return {"bulk_s": pregeneration["seconds"], "online_anchor_s_per_step": online_per_step,
            "online_anchor_s_per_epoch": per_epoch,
            "break_even_epochs": pregeneration["seconds"] / per_epoch if per_epoch else None}


def work_per_step(runs: list, warmup_steps_of) -> dict | None:
    """The generate calls and log-prob rows (instruments.WORK) per optimizer step: each run's mean over its measured
    steps, median over repetitions (None: runs recorded before the bench counted them)."""
    per_run = []
    for run in runs:
        steps = run["steps"][warmup_steps_of(run):] or run["steps"][-1:]
        if steps and all("work" in step for step in steps):
            # (runs recorded before the bench counted policy rows lack them: 0)
            per_run.append({key: statistics.mean(step["work"].get(key, 0) for step in steps) for key in WORK})
    if not per_run:
        return None
    return {key: statistics.median(run[key] for run in per_run) for key in WORK}


def work_table(entries: dict, title: str, m_of=False) -> list:
    """Markdown lines: per variant (and M), the generate calls, candidate rows and log-prob rows per optimizer step."""
    f = lambda v, d=2: "—" if v is None else f"{v:.{d}f}"  # noqa: E731
    rows = []
    for name, entry in entries.items():
        for m, e in (entry.items() if m_of else [(None, entry)]):
            done, anchors = e.get("work"), e.get("anchor_work") or {}
            if not done:
                continue
            rows.append(f"| {name} | {'' if m is None else m + ' | '}{f(done['policy_calls'])} | "
                        f"{f(done['policy_rows'], 1)} | {f(done['anchor_calls'])} | {f(anchors.get('candidate_rows_per_step'), 1)} | "
                        f"{f(anchors.get('deferred_groups_per_step'))} | {f(done['logp_rows'], 1)} |")
    if not rows:
        return []
    return ["", title, "",
            "| config | " + ("M | " if m_of else "") + "policy generate calls / opt step | policy rows / opt step | "
            "anchor generate calls / opt step | candidate rows / opt step | deferred groups / opt step | log-prob rows "
            "/ opt step |",
            "|---|" + ("---|" if m_of else "") + "---|---|---|---|---|---|", *rows]
