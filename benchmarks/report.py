"""The printed report (bench.md) and the files of a bench run (bench.json, bench.md)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import anchor_work, regime
from benchmarks.config import BenchConfig
from benchmarks.instruments import PARTS
from benchmarks.summary import work_table


def _fmt(value, digits=2, suffix=""):
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def _header(meta: dict) -> list:
    load = lambda xs: "/".join(f"{x:.2f}" for x in xs)  # noqa: E731
    return [
        f"# ARMOR vs GRPO benchmark ({meta['mode']})",
        "",
        f"Tiny Llama hidden={meta['hidden']} layers={meta['layers']}, G={meta['g']}, K={meta['k']}, "
        f"{meta['batch']} rows/step ({meta['batch'] // meta['g']} groups), {meta['prompts']} distinct prompts, "
        f"max_completion_length={meta['completion']}, {meta['steps']} steps per run ({meta['warmup']} warm-up), "
        f"{meta['reps']} repetition(s) round-robin, one process per run, torch threads={meta['threads']}, "
        f"anchor_reward_threshold={meta['threshold']:.3f} (calibrated: {meta['calibration_found_frac']:.2f} of groups "
        f"find an anchor at start). Load average (1/5/15 min) before {load(meta['load_before'])}, after "
        f"{load(meta['load_after'])}, on {meta['cpus']} CPUs ({meta.get('cpu_model', 'CPU model not recorded')}); "
        f"wall {meta['wall_s']:.0f} s. A run is repeated (up to {meta.get('load_retries', 0)} time(s)) when the 1-min "
        f"load before or after it exceeds {meta.get('max_load', float('nan')):.1f}.",
        "",
    ]


def _step_table(summary: dict, base: str, lora_base: str) -> list:
    lines = [
        "Step time: median over repetitions of each run's median s/step after warm-up [min–max over repetitions]; "
        "all steps: median [IQR] of every measured step of every repetition; ratios: ratio of medians (min–max of "
        "the per-repetition ratios, paired by round). CPU: ratio of process CPU time per step (less sensitive to load).",
        "",
        f"| config | s/step [min–max] | all steps: median [IQR], mean | × {base} (paired) | CPU × {base} | "
        f"× {lora_base} | peak RSS MB | × RSS | RSS growth MB | anchors found | cache hits | reset (share of step) | "
        "generation rounds/step (dynamic sampling) | groups kept |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in summary.items():
        s, v, vl, m = e["step_s"], e.get("vs_" + base, {}), e.get("vs_" + lora_base, {}), e.get("metrics", {})
        pool, sp = e["step_s_pooled"], v.get("step_paired", {})
        reset = f"{e['reset_s']['median'] * 1e3:.2f} ms ({e['reset_over_step'] * 100:.3f}%)" if "reset_s" in e else "—"
        lines.append(
            f"| {name} | {_fmt(s['median'], 3)} [{_fmt(s['min'], 3)}–{_fmt(s['max'], 3)}] | "
            f"{_fmt(pool['median'], 3)} [{_fmt(pool['q1'], 3)}–{_fmt(pool['q3'], 3)}], {_fmt(e['step_s_mean'], 3)} | "
            f"{_fmt(v.get('step'))} ({_fmt(sp.get('min'))}–{_fmt(sp.get('max'))}) | {_fmt(v.get('cpu'))} | "
            f"{_fmt(vl.get('step'))} | {_fmt(e['peak_rss_mb']['median'], 0)} | {_fmt(v.get('rss'), 3)} | "
            f"{_fmt(e['rss_growth_mb']['median'], 0)} | {_fmt(m.get('armor/anchor_found_frac'))} | "
            f"{_fmt(m.get('armor/anchor_cache_hit_frac'))} | {reset} | {_fmt(m.get('armor/generation_rounds'))} | "
            f"{_fmt(m.get('armor/groups_kept_frac'))} |"
        )
    return lines


def _pregeneration(meta: dict) -> list:
    lines, pre, even = [], meta.get("pregeneration"), meta.get("anchor_break_even")
    if pre:
        lines += ["", f"Column anchors (`armor-trl anchors` code, before the runs): {pre['prompts']} prompts x "
                  f"{pre['num_candidates']} candidates in {pre['seconds']:.2f} s = {pre['prompts_per_s']:.1f} prompts/s, "
                  f"{pre['share_with_anchor']:.0%} of prompts with an anchor."]
    if even and even["break_even_epochs"] is not None:
        lines.append(f"armor_full samples anchors online for {even['online_anchor_s_per_step']:.3f} s/step = "
                     f"{even['online_anchor_s_per_epoch']:.2f} s per epoch over the prompts: the bulk pass pays for "
                     f"itself after {even['break_even_epochs']:.2f} epoch(s).")
    return lines


def _split_table(summary: dict) -> list:
    lines = ["", "Time split, median seconds per step (share of the median step):", "",
             "| config | " + " | ".join(PARTS) + " |", "|---|" + "---|" * len(PARTS)]
    for name, e in summary.items():
        cells = [f"{e['split_s'][p]:.3f} ({e['split_share'].get(p, 0) * 100:.0f}%)" for p in PARTS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _targets_table(meta: dict, targets: list) -> list:
    lines = ["", f"Targets (tiny model, G={meta['g']}, K={meta['k']}):", "",
             "| target | measured (ratio of medians) | paired min–max | CPU-time ratio | ratio of mean steps | met |",
             "|---|---|---|---|---|---|"]
    for t in targets:
        spread = "—" if not t["paired_min_max"] else f"{_fmt(t['paired_min_max'][0], 3)}–{_fmt(t['paired_min_max'][1], 3)}"
        met = {True: "yes", False: "**no**", None: "—"}[t["met"]]
        lines.append(f"| {t['target']} | {_fmt(t['measured'], 4)} | {spread} | {_fmt(t['measured_cpu_time'], 3)} | "
                     f"{_fmt(t.get('measured_mean_step'), 3)} | {met} |")
    return lines


def _notes(meta: dict, summary: dict, bench: BenchConfig) -> list:
    notes, base = [], bench.baseline
    for name, e in summary.items():
        skip = e.get("steps_without_candidate_generation")
        if skip and e.get("metrics", {}).get("armor/anchor_cache_hit_frac") is not None:
            failures = bench.variants[name].args.get("anchor_cache_failures")
            notes.append(
                f"- {name}: {skip['share'] * 100:.0f}% of measured steps needed no reference generate call (every group "
                f"was a cache hit{' or a remembered failure' if failures else ''}); their median step "
                f"{_fmt(skip['median_step_s'], 3)} s"
                + (f" = {skip['median_step_s'] / summary[base]['step_s']['median']:.2f} × {base}."
                   if skip["median_step_s"] and base in summary else ".")
            )
    rows = next((e["whatif_generate_rows"] for e in summary.values() if "whatif_generate_rows" in e), None)
    if rows:
        notes.append(
            "- generate time vs rows (policy model, full length): "
            + ", ".join(f"{n} rows {t:.3f} s" for n, t in rows.items())
            + " — a second generate call for the K·groups reference candidates costs about as much as the policy's."
        )
    whatif = next((e["whatif_merged_generation"] for e in summary.values() if "whatif_merged_generation" in e), None)
    if whatif:
        notes.append(
            f"- what-if (LoRA): policy {whatif['rows'][0]} rows + reference {whatif['rows'][1]} rows as two generate "
            f"calls {whatif['separate_s']:.3f} s vs one mixed-adapter call (PEFT adapter_names) {whatif['merged_s']:.3f} s "
            f"(full length, {meta['completion']} tokens)."
        )
    return ["", "Notes:", "", *notes] if notes else []


def format_report(result: dict, bench: BenchConfig) -> str:
    meta, summary = result["meta"], result["summary"]
    if not summary:  # --no-main: the regime runs only
        return "\n".join(_header(meta) + regime.table(result["regime"], bench)) + "\n"
    lines = (
        _header(meta) + _step_table(summary, bench.baseline, bench.lora_baseline) + _pregeneration(meta)
        + _split_table(summary) + _targets_table(meta, result["targets"])
        + work_table(summary, "Work per optimizer step (mean over the measured steps, median over repetitions): "
                     "generate calls for the policy's rows and for anchor candidates, candidate rows, groups drawn "
                     "after the refill loop, rows of the log-prob passes made while batches are built:")
        + anchor_work.table(summary, "Anchor candidates per optimizer step (over the measured steps, median over "
                            f"repetitions; mixed-share knob: {meta.get('mixed_share')}):")
        + anchor_work.targets_table(result.get("anchor_work_targets") or [])
        + _notes(meta, summary, bench)
    )
    if "regime" in result:
        lines += regime.table(result["regime"], bench)
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path, bench: BenchConfig) -> str:
    """Write ``bench.json`` and ``bench.md`` to ``out``; return the report."""
    report = format_report(result, bench)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "bench.md").write_text(report)
    return report
