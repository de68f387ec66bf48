"""Every touch point of TRL's private surface, in one place.

ArmorGRPOTrainer overrides a few private methods of ``trl.GRPOTrainer`` (listed in
``OVERRIDDEN``) and calls a few more through the helpers below. ``check_trl_surface`` verifies that
all of them still exist with the parameters we rely on; the test suite runs it against the pinned
TRL version, so a TRL upgrade that moves them fails loudly instead of silently running plain GRPO.
"""

from __future__ import annotations

import contextlib
import inspect

from transformers import GenerationConfig
from trl import GRPOTrainer
from trl.data_utils import is_conversational

# private method -> parameters we pass or receive (in order, after self)
OVERRIDDEN = {
    "_generate_and_score_completions": ["inputs"],
    "_generate_single_turn": ["prompt_ids", "images", "multimodal_fields", "num_generations"],
    "_calculate_rewards": ["inputs", "prompts", "completions", "completion_ids_list"],
    "_get_per_token_logps_and_entropies": ["model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"],
    "_compute_loss": ["model", "inputs"],
    # transformers.Trainer's checkpoint hooks (TRL overrides them too)
    "_save_checkpoint": ["model", "trial"],
    "_load_optimizer_and_scheduler": ["checkpoint"],
}
# What TRL's generation reads for its sampling settings: the trainer's GenerationConfig (transformers path) and the
# vLLM wrapper's attributes (vLLM path, where generation_kwargs is applied last). The trainer's own attributes are
# read elsewhere (the log-prob temperature); they are set too, so that nothing sees training's values in the block.
SAMPLING_ATTRIBUTES = ("temperature", "top_p", "max_completion_length")
# private attributes read or written (the vLLM ones exist only with use_vllm=True, generation_config only without)
ATTRIBUTES = (
    "_metrics", "_pending_extra_logs", "_pending_metrics", "model_wrapped", "use_vllm", "_tokenizer", "_buffered_inputs",
    "generation_config", "generation_kwargs", *SAMPLING_ATTRIBUTES,
)
VLLM_ATTRIBUTES = ("vllm_generation", "_last_loaded_step")

SUPPORTED_TRL = ">=1.16.0,<1.17"


def check_trl_surface() -> list[str]:
    """Return a list of problems with TRL's private surface (empty when everything we use is there)."""
    problems = []
    for name, params in OVERRIDDEN.items():
        method = getattr(GRPOTrainer, name, None)
        if method is None:
            problems.append(f"GRPOTrainer.{name} is missing")
            continue
        actual = list(inspect.signature(method).parameters)[1:]
        if actual[: len(params)] != params:
            problems.append(f"GRPOTrainer.{name} takes {actual}, expected to start with {params}")
    return problems


def engine_step(trainer: GRPOTrainer) -> int:
    """The optimizer step whose policy weights TRL last pushed to vLLM (-1: must push before the next rollout)."""
    return trainer._last_loaded_step


def set_engine_step(trainer: GRPOTrainer, step: int) -> None:
    trainer._last_loaded_step = step


def discard_rollouts(trainer: GRPOTrainer) -> None:
    """The policy's weights changed outside an optimizer step: drop the buffered generation batch (TRL generates a new
    one at the next step) and make TRL push the weights to vLLM before its next rollout."""
    trainer._buffered_inputs = None
    if trainer.use_vllm:
        set_engine_step(trainer, -1)


def pad_token_id(trainer: GRPOTrainer) -> int:
    """The id TRL pads prompts and completions with."""
    return trainer._tokenizer.pad_token_id


def log_metric(trainer: GRPOTrainer, name: str, value: float, mode: str = "train") -> None:
    """Append a value to TRL's metric buffer; TRL averages and logs it at the next logging step."""
    trainer._metrics[mode][name].append(float(value))


def generate(trainer: GRPOTrainer, prompt_ids: list[list[int]], num_generations: int) -> list[list[int]]:
    """Sample completions with the trainer's own generation path (no tool loop, no decoding)."""
    completion_ids, _ = GRPOTrainer._generate_single_turn(trainer, prompt_ids, None, {}, num_generations)
    return completion_ids


