"""The offline demo: plain GRPO collapsing on the CPU testbed, next to GRPO + KL, GRPO at a lower lr and ARMOR.

``make demo`` / ``armor-trl demo`` runs ``armor-trl study`` (:mod:`.study`) on ``configs/collapse_testbed.yaml`` with
the arms ``grpo`` (β = 0), ``grpo_kl_0.1`` (reverse KL, β = 0.1), ``grpo_small_lr`` (β = 0 at lr × α, the control
for ARMOR's mixture scaling on-policy steps by α) and ``armor``, 3 seeds each: the tiny character-level Llama is
warm-started once (cached), the 12 runs of 1200 steps share the CPU cores, and the folder gets per-run metrics,
``summary.md`` / ``summary.json`` with paired bootstrap CIs, and ``curves.png`` / ``kl.png`` / ``reference.png``
(mean ± std bands over seeds). A rerun reuses finished runs. The 5-seed study with more arms and its verdict is
``docs/evidence.md``.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import stats, study

DEFAULT_CONFIG = study.CONFIGS / "collapse_testbed.yaml"
ARMS = ("grpo", "grpo_kl_0.1", "grpo_small_lr", "armor")
SEEDS = 3
LABELS = {"grpo": "GRPO (β=0)", "grpo_kl_0.1": "GRPO + KL (β=0.1)", "grpo_small_lr": "GRPO, lr × α",
          "armor": "ARMOR"}
FULL_STUDY = ("docs/evidence.md", "armor-trl study --config configs/collapse_testbed.yaml "
              "--arms grpo,grpo_small_lr,grpo_kl_0.1,armor,armor_reset_50,guard_armor,guard_grpo --seeds 5")
COLUMNS = ("start", "peak", "final", "min_after_peak", "auc", "final_train_reward", "collapsed")


def run_demo(config: str | None = None, output_dir: str = "results/demo", seeds: int = SEEDS, smoke: bool = False,
             workers: int | None = None) -> Path:
    """Run (or finish) the demo study in ``<output_dir>/<recipe name>``; print its headline; return the folder."""
    config_path = Path(config) if config else DEFAULT_CONFIG
    out = Path(output_dir) / (config_path.stem + ("-smoke" if smoke else ""))
    folder = study.run_study(str(config_path), list(ARMS), seeds, workers, str(out), smoke, verbose=False)
    print("\n" + format_demo(json.loads((folder / "summary.json").read_text())))
    return folder


def _cell(value: dict | None) -> str:
    if value is None:
        return "–"
    if "count" in value:
        return f"{value['count']}/{value['n']}"
    return f"{value['mean']:.3f}" + (f" ± {value['std']:.3f}" if value["n"] > 1 else "")


def format_demo(summary: dict) -> str:
    """The demo's headline from a study summary: the per-arm table, the paired final / AUC differences with their
    95% CIs, and where the details and the full study are."""
    ev, seeds, out = summary["evaluation"], summary["seeds"], summary["out"]
    lines = [f"Collapse testbed, {len(seeds)} seeds ({', '.join(map(str, seeds))}); mean ± std over seeds. "
             f"Validation: {ev['metric']} on {ev['problems']} held-out problems × {ev['samples']} samples."]
    for warm in summary.get("warmups") or []:  # which warm checkpoint this machine built (its float path differs)
        lines.append(f"Warm checkpoint (warm-up seed {warm['seed']}): {warm['steps']} supervised steps, calibration "
                     f"avg@4 {warm['calibration_avg@4']:.3f} (target {warm['target_accuracy']}); another CPU model may "
                     "build another one, and the numbers below move with it (docs/evidence.md gives the spread).")
    if summary.get("machine"):
        lines.append(f"Machine: {summary['machine']['cpu_model']}, {summary['machine']['cpu_cores']} cores.")
    lines += ["",
             "| method | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for arm, row in summary["table"].items():
        lines.append(f"| {LABELS.get(arm, arm)} | " + " | ".join(_cell(row.get(c)) for c in COLUMNS) + " |")
    for base, by_arm in summary["comparisons"].items():
        parts = []
        for arm, comparison in by_arm.items():
            for metric in ("final", "auc"):
                result = comparison["metrics"][metric]
                if result["ci"] is not None:
                    low, high = result["ci"]
                    parts.append(f"  {LABELS.get(arm, arm)} {metric}: {result['mean']:+.3f} [{low:+.3f}, {high:+.3f}] "
                                 f"({result['verdict']})")
        if parts:
            lines += ["", f"Paired difference vs {LABELS.get(base, base)} (same seed), 95% bootstrap CI:", *parts]
    if "se_binomial" in ev:
        lines += ["", f"One evaluation's sampling standard error ≤ {ev['se_binomial']:.4f}. `collapsed`: final "
                  f"≥ {stats.COLLAPSE_DROP} below the peak and below the start while training reward rose."]
    lines += ["", f"Details (every paired metric, plots with bands): {out}/summary.md, {out}/curves.png, kl.png, "
              "reference.png",
              f"The full study (5 seeds, more arms, verdict): {FULL_STUDY[0]} — rerun with `{FULL_STUDY[1]}`",
              f"{summary['runs_executed']} run(s) trained now, {summary['wall_time_s']:.0f} s."]
    return "\n".join(lines)
