"""The paper's update regime (issue 20): M optimizer steps per rollout batch, reported as cost per optimizer step.

A regime run trains with TRL's ``steps_per_generation = M`` (rollout batch = M mini-batches of ``batch`` rows,
``generation_batch_size = M x batch``), for whole rollout batches: ``warmup_cycles`` not measured, then enough to
measure at least ``measured_steps`` optimizer steps. Its cost per optimizer step is the mean over the measured
steps, so that each rollout (generation, anchors, log-prob forwards) is spread over its M steps. Every M trains on
the same prompts: as many as the largest rollout batch holds (TRL's sampler needs a full batch of distinct prompts).
"""

from __future__ import annotations

import math
import statistics

from benchmarks import anchor_work, floor
from benchmarks.config import BenchConfig
from benchmarks.instruments import PARTS
from benchmarks.summary import stats, work_per_step, work_table

# phases shown in the regime table (seconds per optimizer step); ref_fwd here also holds the old-policy log-probs
# that TRL computes during the rollout when M > 1
TABLE_PARTS = ("policy_gen", "anchor_gen", "anchor_score", "ref_fwd", "loss_bwd", "push_ref", "push_policy")


def plan(bench: BenchConfig, preset: dict, variants: list, mini_batches: list, shape: dict, g: int) -> dict | None:
    """What the regime runs: variants (those of the run that the regime lists), M values, steps and prompts."""
    settings = preset.get("regime")
    names = [name for name in bench.regime["variants"] if name in variants]
    if not settings or not names or not mini_batches:
        return None
    groups = shape["batch"] // g
    return {
        "variants": names, "mini_batches": list(mini_batches), "reps": settings["reps"],
        "warmup_cycles": settings["warmup_cycles"], "measured_steps": settings["measured_steps"],
        "prompts": max(shape["prompts"], groups * max(mini_batches)), "batch": shape["batch"],
    }


def runs_of(regime: dict) -> list:
    """(variant, M, steps, warm-up steps) of one repetition, in schedule order."""
    out = []
    for name in regime["variants"]:
        for m in regime["mini_batches"]:
            cycles = regime["warmup_cycles"] + math.ceil(regime["measured_steps"] / m)
            out.append((name, m, cycles * m, regime["warmup_cycles"] * m))
    return out


def summarize(runs: list, bench: BenchConfig, g: int, batch: int) -> dict:
    """Per variant and M: cost per optimizer step (median over repetitions [min–max]), its split, peak RSS, ratios to
    the baselines at the same M (ratio of medians, paired by repetition) and, inside DAPO's loop, ARMOR's floor
    (``g`` rows per group, ``batch`` rows per optimizer step)."""
    groups: dict = {}
    for run in runs:
        run["cost_per_step_s"] = statistics.mean(s["step_s"] for s in run["steps"][run["warmup_steps"]:])
        groups.setdefault((run["config"], run["mini_batches"]), []).append(run)
    summary: dict = {}
    for (name, m), group in groups.items():
        measured = [run["steps"][run["warmup_steps"]:] for run in group]
        summary.setdefault(name, {})[str(m)] = {
            "cost_per_step_s": stats([run["cost_per_step_s"] for run in group]),
            "split_s": {p: statistics.median(statistics.mean(s["split"].get(p, 0.0) for s in steps) for steps in measured)
                        for p in PARTS},
            "peak_rss_mb": stats([run["peak_rss_mb"] for run in group]),
            "measured_steps": len(measured[0]),
            "load": stats([max(run["load"]) for run in group if "load" in run] or [math.nan]),
            "repeated_runs": sum(len(run.get("load_attempts", [])) > 1 for run in group),
        }
        done = work_per_step(group, lambda run: run["warmup_steps"])
        if done is not None:
            summary[name][str(m)]["work"] = done
        work = anchor_work.summarize(group, lambda run: run["warmup_steps"])
        if work is not None:
            summary[name][str(m)]["anchor_work"] = work
    for m in {m for by_m in summary.values() for m in by_m}:
        anchor_work.with_ratios({name: by_m[m] for name, by_m in summary.items() if m in by_m}, bench)
    bases = bench.baselines + ((bench.loop_floor["base"],) if bench.loop_floor else ())  # (× grpo_dynamic: the loop)
    bases += tuple(dict.fromkeys(t["base"] for t in bench.regime.get("targets", []) if t["base"] not in bases))
    for name, by_m in summary.items():
        for m, entry in by_m.items():
            for base in bases:
                if base in summary and m in summary[base]:
                    entry["vs_" + base] = _ratios(groups[(name, int(m))], groups[(base, int(m))])
    floor.add(summary, runs, bench, g, batch)
    return summary


