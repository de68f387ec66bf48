"""Building a run from a YAML recipe: the recipe's fields (:class:`TrainScriptArguments`), parsing it with TRL's
``TrlParser`` (:func:`parse_train_args`), its datasets and validation sets, and the trainer
(:func:`build_trainer`). The ``armor-trl`` commands (:mod:`armor_trl.app.cli`) and the experiments
(:mod:`armor_trl.app.experiments`) both build runs through this module; it imports neither.
"""

from __future__ import annotations

import enum
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field, fields

import yaml
from trl import ScriptArguments

from armor_trl.integration.checks import close_names, unknown_names

METHODS = ("armor", "grpo")
RESERVED_RECIPE_KEYS = ("demo", "study")  # recipe sections read by the experiments (armor_trl.app.experiments)
# `trl grpo` fields that armor-trl train does not take, and why (a flag or recipe key naming one is refused so)
REFUSED_TRL_FIELDS = {
    "reward_model_name_or_path": (
        "a `trl grpo` field that armor-trl train does not take: rewards are named in reward_funcs (built-in "
        "verifiers such as math_verify, or module:function of your own), and ARMOR's anchors need a reward that says "
        "'correct' (reaches anchor_reward_threshold), which a reward model's scores do not. To add a reward model's "
        "score, wrap it in a function (my_rewards.py), list my_rewards:score in reward_funcs after the verifier, and "
        "name the verifier in anchor_reward_funcs."
    ),
}


@dataclass
class DataArguments:
    """How a dataset becomes ``prompt`` + ``answer`` (see :func:`armor_trl.data.datasets.load_rlvr_dataset`)."""

    dataset_schema: str | None = field(
        default=None,
        metadata={"help": "Schema of the dataset: gsm8k, math, aime, dapo or prompt_answer. Default: detected."},
    )
    chat: bool = field(default=False, metadata={"help": "Write prompts as chat messages (uses the chat template)."})
    system_prompt: str | None = field(default=None, metadata={"help": "System message (or text prefix) of prompts."})
    instruction: str | None = field(
        default=None,
        metadata={"help": "Text appended to each problem; 'default' = ask for the final answer in \\boxed{}; 'dapo' = "
                  "DAPO-Math-17k's template (final 'Answer:' line, read by math_verify with that rule); prompts that "
                  "already carry DAPO's instruction get none. See docs/verifiers.md."},
    )
    arithmetic_train_size: int = field(default=64, metadata={"help": "dataset 'arithmetic': training problems."})
    arithmetic_eval_size: int = field(default=200, metadata={"help": "dataset 'arithmetic': held-out problems."})
    arithmetic_digits: int = field(default=2, metadata={"help": "dataset 'arithmetic': digits per operand."})
    arithmetic_seed: int = field(default=0, metadata={"help": "dataset 'arithmetic': seed of the problem draw."})
    arithmetic_train_filter: str | None = field(
        default=None, metadata={"help": "dataset 'arithmetic': restrict the training problems only; 'no_carry' = "
                                "no column carries (a shortcut the held-out set punishes)."},
    )
    arithmetic_eval_filter: str | None = field(
        default=None, metadata={"help": "dataset 'arithmetic': restrict the held-out problems only; 'carry' = some "
                                "column carries (the mode testbed's held-out set). Default: unrestricted."},
    )
    arithmetic_train_carry_share: float | None = field(
        default=None, metadata={"help": "dataset 'arithmetic': this share of the training problems needs a carry, "
                                "the rest follows arithmetic_train_filter (the mode testbed's carry-mix variant). "
                                "Validate on those carry problems with the val_datasets source "
                                "'arithmetic:train_carry'. Default: none mixed in."},
    )


