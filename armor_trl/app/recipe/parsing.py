"""Parsing the ``armor-trl train`` arguments, a YAML recipe (``--config``) and flags, with TRL's ``TrlParser``
(:func:`parse_train_args`): the recipe flattened when it has a ``base:`` or a field the installed transformers names
otherwise, unknown keys and flags refused with the names they may have meant, and the values checked. Also a field's
value before parsing (:func:`recipe_value`) and ``resume_from_checkpoint`` as ``Trainer.train`` takes it
(:func:`resolve_resume_from_checkpoint`).
"""

from __future__ import annotations

import os
from dataclasses import fields

import yaml

from armor_trl.app.recipe.fields import (
    METHODS, REFUSED_TRL_FIELDS, RESERVED_RECIPE_KEYS, TrainScriptArguments, armor_only_fields,
)
from armor_trl.app.recipe.loading import load_recipe, read_yaml
from armor_trl.app.recipe.validation import check_recipe_values, check_values
from armor_trl.integration.checks import close_names, unknown_names


def _cli_value(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag.startswith("--") and flag[2:].replace("-", "_") == name:
            return value if value else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def _flags(strings: list[str]) -> list[str]:
    return [s[2:].split("=", 1)[0].replace("-", "_") for s in strings if s.startswith("--")]


def _dry_run_requested(argv: list[str], recipe: dict) -> bool:
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag in ("--dry_run", "--dry-run"):
            value = value or (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "true")
            return value.lower() in ("true", "1", "yes")
    return bool(recipe.get("dry_run", False))


def _recipe(argv: list[str]) -> dict:
    path = _cli_value(argv, "config")
    return {} if path is None else load_recipe(path)


# transformers 5.18 renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs); the recipes use the new
# names, and vLLM's CPU build needs transformers < 5.18 (docs/vllm.md), where only the old ones exist
RENAMED_TRAINING_FIELDS = {"activation_checkpointing": "gradient_checkpointing",
                           "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs"}


def with_installed_names(recipe: dict, fields=None) -> dict:
    """``recipe`` with each key of ``RENAMED_TRAINING_FIELDS`` under the name the installed transformers'
    TrainingArguments has (``fields``: its field names, for tests)."""
    if fields is None:
        from transformers import TrainingArguments

        fields = TrainingArguments.__dataclass_fields__
    renamed = dict(recipe)
    for new, old in RENAMED_TRAINING_FIELDS.items():
        if new in renamed and new not in fields and old in fields:
            renamed[old] = renamed.pop(new)
    return renamed


def _flatten_recipe(argv: list[str]) -> tuple[list[str], str | None]:
    """Point --config at a merged copy when the recipe has a ``base`` (TRL's parser reads one plain YAML file) or uses a
    field name the installed transformers does not have yet (:func:`with_installed_names`).
    Returns (argv, the temporary file or None); the caller removes the file once parsed."""
    path = _cli_value(argv, "config")
    if path is None:
        return argv, None
    import tempfile

    raw = read_yaml(path)
    if not isinstance(raw, dict):
        return argv, None  # a file that is no mapping is refused by load_recipe, naming it
    recipe = with_installed_names(load_recipe(path) if "base" in raw else raw)
    if "base" not in raw and recipe == raw:
        return argv, None
    merged = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="armor-recipe-", delete=False)
    try:
        with merged:
            yaml.safe_dump(recipe, merged)
    except BaseException:
        os.remove(merged.name)
        raise
    index = argv.index("--config") if "--config" in argv else None
    if index is not None:
        return argv[: index + 1] + [merged.name] + argv[index + 2 :], merged.name
    return [f"--config={merged.name}" if a.startswith("--config=") else a for a in argv], merged.name


def recipe_value(argv: list[str], name: str):
    """A field's value as the command line (``--name``) or else the recipe (``--config``, ``base:`` followed) gives it;
    None when neither does. For checks that must come before parsing (e.g. the model before the hardware)."""
    value = _cli_value(argv, name)
    return value if value is not None else _recipe(argv).get(name)


def parse_train_args(argv: list[str]):
    """Parse ``armor-trl train`` arguments (YAML recipe + flags) with ``trl.TrlParser``.

    Returns ``(script_args, training_args, model_args, notes)``; ``notes`` are warnings to show (ignored keys).
    Raises ValueError for unknown keys or flags and for invalid values (including ArmorConfig's checks).
    """
    config = _cli_value(list(argv), "config")
    argv, merged = _flatten_recipe(list(argv))
    try:
        return _parse_train_args(argv, config)
    finally:
        if merged is not None:  # nothing left behind in the temp folder
            os.remove(merged)