_SAMPLING_KWARGS = ("temperature", "top_p", "max_tokens", "max_new_tokens", "do_sample")


@contextlib.contextmanager
def sampling_with(trainer: GRPOTrainer, temperature: float, top_p: float, max_tokens: int):
    """TRL's generation path samples with these settings within the block (0 temperature: greedy); training's
    settings are restored afterwards. top-k, min-p and repetition penalty stay training's."""
    if temperature < 0 or not 0 < top_p <= 1 or max_tokens < 1:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1 and max_tokens >= 1, got {temperature}, {top_p}, "
                         f"{max_tokens}")
    values = {"temperature": temperature, "top_p": top_p, "max_completion_length": max_tokens}
    targets = [trainer] + ([trainer.vllm_generation] if trainer.use_vllm else [])
    saved = [(obj, {name: getattr(obj, name) for name in SAMPLING_ATTRIBUTES}) for obj in targets]
    if trainer.use_vllm:
        engine = trainer.vllm_generation
        saved.append((engine, {"generation_kwargs": engine.generation_kwargs}))
        kept = {k: v for k, v in engine.generation_kwargs.items() if k not in _SAMPLING_KWARGS}
    else:
        saved.append((trainer, {"generation_config": trainer.generation_config,
                                "generation_kwargs": trainer.generation_kwargs}))
        kwargs = {k: v for k, v in trainer.generation_kwargs.items() if k not in _SAMPLING_KWARGS}
        kwargs.update(max_new_tokens=max_tokens, do_sample=temperature > 0)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=top_p)
        else:  # greedy: no sampling filters (transformers warns about them)
            kwargs = {k: v for k, v in kwargs.items() if k not in ("top_k", "min_p")}
    try:
        for obj in targets:
            for name, value in values.items():
                setattr(obj, name, value)
        if trainer.use_vllm:
            engine.generation_kwargs = kept
        else:
            trainer.generation_kwargs = kwargs
            trainer.generation_config = GenerationConfig(**kwargs, disable_compile=True)
        yield
    finally:
        for obj, attributes in saved:
            for name, value in attributes.items():
                setattr(obj, name, value)


@contextlib.contextmanager
def generating_with(trainer: GRPOTrainer, model):
    """Route the trainer's generation path through ``model`` (the reference) within the block."""
    if model is None:
        yield
        return
    policy = trainer.model_wrapped
    trainer.model_wrapped = model
    try:
        yield
    finally:
        trainer.model_wrapped = policy
        model.eval()


def decode(trainer: GRPOTrainer, completion_ids: list[list[int]], conversational: bool) -> list:
    """Decode completions the way GRPOTrainer hands them to reward functions."""
    texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    if conversational:
        return [[{"role": "assistant", "content": text}] for text in texts]
    return texts


def is_conversational_prompt(prompt) -> bool:
    return is_conversational({"prompt": prompt})


def score_quietly(trainer: GRPOTrainer, inputs: list[dict], prompts: list, completions: list, completion_ids: list):
    """Score extra completions with the trainer's reward functions, without touching what TRL logs.

    Calls ``GRPOTrainer._calculate_rewards`` (which gathers across processes: every process must call
    this with the same number of rows) and restores the pending log buffers that reward functions may
    write to, so candidates never appear in the completions table or reward metrics.
    Returns this process's rows of the (rows, reward functions) reward tensor, NaN where a function
    returned None.
    """
    saved_extra = {k: list(v) for k, v in trainer._pending_extra_logs.items()}
    saved_metrics = {k: list(v) for k, v in trainer._pending_metrics.items()}
    try:
        gathered = GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, completion_ids)
    finally:
        trainer._pending_extra_logs.clear()
        trainer._pending_extra_logs.update(saved_extra)
        trainer._pending_metrics.clear()
        trainer._pending_metrics.update(saved_metrics)
    rank, rows = trainer.accelerator.process_index, len(prompts)
    return gathered[rank * rows : (rank + 1) * rows]


def per_token_logps(trainer: GRPOTrainer, model, input_ids, attention_mask, logits_to_keep, batch_size):
    """Per-token log-probs of the completion tokens under ``model`` (TRL's chunked fused-head forward)."""
    logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
        trainer, model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size
    )
    return logps
