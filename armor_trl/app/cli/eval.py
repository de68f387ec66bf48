"""``armor-trl eval --model PATH --dataset NAME [--k K ...]``: avg@k and pass@k of a model (a saved model, a hub id or
a LoRA adapter folder, merged onto its base model through PEFT) on a dataset with the built-in verifiers, its flags
parsed by TRL's ``TrlParser`` into :class:`EvalArguments` (a ``--config`` YAML file may give them, checked first),
the result printed and, with ``--output_dir``, written to ``<output_dir>/eval_results.json``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field

from armor_trl.integration.checks import unknown_names
from armor_trl.app.cli.common import flag_hints, warn_deprecated_output
from armor_trl.app.recipe.build import load_datasets
from armor_trl.app.recipe.fields import DataArguments

EVAL_RESULTS_FILE = "eval_results.json"  # what `armor-trl eval --output_dir DIR` writes there


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