def _parse_train_args(argv: list[str], config: str | None):
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser

    from armor_trl.config import ArmorConfig

    recipe = _recipe(argv)
    method = _cli_value(argv, "method") or recipe.get("method") or "armor"
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}.")
    for name, why in REFUSED_TRL_FIELDS.items():
        if name in _flags(argv) or name in recipe:
            raise ValueError(f"{name}: {why}")
    check_recipe_values(recipe, method, config)
    armor_only = armor_only_fields()
    if method == "grpo":
        rejected = [flag for flag in _flags(argv) if flag in armor_only]
        if rejected:
            raise ValueError(
                f"--{', --'.join(rejected)}: ArmorConfig-only field(s), which do not apply to method 'grpo' "
                "(plain trl.GRPOTrainer). Drop them or use --method armor."
            )
    notes = []
    if _dry_run_requested(argv, recipe) and "use_cpu" not in _flags(argv) and not recipe.get("use_cpu"):
        import torch

        if not torch.cuda.is_available():  # a GPU recipe checked on a login node or laptop: bf16 needs a GPU
            argv += ["--use_cpu", "true"]
            notes.append("dry run without a GPU: the recipe is validated as if use_cpu=True (bf16, vLLM and memory "
                         "are checked only when training starts on the GPU machine)")
    if method == "grpo" and not {"bf16", "fp16"} & (set(_flags(argv)) | set(recipe)):
        # precision left to the machine: GRPOConfig would take bf16 everywhere; resolve it as ArmorConfig does
        from armor_trl.config import default_precision

        use_cpu = _cli_value(argv, "use_cpu") or recipe.get("use_cpu", False)
        precision = default_precision(str(use_cpu).lower() in ("true", "1", "yes"))
        argv += {"fp32": ["--bf16", "false"], "fp16": ["--bf16", "false", "--fp16", "true"]}.get(precision, [])
    parser = TrlParser((TrainScriptArguments, ArmorConfig if method == "armor" else GRPOConfig, ModelConfig,
                        DatasetMixtureConfig), prog="armor-trl train")
    script_args, training_args, model_args, mixture, recipe_rest, cli_rest = parser.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    if mixture.datasets:  # `datasets:` as in `trl grpo` recipes: the training data instead of dataset_name
        if mixture.streaming:
            raise ValueError("streaming: true is not supported with a datasets mixture (ARMOR needs the dataset's "
                             "length and its prompts up front); drop it.")
        if script_args.dataset_name:
            notes.append(f"both datasets and dataset_name given: the datasets mixture is used, dataset_name "
                         f"{script_args.dataset_name!r} is ignored (as in `trl grpo`)")
        script_args.dataset_mixture = mixture
    known = [f.name for dataclass_type in parser.dataclass_types for f in fields(dataclass_type) if f.init]
    if cli_rest:
        hints = [f"--{flag}: did you mean {' or '.join('--' + c for c in close_names(flag, known))}?"
                 for flag in _flags(cli_rest) if close_names(flag, known)]
        raise ValueError(f"Unknown arguments: {' '.join(cli_rest)}" + (f" ({'; '.join(hints)})" if hints else ""))
    ignored, unknown = [], []
    for key in _flags(recipe_rest):
        if key in RESERVED_RECIPE_KEYS:
            continue
        if method == "grpo" and key in armor_only:
            ignored.append(key)
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"Unknown key(s) in the recipe: {unknown_names(unknown, known)} (not a field of "
                         f"TrainScriptArguments, "
                         f"{'ArmorConfig' if method == 'armor' else 'GRPOConfig'} or ModelConfig).")
    if ignored:
        notes.insert(0, f"method 'grpo' ignores the ArmorConfig-only recipe key(s): {', '.join(ignored)}")
    check_values(training_args, method)
    return script_args, training_args, model_args, notes


def resolve_resume_from_checkpoint(value, output_dir: str) -> bool | str | None:
    """``resume_from_checkpoint`` as ``Trainer.train`` takes it. From a flag or a recipe it arrives as a string:
    ``true`` (any case) resumes from the newest checkpoint in ``output_dir`` (True), ``false`` or empty starts afresh
    (None), anything else is a checkpoint folder. A ValueError when there is nothing to resume from."""
    if value is None or value is False:
        return None
    text = "true" if value is True else str(value).strip()
    if text.lower() in ("false", ""):
        return None
    if text.lower() == "true":
        from transformers.trainer_utils import get_last_checkpoint

        if not os.path.isdir(output_dir) or get_last_checkpoint(output_dir) is None:
            raise ValueError(f"resume_from_checkpoint true: no checkpoint-N folder in output_dir {output_dir!r} to "
                             "resume from; give a checkpoint folder, true (the newest in output_dir) or false.")
        return True
    if not os.path.isdir(text):
        raise ValueError(f"resume_from_checkpoint {text!r}: no such checkpoint folder; give a checkpoint folder, "
                         "true (the newest checkpoint in output_dir) or false.")
    return text
