"""``armor-trl anchors``: pre-generate verified anchors from a recipe's reference (sample K completions per training
prompt, keep up to M verified ones, in resumable shards, across processes under ``accelerate launch``), to train on
with ``--anchor_source column --anchors_dataset DIR``; the library behind it is :mod:`armor_trl.data.pregenerate`."""

from __future__ import annotations

import argparse
import os
import sys

from armor_trl.app.cli.common import add_output_dir, require_recipe
from armor_trl.app.recipe.build import train_datasets
from armor_trl.app.recipe.parsing import parse_train_args


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
