"""Checking a recipe's values before anything runs: each value against its field's type as TRL's parser then reads it
(:func:`check_recipe_values`, with a ``datasets:`` mixture's entries), and what no dataclass check covers, such as a
generation round's size against this machine's memory (:func:`check_values`), each a ValueError naming the field,
what it got and what is allowed.
"""

from __future__ import annotations

import enum
import math
import os
import types
import typing
from dataclasses import fields

from trl import ScriptArguments

from armor_trl.app.recipe.fields import TrainScriptArguments
from armor_trl.integration.checks import unknown_names

BOOL_STRINGS = ("true", "false", "yes", "no", "t", "f", "y", "n", "1", "0")


def kind_of(value) -> str:
    """What a YAML value is, in words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return type(value).__name__


def _parses(kind, text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


def value_matches(value, hint, string_as_list: bool = False, element: bool = False) -> bool:
    """Whether a recipe value fits a field's type as TRL's parser then reads it: argparse converts a string given for
    a number or boolean field (so '1e-6' is a number), but takes lists, mappings and list elements as they are, so
    those must fit exactly (``element``: a list element, no string conversion)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(value_matches(value, arg, string_as_list, element) for arg in args)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple) or hint in (list, tuple):
        if string_as_list and isinstance(value, str):
            return True
        if not isinstance(value, list):
            return False
        return not args or all(value_matches(v, args[0], element=True) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    convertible = isinstance(value, str) and not element
    if hint is bool:
        return isinstance(value, bool) or convertible and value.strip().lower() in BOOL_STRINGS
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool) or convertible and _parses(int, value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) or convertible and _parses(float, value)
    if hint is str:
        return isinstance(value, str) or not element and isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, str)
    return isinstance(value, dict) or isinstance(hint, type) and isinstance(value, hint)  # e.g. a config object


def describe_type(hint) -> str:
    """A field's type in words: 'a number or null', 'a list of strings', ..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        words = list(dict.fromkeys(describe_type(arg) for arg in args if arg is not type(None)))
        words += ["null"] if type(None) in args else []
        return " or ".join(words)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (list, tuple) or hint in (list, tuple):
        element = {str: "strings", int: "integers", float: "numbers", bool: "true/false values"}
        return "a list" + (f" of {element.get(args[0], 'values')}" if args else "")
    if origin is dict or hint is dict:
        return "a mapping"
    simple = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint in simple:
        return simple[hint]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "a string"
    return "a mapping"


def recipe_fields(method: str) -> dict:
    """{field: (type, choices, whether a single string stands for a list)} of the dataclasses a recipe fills: a
    single string is taken for a list only in TRL's and transformers' fields, as their parser does
    (``lora_target_modules: all-linear``), never in this package's (``reward_funcs: math_verify`` would be read
    letter by letter)."""
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig

    from armor_trl.config import ArmorConfig

    ours = {f.name for f in fields(TrainScriptArguments)} - {f.name for f in fields(ScriptArguments)}
    found = {}
    for cls in (TrainScriptArguments, ArmorConfig if method == "armor" else GRPOConfig, ModelConfig,
                DatasetMixtureConfig):
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.init and f.name not in found:
                found[f.name] = (hints.get(f.name, typing.Any), f.metadata.get("choices"), f.name not in ours)
    return found


def check_recipe_values(recipe: dict, method: str, path: str | None = None) -> None:
    """Every recipe value against its field's type (nested values included), before TRL's parser takes them as
    defaults: a ValueError naming the field, what it got and what is allowed. Keys that are no field are left to
    the parser's unknown-key check."""
    where = f"Recipe {path}: " if path else ""
    known = recipe_fields(method)
    for key, value in recipe.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}keys must be field names (strings), got {kind_of(key)} {key!r}.")
        if key == "env":
            if not isinstance(value, dict):
                raise ValueError(f"{where}env must be a mapping of environment variable: value, got {kind_of(value)}.")
            continue
        if key not in known:
            continue
        hint, choices, string_as_list = known[key]
        if not value_matches(value, hint, string_as_list):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise ValueError(f"{where}{key} must be {describe_type(hint)}, got {kind_of(value)} ({shown}).")
        if choices and value not in choices:
            raise ValueError(f"{where}{key} must be one of {', '.join(map(str, choices))}, got {value!r}.")
        if key == "datasets":
            check_mixture_entries(value, where)


