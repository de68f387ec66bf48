"""``armor-trl train --config recipe.yaml [--field value ...]`` follows ``trl grpo``: TRL's own ``TrlParser``
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

import math
import os
import sys

from armor_trl.integration.launcher import check_use_cpu
from armor_trl.app.cli.common import require_recipe
from armor_trl.app.recipe.build import (
    build_trainer, held_out_source, load_datasets, named_validation_sets, train_datasets,
)
from armor_trl.app.recipe.fields import TrainScriptArguments
from armor_trl.app.recipe.loading import read_json, read_jsonl
from armor_trl.app.recipe.parsing import parse_train_args, resolve_resume_from_checkpoint


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


def reset_schedule(max_steps: int, every: int | None, until: int | None, at_steps=None,
                   rollout_end: int = 1) -> list[int]:
    """Optimizer steps (1..max_steps) after which ARMOR resets the reference: each step the schedule names, moved to
    the end of its rollout batch (a multiple of ``rollout_end``, :func:`~armor_trl.integration.checks.
    rollout_end_steps`)."""
    from armor_trl.reference.policy import reset_due

    due = (step for step in range(1, max_steps + 1) if reset_due(step, every, until, at_steps))
    return sorted({end for step in due if (end := -(-step // rollout_end) * rollout_end) <= max_steps})


def describe_resets(max_steps: int, every: int | None, until: int | None, at_steps=None, rollout_end: int = 1) -> str:
    if every is None and until is None and not at_steps:
        return "static reference (never reset)"
    parts = ([f"after every step up to {until}"] if until else []) + ([f"every {every} steps"] if every else
                                                                       ["frozen"] if until else [])
    what = ", and ".join(filter(None, [" then ".join(parts), f"after steps {list(at_steps)}" if at_steps else ""]))
    if max_steps <= 0:
        return f"reset {what}"
    steps = reset_schedule(max_steps, every, until, at_steps, rollout_end)
    shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
    ends = f" (at rollout-batch ends, every {rollout_end} steps)" if rollout_end > 1 else ""
    return f"reset {what}: {len(steps)} resets in {max_steps} steps{ends} ({shown or 'none'})"


def check_recipe(script_args, training_args, model_args) -> list[str]:
    """Validate what a run needs besides the parsed configs, without loading weights; return a summary."""
    from armor_trl.app.tool_testbed import resolve_tools
    from armor_trl.rewards import resolve_rewards

    if not model_args.model_name_or_path:
        raise ValueError("model_name_or_path is required.")
    if not script_args.dataset_name and script_args.dataset_mixture is None:
        raise ValueError("dataset_name (a registry name, hub id, local file or 'arithmetic') or a datasets mixture is "
                         "required.")
    rewards = resolve_rewards(script_args.reward_funcs)
    tools = resolve_tools(script_args.tools)
    if tools and not script_args.chat:
        raise ValueError("tools needs chat prompts (TRL's tool loop renders them with the chat template): set chat: "
                         "true.")
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
    if tools:
        lines.append(f"tools: {', '.join(script_args.tools)} (TRL's tool loop, at most "
                     f"{training_args.max_tool_calling_iterations or 'unlimited'} tool-calling iterations)")
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
        from armor_trl.integration.checks import rollout_end_steps

        lines.append("reference: " + describe_resets(max_steps, args.ref_reset_steps, args.ref_reset_every_step_until,
                                                     args.ref_reset_at_steps, rollout_end_steps(args)))
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
