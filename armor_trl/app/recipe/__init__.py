"""Building a run from a YAML recipe, one module per job: the recipe's fields (:mod:`.fields`,
:class:`TrainScriptArguments`), reading it and a run folder's files (:mod:`.loading`), checking its values
(:mod:`.validation`), parsing it with TRL's ``TrlParser`` (:mod:`.parsing`, :func:`parse_train_args`) and building
its datasets, validation sets and trainer (:mod:`.build`, :func:`build_trainer`). The ``armor-trl`` commands
(:mod:`armor_trl.app.cli`) and the experiments (:mod:`armor_trl.app.experiments`) both build runs through this package;
it imports neither. Its modules import each other, never this file; the names below are the single module's of before
the split, kept importable from ``armor_trl.app.recipe`` (and the flat layout's ``armor_trl.recipe``): patch one where
it lives, in its module, since a name here is a second reference to it.
"""

from armor_trl.app.recipe.build import (
    ARITHMETIC_TRAIN, ARITHMETIC_TRAIN_CARRY, build_trainer, held_out_source, load_datasets, mixture_datasets,
    named_validation_sets, train_datasets, validation_callback, validation_sets,
)
from armor_trl.app.recipe.fields import (
    METHODS, REFUSED_TRL_FIELDS, RESERVED_RECIPE_KEYS, DataArguments, TrainScriptArguments, armor_only_fields,
)
from armor_trl.app.recipe.loading import UniqueKeyLoader, load_recipe, read_json, read_jsonl, read_yaml
from armor_trl.app.recipe.parsing import (
    RENAMED_TRAINING_FIELDS, parse_train_args, recipe_value, resolve_resume_from_checkpoint, with_installed_names,
)
from armor_trl.app.recipe.validation import (
    BOOL_STRINGS, check_mixture_entries, check_recipe_values, check_values, dataset_config_fields, describe_type,
    kind_of, machine_memory, recipe_fields, value_matches,
)

__all__ = [
    "ARITHMETIC_TRAIN", "ARITHMETIC_TRAIN_CARRY", "BOOL_STRINGS", "METHODS", "REFUSED_TRL_FIELDS", "RENAMED_TRAINING_FIELDS",
    "RESERVED_RECIPE_KEYS", "DataArguments", "TrainScriptArguments", "UniqueKeyLoader", "armor_only_fields",
    "build_trainer", "check_mixture_entries", "check_recipe_values", "check_values", "dataset_config_fields",
    "describe_type", "held_out_source", "kind_of", "load_datasets", "load_recipe", "machine_memory", "mixture_datasets",
    "named_validation_sets", "parse_train_args", "read_json", "read_jsonl", "read_yaml", "recipe_fields",
    "recipe_value", "resolve_resume_from_checkpoint", "train_datasets", "validation_callback", "validation_sets",
    "value_matches", "with_installed_names",
]
