"""The ``armor-trl`` command: ``train``, ``eval``, ``demo`` and ``study`` (see :mod:`armor_trl.app.experiments`),
``anchors`` (the library behind it is :mod:`armor_trl.data.pregenerate`). This is the CLI layer, with
:mod:`armor_trl.app.recipe` and the experiments: library modules never import it (tests/test_layers.py). Every command
that writes files takes ``--output_dir``; earlier spellings stay as hidden, deprecated aliases.

One module per subcommand (:mod:`.train`, :mod:`.eval`, :mod:`.anchors`, :mod:`.demo`, :mod:`.study`) and what they
share (:mod:`.common`); this package holds the usage text and the dispatch, :func:`main`.
"""

from __future__ import annotations

import sys

from armor_trl.app.cli.anchors import anchors_main
from armor_trl.app.cli.demo import demo_main
from armor_trl.app.cli.eval import eval_main
from armor_trl.app.cli.study import study_main
from armor_trl.app.cli.train import train_main

COMMANDS = {"train": train_main, "eval": eval_main, "demo": demo_main, "study": study_main,
            "anchors": anchors_main}
USAGE = """usage: armor-trl {train,eval,demo,study,anchors} ...

  train   train with ARMOR or plain GRPO from a YAML recipe (TRL's parser; flags override the recipe)
          e.g. armor-trl train --config recipe.yaml --method grpo --beta 0.04 [--dry_run]
  eval    avg@k and pass@k of a model on a dataset with the built-in verifiers
          e.g. armor-trl eval --model PATH --dataset gsm8k --split test --k 8
  anchors pre-generate verified anchors from the reference (then train with --anchor_source column
          --anchors_dataset DIR), e.g. armor-trl anchors --config recipe.yaml --output_dir anchors/ --num_candidates 8
  demo    the offline CPU demo on the mode testbed (configs/mode_testbed.yaml): GRPO, GRPO+KL, GRPO at a lower lr
          and ARMOR on a tiny model, 3 seeds each, as a study (9-12.5 min on 2 cores; [--seeds N] [--smoke] [--real])
  study   arms x seeds of one recipe (configs/study/arms.yaml), resumable, paired bootstrap CIs and plots
          e.g. armor-trl study --arms grpo,grpo_small_lr,armor --seeds 5 [--workers 2] [--output_dir results/study/x]

Run `armor-trl COMMAND --help` for a command's options."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"armor-trl: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])
