"""``armor-trl study``: arms × seeds of one recipe, resumable, with paired bootstrap CIs and plots; this module parses its
flags and hands them to :func:`armor_trl.app.experiments.study.run_study`."""

from __future__ import annotations

import sys

from armor_trl.app.cli.common import ArgumentParser, add_output_dir


def study_main(argv: list[str]) -> int:
    from armor_trl.app.experiments import study

    parser = ArgumentParser(prog="armor-trl study", description=study.__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="Recipe (default: configs/tiny_demo.yaml).")
    parser.add_argument("--arms", default=None, help="Comma-separated arm names (default: the arms file's 'default').")
    parser.add_argument("--seeds", type=int, default=None, help="Seeds per arm (default: study.seeds, else 3).")
    parser.add_argument("--workers", type=int, default=None, help="Parallel runs (default: one per CPU core).")
    add_output_dir(parser, "Study folder (default: results/study/<recipe name>); rerunning the same command there "
                   "resumes it, skipping finished runs.", old=("--out",))
    parser.add_argument("--arms_file", default=None, help="Arm definitions (default: configs/study/arms.yaml).")
    parser.add_argument("--resamples", type=int, default=10_000, help="Bootstrap resamples of the paired CIs.")
    parser.add_argument("--baselines", default=None, help="Comma-separated arms every other arm is paired with "
                        f"(default: {','.join(study.BASELINES)}; those that ran).")
    parser.add_argument("--smoke", action="store_true", help="The recipe's demo.smoke settings: runs in seconds.")
    parser.add_argument("--warmup_seeds", default=None, help="Comma-separated warm-up seeds, one warm checkpoint each "
                        "(default: study.warmup_seeds, else the recipe's demo.warmup.seed alone); with several, "
                        "metrics/<arm>-warm<w>-seed<s>.jsonl and hierarchical bootstrap CIs.")
    parser.add_argument("--tuning_seeds", default=None, help="Comma-separated seeds on which a study.select alias "
                        "picks its arm (default: study.tuning_seeds); must not overlap the reporting seeds.")
    parser.add_argument("--primary", default=None, help="Primary comparisons, arm:baseline,... (default: "
                        "study.primary); reported first, on final, auc and min_after_peak.")
    parser.add_argument("--preregister", default=None, help="A pre-registration file: summary.json records its last "
                        "git commit next to the repository's.")
    args = parser.parse_args(argv)
    names = lambda text: [a.strip() for a in text.split(",") if a.strip()] if text else None  # noqa: E731
    try:
        study.run_study(args.config, names(args.arms), args.seeds, args.workers, args.output_dir, args.smoke,
                        args.arms_file, args.resamples, baselines=names(args.baselines),
                        warmup_seeds=args.warmup_seeds, tuning_seeds=args.tuning_seeds, primary=args.primary,
                        preregister=args.preregister)
    except (ValueError, FileExistsError) as error:
        print(f"armor-trl study: error: {error}", file=sys.stderr)
        return 2
    return 0