def check_targets(summary: dict, bench: BenchConfig) -> list:
    """The regime's targets (bench.yaml regime.targets): per (variant, M) the ratio of medians and its paired range, or
    (quantity floor) a loop variant's measured / floor."""
    rows = []
    for target in bench.regime.get("targets", []):
        variant, base, quantity = target["variant"], target["base"], target["quantity"]
        by_m = summary.get(variant, {})
        ms = list(by_m) if target["m"] == "all" else [str(target["m"])]
        for m in ms:
            if quantity == "floor":  # measured / floor of a loop variant (its base: the floor's, grpo_dynamic)
                value = (by_m.get(m, {}).get("floor") or {}).get("measured_over_floor")
                if value is not None:
                    rows.append({"target": f"{variant} measured / floor at M={m} <= {target['bound']:.2f}",
                                 "measured": value, "paired_min": None, "paired_max": None,
                                 "met": value <= target["bound"]})
                continue
            ratios = by_m.get(m, {}).get("vs_" + base)
            if ratios is None:
                continue
            paired = ratios[quantity + "_paired"]
            rows.append({"target": f"{quantity} {variant} / {base} at M={m} <= {target['bound']:.2f}",
                         "measured": ratios[quantity], "paired_min": paired["min"], "paired_max": paired["max"],
                         "met": ratios[quantity] <= target["bound"]})
    return rows


def _ratios(runs: list, base_runs: list) -> dict:
    def median(rs, key):
        return statistics.median(r[key] for r in rs)

    def paired(key):
        by_rep = {r["rep"]: r for r in base_runs}
        return stats([r[key] / by_rep[r["rep"]][key] for r in runs if r["rep"] in by_rep])

    return {
        "step": median(runs, "cost_per_step_s") / median(base_runs, "cost_per_step_s"),
        "step_paired": paired("cost_per_step_s"),
        "rss": median(runs, "peak_rss_mb") / median(base_runs, "peak_rss_mb"),
        "rss_paired": paired("peak_rss_mb"),
    }


def table(regime: dict, bench: BenchConfig) -> list:
    """Markdown lines of the regime table."""
    meta, summary = regime["meta"], regime["summary"]
    base, lora = bench.baseline, bench.lora_baseline
    f = lambda v, d=2: "—" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [
        "",
        f"Regime: cost per optimizer step with M mini-batches of {meta['batch']} rows per rollout batch "
        f"(steps_per_generation = M): mean over whole rollout batches (at least {meta['measured_steps']} optimizer "
        f"steps) after {meta['warmup_cycles']} warm-up rollout batch(es), median over {meta['reps']} repetition(s) "
        f"[min–max]; ratios at the same M, paired by repetition; {meta['prompts']} prompts. Phases in s per optimizer "
        "step (ref_fwd includes the old-policy log-probs TRL computes when M > 1; same-call rounds reuse those as "
        "π_ref's and sample the candidates inside policy_gen). load: median over repetitions of the highest 1-min "
        "load average seen before or after the run.",
        "",
        f"| config | M | s/opt step [min–max] | × {base} (paired) | × {lora} (paired) | × RSS {base} | "
        + " | ".join(TABLE_PARTS) + " | load |",
        "|---|---|---|---|---|---|" + "---|" * len(TABLE_PARTS) + "---|",
    ]
    for name, by_m in summary.items():
        for m, e in by_m.items():
            c, v, vl = e["cost_per_step_s"], e.get("vs_" + base, {}), e.get("vs_" + lora, {})
            load = e.get("load", {}).get("median")
            lines.append(
                f"| {name} | {m} | {f(c['median'], 3)} [{f(c['min'], 3)}–{f(c['max'], 3)}] | {_ratio_cell(v)} | "
                f"{_ratio_cell(vl)} | {f(v.get('rss'), 3)} | "
                + " | ".join(f"{e['split_s'][p]:.3f}" for p in TABLE_PARTS) + f" | {f(load)} |"
            )
    lines += work_table(summary, "Work per optimizer step at each M (same runs; mean over the measured steps, median "
                        "over repetitions): TRL's generate calls for the policy's rows (one per generation round), "
                        "generate calls for anchor candidates (lazy: one per wave), candidate rows, groups drawn after "
                        "the refill loop, and rows of the log-prob passes made while batches are built (π_old's, "
                        "π_ref's):", m_of=True)
    lines += anchor_work.table(summary, "Anchor candidates per optimizer step at each M (same runs; over the measured "
                               "steps, median over repetitions):", m_of=True)
    lines += anchor_work.targets_table(regime.get("anchor_work_targets") or [])
    lines += floor.table(summary)
    targets = regime.get("targets") or []
    if targets:
        lines += ["", "Regime targets (ratio of medians; paired range over repetitions):", "",
                  "| target | measured | paired range | met |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {t['measured']:.3f} | "
                  + ("—" if t["paired_min"] is None else f"{t['paired_min']:.3f}–{t['paired_max']:.3f}") + " | "
                  f"{'yes' if t['met'] else 'NO'} |" for t in targets]
    return lines


def _ratio_cell(ratios: dict) -> str:
    if not ratios:
        return "—"
    paired = ratios["step_paired"]
    return f"{ratios['step']:.2f} ({paired['min']:.2f}–{paired['max']:.2f})"


def anchor_work_targets(summary: dict, bench: BenchConfig, mixed_share: float | None) -> list:
    """Issue 36's count targets at every M measured."""
    rows = []
    for m in sorted({m for by_m in summary.values() for m in by_m}, key=int):
        rows += anchor_work.check_targets({name: by_m[m] for name, by_m in summary.items() if m in by_m}, bench,
                                          mixed_share, f" at M={m}")
    return rows