def dataset_config_fields() -> dict:
    """{field: type} of TRL's DatasetConfig, one entry of a ``datasets:`` mixture (reached through
    ``trl.DatasetMixtureConfig``, which trl exports, since DatasetConfig itself is not exported at trl's top level)."""
    from trl import DatasetMixtureConfig

    (entry_type,) = typing.get_args(typing.get_type_hints(DatasetMixtureConfig)["datasets"])
    return typing.get_type_hints(entry_type)


def check_mixture_entries(entries, where: str = "") -> None:
    """Each entry of a ``datasets:`` mixture: a mapping with ``path`` and TRL's DatasetConfig keys of the right type."""
    allowed = dataset_config_fields()
    for number, entry in enumerate(entries):
        label = f"{where}datasets[{number}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{label} must be a mapping with path (and name, data_dir, data_files, split, columns, "
                             f"fraction), got {kind_of(entry)} ({entry!r}).")
        unknown = [key for key in entry if key not in allowed]
        if unknown:
            raise ValueError(f"{label}: unknown key(s) {unknown_names(map(str, unknown), allowed)}; allowed: "
                             f"{', '.join(allowed)}.")
        if not isinstance(entry.get("path"), str) or not entry["path"]:
            raise ValueError(f"{label}: path is required (a hub id, a folder, or a builder such as json/parquet/csv "
                             "with data_files).")
        for key, value in entry.items():
            if not value_matches(value, allowed[key]):
                raise ValueError(f"{label}: {key} must be {describe_type(allowed[key])}, got {kind_of(value)} "
                                 f"({value!r}).")


def machine_memory() -> tuple[int, str]:
    """(bytes, what) of the largest memory here: RAM, or one GPU's memory when that is larger."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_properties(0).total_memory
            if gpu > ram:
                return gpu, "GPU memory"
    except Exception:  # noqa: BLE001  (no usable CUDA: RAM it is)
        pass
    return ram, "RAM"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} PiB"


def check_values(training_args, method: str) -> None:
    """What no dataclass check covers: an output_dir that is a file, the learning rate (finite, > 0) and the sizes of
    one generation round against a lower bound of their memory (the token ids alone, before any model memory)."""
    from armor_trl.config import check_output_dir

    check_output_dir(training_args.output_dir)  # ArmorConfig checks it too; GRPOConfig (method grpo) does not
    lr = training_args.learning_rate
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"learning_rate must be a finite number > 0, got {lr!r}.")
    completions = training_args.per_device_train_batch_size * training_args.steps_per_generation
    tokens = training_args.max_completion_length + 1
    available, what = machine_memory()
    needs = [("per_device_train_batch_size x steps_per_generation", completions,
              f"{completions} completions per generation round")]
    if method == "armor" and training_args.use_anchors and training_args.anchor_source != "column":
        groups = max(completions // training_args.num_generations, 1)
        k = training_args.anchor_num_samples
        needs.append(("anchor_num_samples", groups * k, f"{groups} group(s) x {k} reference candidates per generation "
                      "round"))
    for field_name, sequences, counted in needs:
        need = sequences * tokens * 8  # int64 ids, the least any sampler holds
        if need > available:
            raise ValueError(
                f"{field_name} too large: {counted} of up to {tokens - 1} completion tokens need at least "
                f"{_size(need)} for their token ids alone (before the model and its KV cache), more than this "
                f"machine's {_size(available)} of {what}. Lower it (the paper samples 8 reference candidates).")