@dataclass
class TrainScriptArguments(ScriptArguments, DataArguments):
    """Dataset, reward and validation fields of ``armor-trl train`` (TRL's ScriptArguments plus these)."""

    method: str = field(
        default="armor",
        metadata={"help": "armor: ArmorGRPOTrainer + ArmorConfig; grpo: trl.GRPOTrainer + GRPOConfig.",
                  "choices": list(METHODS)},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["math_verify"],
        metadata={"help": "Reward functions: built-in names (math_verify, exact_integer, final_integer, format), TRL's reward names "
                  "(accuracy_reward, think_format_reward, reasoning_accuracy_reward, ...) or import paths "
                  "'pkg.mod:func'. Weights: the config's reward_weights."},
    )
    eval_dataset_name: str | None = field(
        default=None, metadata={"help": "Held-out set for validation (logged as val/avg@n). Default: dataset_name's "
                                "dataset_test_split, unless val_datasets is given."}
    )
    val_datasets: list[str] | None = field(
        default=None,
        metadata={"help": "More validation sets, each 'source' or 'name=source' (registry name, hub id or local file, "
                  "its default split), logged as val/<name>/avg@n; prompts are written like the training data's "
                  "(chat, system_prompt, instruction). E.g. aime24 aime25; 'train=arithmetic:train' = the arithmetic "
                  "task's training problems (first max_eval_samples)."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N held-out rows."})
    ref_model_name_or_path: str | None = field(
        default=None, metadata={"help": "method armor: initial reference policy. Default: the initial policy."}
    )
    resume_best_as_reference: str | None = field(
        default=None,
        metadata={"help": "Stage 2 of the paper's protocol: start ARMOR from the best checkpoint of this earlier run "
                  "directory, as policy and reference. Best = trainer_state.json's best_model_checkpoint, else the "
                  "checkpoint whose step has the highest recorded validation score in val_metrics.jsonl "
                  "(collapse_guard_metric / metric_for_best_model, else the first val/…avg@n)."},
    )
    val_every_steps: int = field(default=0, metadata={"help": "Validate every N optimizer steps (0 = never)."})
    val_k: int = field(default=4, metadata={"help": "k of pass@k in validation."})
    val_num_samples: int | None = field(default=None, metadata={"help": "Samples per problem (default: val_k)."})
    val_temperature: float | None = field(default=None, metadata={"help": "Default: the training temperature."})
    val_top_p: float = field(default=1.0, metadata={"help": "top-p of validation sampling."})
    val_max_new_tokens: int | None = field(default=None, metadata={"help": "Default: max_completion_length."})
    val_batch_size: int = field(default=64, metadata={"help": "Sequences per generate call in validation."})
    val_jsonl: str | None = field(default=None, metadata={"help": "Default: <output_dir>/val_metrics.jsonl."})
    val_kl_prompts: int = field(
        default=0,
        metadata={"help": "Log val/kl_reverse_start (on policy samples) and val/kl_forward_start (on samples of the "
                  "start model drawn once): KL between the policy and the model training started from, on the first "
                  "N held-out prompts at every validation, for any method (0 = off). Keeps a copy of the trainable "
                  "weights (the whole model in a full fine-tune, the adapter with LoRA) in device memory; not with "
                  "ZeRO-3. Uses validation's temperature (> 0)."},
    )
    val_kl_samples: int = field(default=4, metadata={"help": "Completions per prompt for val_kl_prompts."})
    val_mode_classifier: str | None = field(
        default=None,
        metadata={"help": "Log each validation set's share of sampled completions per solution mode, val/mode/<mode> "
                  "(val/<name>/mode/<mode>): a registered classifier ('arithmetic': the mode testbed's worked/direct/"
                  "other, armor_trl.rewards.modes) or an import path 'pkg.mod:func' (completion text -> mode label)."},
    )
    dry_run: bool = field(default=False, metadata={"help": "Validate the recipe and exit without loading weights."})
    anchors_dataset: str | None = field(
        default=None,
        metadata={"help": "method armor with anchor_source='column': folder written by `armor-trl anchors`; its "
                  "anchors are added to the training set as anchor_column, matched by prompt."},
    )
    dataset_mixture: typing.Any = field(default=None, init=False, repr=False)  # TRL's `datasets:` (DatasetMixtureConfig)
    anchor_set_allow_other_reference: bool = field(
        default=False,
        metadata={"help": "Accept an anchors_dataset sampled from another model than this run's reference "
                  "(ref_model_name_or_path, else model_name_or_path). Default: refused, since the weight fingerprint "
                  "in its metadata.json must match; anchors from another model are not the reference's own samples."},
    )


def armor_only_fields() -> list[str]:
    """Fields that ArmorConfig adds to GRPOConfig."""
    from trl import GRPOConfig

    from armor_trl.config import ArmorConfig

    return sorted({f.name for f in fields(ArmorConfig)} - {f.name for f in fields(GRPOConfig)})


# --- checking a recipe's values before anything runs ----------------------------------------------------------

class UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader that refuses a key repeated in one mapping (plain PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` then overriding is YAML's own way
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {first}); give each key once",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


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


# --- parsing ---------------------------------------------------------------------------------------------------
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


def read_yaml(path: str):
    """A YAML file through :class:`UniqueKeyLoader`; a ValueError of one line naming the file, line and column for
    a syntax error or a repeated key, and naming the file when it cannot be read."""
    try:
        with open(path) as f:
            return yaml.load(f, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        what = ": ".join(str(part) for part in (error.context, error.problem) if part)
        raise ValueError(f"{where}: invalid YAML: {what}.") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: invalid YAML: {' '.join(str(error).split())}.") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a text file ({error.reason} at byte {error.start}).") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot be read ({error.strerror or error}).") from None


def load_recipe(path: str, _seen: tuple = ()) -> dict:
    """A YAML recipe as a dict. A ``base: other.yaml`` key (relative to the recipe) loads that recipe first and
    overrides its keys with this one's, so a variant states only what differs. Repeated keys and YAML syntax errors
    are refused with file, line and column."""
    path = os.path.abspath(path)
    if path in _seen:
        raise ValueError(f"Recipe {path} includes itself through 'base' ({' -> '.join(_seen + (path,))}).")
    recipe = read_yaml(path)
    recipe = {} if recipe is None else recipe
    if not isinstance(recipe, dict):
        raise ValueError(f"Recipe {path} must be a YAML mapping of field: value, got {kind_of(recipe)}.")
    base = recipe.pop("base", None)
    if base is None:
        return recipe
    if not isinstance(base, str) or not base.strip():
        raise ValueError(f"Recipe {path}: base must be the file name of another recipe (a string, relative to this "
                         f"one), got {kind_of(base)} ({base!r}).")
    base_path = os.path.join(os.path.dirname(path), base)
    if not os.path.isfile(base_path):
        raise ValueError(f"Recipe {path}: base {base!r} not found (looked for {base_path}).")
    return {**load_recipe(base_path, _seen + (path,)), **recipe}


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


# --- run folders -----------------------------------------------------------------------------------------------
def read_json(path: str):
    """A JSON file's content; a ValueError naming the file (and where) when it cannot be read or parsed."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}); the file "
                         "is corrupt or was cut short.") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a text file ({error.reason} at byte {error.start}).") from None


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file; a ValueError naming the file and line of a record that is not a JSON object
    (e.g. a line cut short when a run was killed)."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: line {number} is not valid JSON ({error.msg}, column {error.colno}); the "
                                 "file is corrupt or was cut short: repair or delete that line.") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}: line {number} is not a JSON object ({{...}}), got {type(record).__name__}.")
            records.append(record)
    return records


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


# --- building a run --------------------------------------------------------------------------------------------
# val_datasets sources: the arithmetic task's training problems (to watch them next to the held-out ones), and
# those of them that need a carry (with arithmetic_train_carry_share)
ARITHMETIC_TRAIN = "arithmetic:train"
ARITHMETIC_TRAIN_CARRY = "arithmetic:train_carry"


def load_datasets(args: DataArguments, train_source: str | None, eval_source: str | None, train_split: str,
                  eval_split: str | None, name: str | None = None, max_train: int | None = None,
                  max_eval: int | None = None):
    """(train, held-out) datasets with ``prompt``/``answer``; either is None when its source is None."""
    from armor_trl.data.datasets import arithmetic_prompt_has_carry, arithmetic_splits, load_rlvr_dataset

    def load(source, split, limit):
        if source is None:
            return None
        if source in ("arithmetic", ARITHMETIC_TRAIN, ARITHMETIC_TRAIN_CARRY):
            train, held_out = arithmetic_splits(args.arithmetic_train_size, args.arithmetic_eval_size,
                                                args.arithmetic_seed, args.arithmetic_digits, args.chat,
                                                args.system_prompt, args.arithmetic_train_filter,
                                                args.arithmetic_eval_filter, args.arithmetic_train_carry_share)
            dataset = train if split == "train" or source != "arithmetic" else held_out
            if source == ARITHMETIC_TRAIN_CARRY:
                dataset = dataset.filter(lambda row: arithmetic_prompt_has_carry(row["prompt"]))
                if len(dataset) == 0:
                    raise ValueError(f"val_datasets source {ARITHMETIC_TRAIN_CARRY!r}: no training problem needs a carry "
                                     f"(arithmetic_train_carry_share {args.arithmetic_train_carry_share!r} of "
                                     f"arithmetic_train_size {args.arithmetic_train_size}); give a share that leaves "
                                     "at least one.")
            return dataset.select(range(min(limit, len(dataset)))) if limit else dataset
        return load_rlvr_dataset(source, split=split, name=name, schema=args.dataset_schema, chat=args.chat,
                                 system_prompt=args.system_prompt, instruction=args.instruction, limit=limit)

    return load(train_source, train_split, max_train), load(eval_source, eval_split, max_eval)


def held_out_source(script_args: TrainScriptArguments) -> str | None:
    """Where validation's held-out set comes from: eval_dataset_name, else the training dataset's test split when
    validating without val_datasets, else None."""
    if script_args.eval_dataset_name is None and script_args.val_every_steps > 0 and not script_args.val_datasets:
        return script_args.dataset_name
    return script_args.eval_dataset_name


def _rlvr_rows(raw, label: str, schema: str | None, chat: bool, system_prompt: str | None, instruction: str | None):
    """A loaded dataset as ``prompt``/``answer``/``answer_format`` rows, by the schema rules that
    :func:`armor_trl.data.datasets.load_rlvr_dataset` applies to a ``dataset_name`` (which takes a source, not rows)."""
    from datasets import Features, Value

    from armor_trl.data.datasets import ANSWER_FORMATS, SCHEMAS, detect_schema, format_prompt, has_dapo_instruction

    if len(raw) == 0:
        raise ValueError(f"{label}: no rows.")
    try:
        schema = schema or detect_schema(raw.column_names, raw.select(range(min(5, len(raw)))))
    except ValueError as error:
        raise ValueError(f"{label}: {error}") from None
    if schema not in SCHEMAS:
        raise ValueError(f"Unknown dataset_schema {schema!r}: expected one of {sorted(SCHEMAS)}.")
    adapter = SCHEMAS[schema]

    def convert(row):
        mapped = adapter(row)
        dapo = instruction == "dapo" or has_dapo_instruction(mapped["problem"])
        return {"prompt": format_prompt(mapped["problem"], chat, system_prompt, instruction), "answer": mapped["answer"],
                "answer_format": "dapo" if dapo else ANSWER_FORMATS[schema]}

    keep = [c for c in ("solution",) if c in raw.column_names]
    text = Value("string")
    features = Features({"prompt": [{"role": text, "content": text}] if chat else text, "answer": text,
                         "answer_format": text, **{c: raw.features[c] for c in keep}})
    data = raw.map(convert, remove_columns=[c for c in raw.column_names if c not in keep], features=features)
    if all(answer is None for answer in data["answer"]):
        raise ValueError(f"No row of the {label} has a ground-truth answer (every one is missing, NaN, 'nan' or "
                         "'None'): the rewards cannot judge any completion. Check the answer column.")
    return data


def mixture_datasets(script_args: TrainScriptArguments):
    """(train, held-out or None) of a ``datasets:`` mixture, loaded by TRL's ``get_dataset`` (fractions, columns,
    ``test_split_size`` as ``trl grpo`` reads them), then written as prompt/answer like ``dataset_name``'s rows."""
    from trl import get_dataset

    try:
        loaded = get_dataset(script_args.dataset_mixture)
    except (FileNotFoundError, OSError) as error:
        raise ValueError(f"datasets: {' '.join(str(error).split())}") from None
    label = "datasets mixture (" + ", ".join(d.path if not d.data_files else f"{d.path} {d.data_files}"
                                             for d in script_args.dataset_mixture.datasets) + ")"

    def convert(split, limit):
        if split not in loaded:
            return None
        data = loaded[split]
        data = data.select(range(min(limit, len(data)))) if limit else data
        return _rlvr_rows(data, label, schema=script_args.dataset_schema, chat=script_args.chat,
                         system_prompt=script_args.system_prompt, instruction=script_args.instruction)

    return convert("train", script_args.max_train_samples), convert("test", script_args.max_eval_samples)


def train_datasets(script_args: TrainScriptArguments):
    if getattr(script_args, "dataset_mixture", None) is not None:
        train, held_out = mixture_datasets(script_args)
        if script_args.eval_dataset_name:
            held_out = load_datasets(script_args, None, script_args.eval_dataset_name, script_args.dataset_train_split,
                                     script_args.dataset_test_split, script_args.dataset_config,
                                     max_eval=script_args.max_eval_samples)[1]
        return train, held_out
    return load_datasets(script_args, script_args.dataset_name, held_out_source(script_args),
                         script_args.dataset_train_split, script_args.dataset_test_split, script_args.dataset_config,
                         script_args.max_train_samples, script_args.max_eval_samples)


def named_validation_sets(script_args: TrainScriptArguments) -> dict[str, str]:
    """{name: source} of ``val_datasets``; a ValueError for an empty or repeated name or one holding '/'."""
    sets = {}
    for entry in script_args.val_datasets or []:
        name, _, source = entry.partition("=") if "=" in entry else (entry, "", entry)
        if not name or not source or "/" in name or name in sets:
            raise ValueError(f"val_datasets entry {entry!r}: give 'source' or 'name=source' with a unique name "
                             "without '/' (a hub id like org/set needs a name: 'set=org/set').")
        sets[name] = source
    return sets


def validation_sets(script_args: TrainScriptArguments, held_out):
    """What ValidationCallback validates on: the held-out set alone, or a dict with the named ``val_datasets``
    (loaded with the training data's prompt template) and the held-out set, if any, under ``None`` (val/avg@n)."""
    named = named_validation_sets(script_args)
    if not named:
        return held_out
    sets = {} if held_out is None else {None: held_out}
    for name, source in named.items():
        sets[name] = load_datasets(script_args, None, source, "train", None, max_eval=script_args.max_eval_samples)[1]
    return sets


def validation_callback(script_args, training_args, eval_dataset, verifier, run_name=None, on_evaluate=None):
    from armor_trl.callbacks.validation import ValidationCallback
    from armor_trl.rewards.modes import resolve_classifier

    return ValidationCallback(
        eval_dataset,
        verifier,
        every_steps=script_args.val_every_steps,
        k=script_args.val_k,
        num_samples=script_args.val_num_samples,
        max_new_tokens=script_args.val_max_new_tokens or training_args.max_completion_length,
        temperature=training_args.temperature if script_args.val_temperature is None else script_args.val_temperature,
        top_p=script_args.val_top_p,
        batch_size=script_args.val_batch_size,
        seed=training_args.seed,
        jsonl_path=script_args.val_jsonl or os.path.join(training_args.output_dir, "val_metrics.jsonl"),
        run_name=run_name,
        on_evaluate=on_evaluate,
        mode_classifier=resolve_classifier(script_args.val_mode_classifier) if script_args.val_mode_classifier
        else None,
        kl_prompts=script_args.val_kl_prompts,
        kl_samples=script_args.val_kl_samples,
    )


def build_trainer(script_args, training_args, model_args, callbacks=(), run_name=None, on_evaluate=None):
    """The trainer of a parsed recipe (ArmorGRPOTrainer or trl.GRPOTrainer), with the validation callback."""
    from trl import GRPOTrainer, get_peft_config, get_quantization_config

    from armor_trl.rewards import resolve_rewards
    from armor_trl.trainer import ArmorGRPOTrainer

    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs
    rewards = resolve_rewards(script_args.reward_funcs)
    train, held_out = train_datasets(script_args)
    if script_args.anchors_dataset:
        from armor_trl.data.pregenerate import attach_anchors

        train = attach_anchors(train, script_args.anchors_dataset, getattr(training_args, "anchor_column", "anchors"),
                               reference=script_args.ref_model_name_or_path or model_args.model_name_or_path,
                               allow_other_reference=script_args.anchor_set_allow_other_reference)
    kwargs = dict(
        model=model_args.model_name_or_path,
        reward_funcs=rewards,
        args=training_args,
        train_dataset=train,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        callbacks=list(callbacks),
    )
    if script_args.method == "armor":
        trainer = ArmorGRPOTrainer(**kwargs, ref_model=script_args.ref_model_name_or_path)
    else:
        trainer = GRPOTrainer(**kwargs)
    if script_args.val_every_steps > 0:
        verifier = rewards[0] if len(rewards) == 1 else _first_verifier(rewards)
        # attached (not appended), so it logs through the trainer and every report_to integration gets val/*
        sets = validation_sets(script_args, held_out)
        validation_callback(script_args, training_args, sets, verifier, run_name, on_evaluate).attach(trainer)
    return trainer


def _first_verifier(rewards):
    """With several reward functions, validation uses the first built-in verifier (or the first function)."""
    from armor_trl.rewards import exact_integer_reward, math_verify_reward

    return next((r for r in rewards if r in (math_verify_reward, exact_integer_reward)), rewards[0])
