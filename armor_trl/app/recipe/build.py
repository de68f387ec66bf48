"""Building a run from a parsed recipe: its training and held-out datasets (a registered or hub dataset, the arithmetic
task, or a ``datasets:`` mixture, written as ``prompt``/``answer`` rows), its named validation sets, the validation
callback, and the trainer, ArmorGRPOTrainer or ``trl.GRPOTrainer`` (:func:`build_trainer`).
"""

from __future__ import annotations

import os

from armor_trl.app.recipe.fields import DataArguments, TrainScriptArguments

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
                                                args.arithmetic_eval_filter, args.arithmetic_train_carry_share,
                                                args.arithmetic_eval_digits)
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

    from armor_trl.app.tool_testbed import resolve_tools
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
        tools=resolve_tools(script_args.tools, script_args.tool_failure_rate, training_args.seed) or None,
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
