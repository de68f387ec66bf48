"""The carry-mix variant's plain-GRPO criterion on a finished pilot (docs/preregistration/mode_testbed_carry_mix.md):
one row per share and warm checkpoint, and the share the pre-registered rule picks (the largest that meets it).

    python scripts/carry_mix_criterion.py results/carry_mix/pilot [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from armor_trl.app.experiments.runner import read_curves
from armor_trl.app.experiments.stats import carry_mix_criterion
from armor_trl.app.experiments.study import metrics_path


def pilot_criteria(out: Path) -> dict:
    """{arm: criterion} for every arm of the pilot's summary.json that finished all its runs."""
    summary = json.loads((out / "summary.json").read_text())
    warms, seeds = summary["warmup_seeds"], summary["seeds"]
    results = {}
    for arm in summary["arms"]:
        runs = {w: {s: read_curves(metrics_path(out, arm, s, w if len(warms) > 1 else None)) for s in seeds}
                for w in warms}
        results[arm] = carry_mix_criterion(runs)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pilot", type=Path, help="the pilot study's output folder")
    parser.add_argument("--json", type=Path, default=None, help="also write the criteria here")
    args = parser.parse_args(argv)
    criteria = pilot_criteria(args.pilot)
    print("| share arm | warm checkpoint | held-out avg@16 start → end | train-carry `carrying` start → end | met |")
    print("|---|---|---|---|---|")
    for arm, result in criteria.items():
        for warm, w in result["per_warm"].items():
            print(f"| {arm} | {warm} | {w['val_start']:.3f} → {w['val_end']:.3f}{'' if w['val_falls'] else ' (no)'} | "
                  f"{w['share_start']:.3f} → {w['share_end']:.3f}{'' if w['share_falls'] else ' (no)'} | "
                  f"{'yes' if w['met'] else 'no'} |")
    met = [arm for arm, result in criteria.items() if result["met"]]
    print(f"\nmet (on >= 2 of 3 warm checkpoints): {met or 'none'}")
    print(f"chosen (the largest share that meets it): {max(met, key=lambda a: float(a.split('_')[-1])) if met else 'none'}")
    if args.json:
        args.json.write_text(json.dumps(criteria, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
