"""What several ``armor-trl`` subcommands share: the ``--output_dir`` flag with its hidden, deprecated old spellings,
an argparse parser whose "unrecognized arguments" error names the close flags, and the check that a training recipe
(``train``, ``anchors``) names a model and data before anything else is parsed."""

from __future__ import annotations

import argparse
import sys

from armor_trl.integration.checks import close_names
from armor_trl.app.recipe.parsing import recipe_value

OUTPUT_FLAG = "--output_dir"  # every subcommand's output flag (TRL's name); --out / --output are deprecated aliases


class DeprecatedOutputFlag(argparse.Action):
    """A hidden old spelling of --output_dir: stores into output_dir and warns once."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not getattr(namespace, "_warned_deprecated_output", False):
            warn_deprecated_output(parser.prog, option_string)
            namespace._warned_deprecated_output = True
        setattr(namespace, self.dest, values)


def warn_deprecated_output(prog: str, flag: str, note: str = "") -> None:
    print(f"{prog}: warning: {flag} is deprecated and will be removed; use {OUTPUT_FLAG}{note}.", file=sys.stderr)


def add_output_dir(parser: argparse.ArgumentParser, help: str, default=None, old: tuple[str, ...] = ()) -> None:
    """``--output_dir`` with ``old`` spellings accepted, hidden from --help, with one deprecation warning."""
    parser.add_argument(OUTPUT_FLAG, default=default, help=help)
    for flag in old:
        parser.add_argument(flag, dest="output_dir", action=DeprecatedOutputFlag, help=argparse.SUPPRESS)


def require_recipe(argv: list[str], command: str) -> None:
    """What a run needs before anything else is parsed (TRL's parser checks the hardware first: bf16 without a GPU):
    a recipe or flags, the model and the training data; a ValueError naming what is missing."""
    if not argv:
        raise ValueError(f"give a recipe: armor-trl {command} --config recipe.yaml [--field value ...] "
                         f"(armor-trl {command} --help lists the fields).")
    if not recipe_value(argv, "model_name_or_path") and not recipe_value(argv, "resume_best_as_reference"):
        raise ValueError(f"model_name_or_path is required: {missing_model_hint(argv)}")
    if not recipe_value(argv, "dataset_name") and not recipe_value(argv, "datasets"):
        raise ValueError("dataset_name (or a datasets mixture) is required: set it in the recipe (--config) or pass "
                         "--dataset_name.")


def missing_model_hint(argv: list[str]) -> str:
    """Where a recipe's missing model comes from: a testbed recipe's model is the tiny one its ``demo.warmup`` builds,
    which only ``armor-trl demo`` / ``study`` make (its header says so); any other recipe names one or takes the flag."""
    demo = recipe_value(argv, "demo")
    if isinstance(demo, dict) and "warmup" in demo:
        config = recipe_value(argv, "config")
        return (f"{config} trains the tiny model its demo: section warms up (demo.warmup), which `armor-trl demo "
                f"--config {config}` and `armor-trl study --config {config}` build (cached in a cache/ folder beside "
                "the study's folder; the study's summary.json names it as model); to train it with `armor-trl train`, "
                "pass that checkpoint with --model_name_or_path.")
    return "set it in the recipe (--config) or pass --model_name_or_path."


def flag_hints(strings: list[str], known) -> str:
    """`` (--x: did you mean --y?; ...)`` for the unknown ``--flags`` among ``strings`` that are close to a known
    name, else ""."""
    hints = []
    for flag in (s[2:].split("=", 1)[0] for s in strings if s.startswith("--")):
        close = close_names(flag, known)
        if close:
            hints.append(f"--{flag}: did you mean {' or '.join('--' + c for c in close)}?")
    return f" ({'; '.join(hints)})" if hints else ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose "unrecognized arguments" error names the close flags (a typo)."""

    def parse_args(self, args=None, namespace=None):
        parsed, rest = self.parse_known_args(args, namespace)
        if rest:
            known = [option[2:] for action in self._actions for option in action.option_strings
                     if option.startswith("--") and action.help is not argparse.SUPPRESS]
            self.error(f"unrecognized arguments: {' '.join(rest)}{flag_hints(rest, known)}")
        return parsed
