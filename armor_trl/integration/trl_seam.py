"""Every touch point of TRL's (and transformers') private surface, in one place with its vLLM half,
:mod:`armor_trl.integration.vllm_engine`.

ArmorGRPOTrainer overrides a few private methods of ``trl.GRPOTrainer`` (``OVERRIDDEN``), reads or writes a few
private attributes (``ATTRIBUTES``), calls a few private methods (``CALLED``) and helpers that TRL does not export
(``HELPERS``); what it calls on TRL's vLLM wrapper, and the names of vLLM it replaces, are in ``vllm_engine``. No
module of armor_trl but these two touches any of them (tests/test_trl_seam.py greps for it).
``check_trl_surface`` verifies that all of them (the vLLM wrapper's methods included; ``vllm_engine.check_vllm_surface``
checks vLLM's own names) still exist with the parameters we rely on, and that
``GRPOTrainer._compute_loss`` still computes the policy's log-probs with one call, the path by which the mixed
log-probs reach TRL's loss (:func:`loss_logps_replaced`); the test suite runs it against the pinned TRL version, so a
TRL upgrade that moves them fails loudly instead of silently running plain GRPO.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import os
import re

import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig, PreTrainedModel, Trainer
from transformers.core_model_loading import revert_weight_conversion
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from trl import GRPOTrainer
from trl.data_utils import is_conversational
from trl.trainer.utils import (
    add_fused_lm_head,
    create_model_from_path,
    disable_dropout_in_model,
    get_config_model_id,
    use_adapter,
)

from armor_trl.algorithm.mixture import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES
from armor_trl.integration import vllm_engine

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
    "_load_from_checkpoint": ["resume_from_checkpoint", "model"],
}
# private methods called (not overridden) -> parameters we pass
CALLED = {
    "_get_output_dir": ["trial"],
    "_determine_best_metric": ["metrics", "trial"],
}
# What TRL's generation reads for its sampling settings: the trainer's GenerationConfig (transformers path) and the
# vLLM wrapper's attributes (vLLM path, where generation_kwargs is applied last). The trainer's own attributes are
# read elsewhere (the log-prob temperature); they are set too, so that nothing sees training's values in the block.
SAMPLING_ATTRIBUTES = ("temperature", "top_p", "max_completion_length")
# private attributes read or written (the vLLM ones exist only with use_vllm=True, generation_config only without)
ATTRIBUTES = (
    "_metrics", "_pending_extra_logs", "_pending_metrics", "model_wrapped", "use_vllm", "_tokenizer", "_buffered_inputs",
    "_is_vlm", "generation_config", "generation_kwargs", "_step", "_entropy_bonus_enabled", "_last_world_entropy",
    *SAMPLING_ATTRIBUTES,
)
VLLM_ATTRIBUTES = ("vllm_generation", "_last_loaded_step")
# helpers imported from TRL (and transformers) modules that their top level does not export (imported above: a move
# fails at import)
HELPERS = ("trl.trainer.utils.add_fused_lm_head", "trl.trainer.utils.create_model_from_path",
           "trl.trainer.utils.disable_dropout_in_model", "trl.trainer.utils.get_config_model_id",
           "trl.trainer.utils.use_adapter", "trl.data_utils.is_conversational",
           "trl.chat_template_utils.parse_response", "transformers.core_model_loading.revert_weight_conversion")
# GRPOTrainer._compute_loss computes the micro-batch's policy log-probs with exactly this many calls of
# _get_per_token_logps_and_entropies, and builds its ratio from that call's result (see loss_logps_replaced).
LOSS_LOGPS_CALLS = 1

# GRPOTrainer._generate calls the trainer's rollout_func attribute (ARMOR replaces it with its wrapper when anchors are
# on, armor_trl.rollout.rollout_func), and _get_per_token_logps_and_entropies takes a VLM batch's image fields by these names
# (armor_trl.rollout.multimodal passes them for π_ref's log-probs)
ROLLOUT_FUNC_CALL = "self.rollout_func(prompts, self)"
# GRPOTrainer._generate_and_score_completions decides with this test whether a round needs the old policy's log-probs
# (or vLLM's importance-sampling correction does) and keeps them only when its call returned them (round_logps_skipped)
OLD_LOGPS_TEST = "self.args.gradient_accumulation_steps % generate_every != 0"
OLD_LOGPS_KEPT = "if old_per_token_logps is not None:"
# GRPOTrainer._prepare_inputs generates a new rollout batch for a micro-batch when this holds (rollout_batch_ended)
NEW_ROLLOUT_TEST = "if self._step % generate_every == 0 or self._buffered_inputs is None:"
LOGPS_IMAGE_FIELDS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                      "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")

# GRPOTrainer's KL term (β ≠ 0): built in _compute_loss from the input of this name and the policy log-probs of the loss's
# call above, after that call; GRPOTrainer.__init__ builds a reference model of its own when args.beta ≠ 0
KL_REFERENCE_INPUT = "ref_per_token_logps"

SUPPORTED_TRL = ">=1.16.0,<1.17"


def _starts_with(function, params: list[str]) -> str | None:
    actual = list(inspect.signature(function).parameters)[1:]
    return None if actual[: len(params)] == params else f"takes {actual}, expected to start with {params}"


def check_trl_surface() -> list[str]:
    """Return a list of problems with TRL's private surface (empty when everything we use is there)."""
    problems = []
    for name, params in {**OVERRIDDEN, **CALLED}.items():
        method = getattr(GRPOTrainer, name, None)
        if method is None:
            problems.append(f"GRPOTrainer.{name} is missing")
        elif (problem := _starts_with(method, params)) is not None:
            problems.append(f"GRPOTrainer.{name} {problem}")
    loss_source = inspect.getsource(GRPOTrainer._compute_loss)
    named = sorted(set(re.findall(r'"(\w+)"', " ".join(re.findall(r"self\.loss_type (?:==|in) (\[[^]]*\]|\"\w+\")",
                                                                  loss_source)))))
    if named != sorted(LOSS_TYPES):
        problems.append(f"GRPOTrainer._compute_loss handles the loss types {named}, armor_trl knows {sorted(LOSS_TYPES)} "
                        "(mixture.LOSS_TYPES): what the mixed ratio is in each must be derived again")
    levels = sorted(set(re.findall(r'self\.importance_sampling_level == "(\w+)"', loss_source)))
    if levels != sorted(IMPORTANCE_SAMPLING_LEVELS):
        problems.append(f"GRPOTrainer._compute_loss handles the importance-sampling levels {levels}, armor_trl knows "
                        f"{sorted(IMPORTANCE_SAMPLING_LEVELS)} (mixture.IMPORTANCE_SAMPLING_LEVELS)")
    calls = loss_source.count("self._get_per_token_logps_and_entropies(")
    if calls != LOSS_LOGPS_CALLS:
        problems.append(f"GRPOTrainer._compute_loss calls _get_per_token_logps_and_entropies {calls} times, expected "
                        f"{LOSS_LOGPS_CALLS}: the mixed log-probs would not reach TRL's ratio as they should")
    kl_read = loss_source.find(f'inputs["{KL_REFERENCE_INPUT}"]')
    if kl_read < 0 or kl_read < loss_source.find("self._get_per_token_logps_and_entropies("):
        problems.append(f"GRPOTrainer._compute_loss does not read inputs[{KL_REFERENCE_INPUT!r}] after the policy's "
                        "log-probs: ARMOR + KL (beta != 0) would not hand TRL's KL term its reference")
    if ROLLOUT_FUNC_CALL not in inspect.getsource(GRPOTrainer._generate):
        problems.append(f"GRPOTrainer._generate no longer calls {ROLLOUT_FUNC_CALL}: ARMOR's rollout_func wrapper "
                        "would not be reached")
    round_source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    if OLD_LOGPS_TEST not in round_source or OLD_LOGPS_KEPT not in round_source:
        problems.append("GRPOTrainer._generate_and_score_completions no longer decides on (or keeps) the old policy's "
                        f"log-probs with {OLD_LOGPS_TEST!r} / {OLD_LOGPS_KEPT!r}: dynamic sampling's deferred "
                        "log-probs (round_logps_skipped, old_logps_needed) must be checked again")
    prepare_source = inspect.getsource(GRPOTrainer._prepare_inputs)
    if NEW_ROLLOUT_TEST not in prepare_source or "generate_every = self.args.steps_per_generation * " \
            "self.num_iterations" not in prepare_source:
        problems.append(f"GRPOTrainer._prepare_inputs no longer starts a rollout batch with {NEW_ROLLOUT_TEST!r}: "
                        "where π_ref's resets act (rollout_batch_ended) must be checked again")
    logps_params = set(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)
    if missing := [name for name in LOGPS_IMAGE_FIELDS if name not in logps_params]:
        problems.append(f"GRPOTrainer._get_per_token_logps_and_entropies lacks the image fields {missing}")
    module_name, _, class_name = vllm_engine.VLLM_ENGINE.rpartition(".")
    try:
        engine = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        problems.append(f"{vllm_engine.VLLM_ENGINE} cannot be imported: {error}")
    else:
        for name, params in {**vllm_engine.VLLM_ENGINE_METHODS, "__init__": vllm_engine.VLLM_ENGINE_INIT}.items():
            method = getattr(engine, name, None)
            if method is None:
                problems.append(f"{class_name}.{name} is missing")
            elif name == "__init__":
                missing = sorted(set(params) - set(inspect.signature(method).parameters))
                if missing:
                    problems.append(f"{class_name}.__init__ lacks parameters {missing}")
            elif (problem := _starts_with(method, params)) is not None:
                problems.append(f"{class_name}.{name} {problem}")
    return problems


def missing_attributes(trainer: GRPOTrainer) -> list[str]:
    """The private attributes of ``ATTRIBUTES`` (and ``VLLM_ATTRIBUTES`` with vLLM) a trainer lacks."""
    names = ATTRIBUTES + (VLLM_ATTRIBUTES if trainer.use_vllm else ())
    if trainer.use_vllm:
        names = tuple(name for name in names if name != "generation_config")
    return [name for name in names if not hasattr(trainer, name)]


# --- trainer state -------------------------------------------------------------------------------------------------
def is_vlm(trainer: GRPOTrainer) -> bool:
    """Whether TRL treats the model as vision-language (multimodal prompts)."""
    return trainer._is_vlm


def tokenizer(trainer: GRPOTrainer):
    """The text tokenizer TRL uses (the processing class itself, or a processor's tokenizer)."""
    return trainer._tokenizer


def pad_token_id(trainer: GRPOTrainer) -> int:
    """The id TRL pads prompts and completions with."""
    return trainer._tokenizer.pad_token_id


def log_metric(trainer: GRPOTrainer, name: str, value: float, mode: str = "train") -> None:
    """Append a value to TRL's metric buffer; TRL averages and logs it at the next logging step. NaN (no data this
    round) is left out: a metric without any value in a logging window is not logged (TRL would log None)."""
    if not math.isnan(value):
        trainer._metrics[mode][name].append(float(value))


def drop_metrics_without_values(trainer: GRPOTrainer, mode: str) -> None:
    """Forget the buffered metrics that hold no value but NaN (TRL would log them as None, which reporters warn
    about), e.g. TRL's clip ratios of a step whose tokens were all masked out."""
    metrics = trainer._metrics[mode]
    for name in [name for name, values in metrics.items() if all(math.isnan(value) for value in values)]:
        del metrics[name]


def add_completion_column(trainer: GRPOTrainer, name: str, values: list) -> None:
    """Extend a column of TRL's completions table (``log_completions``) for this round's local rows; TRL gathers it
    across processes with the rows' prompts and completions, so it stays aligned with them."""
    trainer._pending_extra_logs[name].extend(values)


@contextlib.contextmanager
def completion_columns_spread(trainer: GRPOTrainer, rows: list[int], total: int):
    """Within the block, reward functions score (and log extra completion columns for) ``rows`` of a round of
    ``total`` local rows only; afterwards each column they extended holds ``total`` entries, None for the other rows,
    so TRL's completions table stays aligned with its rows."""
    before = {column: len(values) for column, values in trainer._pending_extra_logs.items()}
    yield
    for column, values in trainer._pending_extra_logs.items():
        start = before.get(column, 0)
        if len(values) - start == len(rows):
            spread = [None] * total
            for row, value in zip(rows, values[start:]):
                spread[row] = value
            values[start:] = spread


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


def buffered_micro_batches(trainer: GRPOTrainer) -> list[dict]:
    """TRL's buffered generation batch, split into its ``steps_per_generation`` micro-batches (this process's rows)."""
    return trainer._buffered_inputs


def rollout_batch_ended(trainer: GRPOTrainer) -> bool:
    """Whether TRL generates a new rollout batch for the next micro-batch (its buffered one is used up, or none is
    buffered), as ``GRPOTrainer._prepare_inputs`` decides (``NEW_ROLLOUT_TEST``)."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    return trainer._buffered_inputs is None or trainer._step % generate_every == 0


def micro_batch_step(trainer: GRPOTrainer) -> int:
    """TRL's count of micro-batches trained so far (during a loss: the index of the current one)."""
    return trainer._step


def entropy_bonus_enabled(trainer: GRPOTrainer) -> bool:
    """Whether TRL's loss adds an entropy bonus (``entropy_coef`` ≠ 0 or ``use_adaptive_entropy``)."""
    return trainer._entropy_bonus_enabled


def entropy_bonus_coef(trainer: GRPOTrainer) -> float:
    """The coefficient TRL's next loss applies to its entropy bonus (0 while the adaptive controller holds it off);
    read before the loss, which may update it at the end of an optimizer step."""
    if not trainer._entropy_bonus_enabled:
        return 0.0
    if trainer.use_adaptive_entropy and trainer._last_world_entropy > trainer.args.entropy_target:
        return 0.0
    return trainer.entropy_coef


# --- checkpoints ---------------------------------------------------------------------------------------------------
def checkpoint_dir(trainer: Trainer, step: int, trial=None) -> str:
    """The folder transformers writes (or wrote) the checkpoint of optimizer step ``step`` to."""
    return os.path.join(trainer._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{step}")


@contextlib.contextmanager
def rotation_deferred(trainer: Trainer):
    """Within the block, ``Trainer._save_checkpoint`` writes a checkpoint without deleting older ones (it rotates
    ``save_total_limit`` itself at its end); :func:`rotate` does it once the checkpoint is complete."""
    limit = trainer.args.save_total_limit
    trainer.args.save_total_limit = None
    try:
        yield
    finally:
        trainer.args.save_total_limit = limit


def rotate(trainer: Trainer, trial=None) -> None:
    """Delete checkpoints beyond ``save_total_limit`` (oldest first, the best one kept), as transformers does."""
    if trainer.args.save_total_limit and trainer.args.should_save:
        rotate_checkpoints(trainer._get_output_dir(trial=trial), trainer.args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)


def load_weights(trainer: Trainer, checkpoint: str) -> None:
    """Load a checkpoint's model weights into the policy (transformers' own loader: full model or adapter)."""
    trainer._load_from_checkpoint(checkpoint)


def checkpoint_key_names(model) -> dict[str, str] | None:
    """The names ``save_pretrained`` gives ``model``'s tensors in a checkpoint where they are not the model's own
    (transformers' conversion mapping, reversed: a Qwen2-VL saves ``model.visual.*`` as ``visual.*``), as
    {checkpoint name: the model's name}; None where it keeps the model's names. A conversion that fuses or splits
    tensors cannot be read back by a renaming: refused, naming the tensors."""
    if not isinstance(model, PreTrainedModel):
        return None
    placeholders = {name: tensor.detach().to("meta") for name, tensor in model.state_dict().items()}
    saved = revert_weight_conversion(model, placeholders)
    if all(placeholders.get(name) is tensor for name, tensor in saved.items()):
        return None
    model_names = {id(tensor): name for name, tensor in placeholders.items()}
    if converted := sorted(name for name, tensor in saved.items() if id(tensor) not in model_names):
        raise ValueError(
            f"{type(model).__name__} is saved with tensors converted ({', '.join(converted[:3])}, ...), which no "
            "renaming loads back (transformers' Trainer would leave them at their initial values, silently): "
            "resuming it is refused. Start a new run with the checkpoint as `model` (from_pretrained converts them)."
        )
    return {name: model_names[id(tensor)] for name, tensor in saved.items()}


def is_new_best(trainer: Trainer, metrics: dict) -> bool:
    """Feed evaluation-style metrics (``eval_`` keys) to transformers' best-checkpoint bookkeeping."""
    return trainer._determine_best_metric(metrics, trial=None)


def grpo_citation() -> str:
    """The BibTeX of GRPO's paper, as TRL's GRPOTrainer cites it in model cards."""
    return GRPOTrainer._paper["citation"]


# --- models ----------------------------------------------------------------------------------------------------------
def model_id(model) -> str:
    """The hub id or path a model was loaded from (TRL's helper)."""
    return get_config_model_id(model.config)


def load_causal_lm(source: str, **init_kwargs):
    """Build a causal LM from a path or hub id the way GRPOTrainer builds its models."""
    return create_model_from_path(source, **init_kwargs)


def prepare_like_reference_model(trainer: GRPOTrainer, model, cast_lm_head_to_fp32: bool):
    """What GRPOTrainer does to its own reference model: no dropout (if asked), its fused LM head, and the
    DeepSpeed / FSDP / accelerate preparation for evaluation."""
    from trl.models import prepare_deepspeed, prepare_fsdp

    if trainer.args.disable_dropout:
        disable_dropout_in_model(model)
    add_fused_lm_head(model, temperature=trainer.temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32)
    if trainer.is_deepspeed_enabled:
        return prepare_deepspeed(model, trainer.accelerator)
    if trainer.is_fsdp_enabled:
        return prepare_fsdp(model, trainer.accelerator)
    return trainer.accelerator.prepare_model(model, evaluation_mode=True)


def adapter_active(model, adapter_name: str):
    """Context in which a PEFT model runs with ``adapter_name`` active (TRL's helper)."""
    return use_adapter(model, adapter_name=adapter_name)


@contextlib.contextmanager
def no_kl_reference_built(args):
    """Within the block (GRPOTrainer's construction with ARMOR on), TRL sees β = 0: it builds no reference model of its
    own and computes no reference log-probs per batch; ARMOR's π_ref serves the KL term (:func:`kl_term`)."""
    beta, args.beta = args.beta, 0.0
    try:
        yield
    finally:
        args.beta = beta


@contextlib.contextmanager
def kl_term(trainer: GRPOTrainer, beta: float):
    """Within the block (one call of ``GRPOTrainer._compute_loss``), TRL's loss adds its KL term with coefficient
    ``beta``, reading the reference's log-probs from the input ``KL_REFERENCE_INPUT``; outside it TRL's β stays 0."""
    trainer.beta = beta
    try:
        yield
    finally:
        trainer.beta = 0.0


# --- generation and scoring ------------------------------------------------------------------------------------------
def generate(trainer: GRPOTrainer, prompt_ids: list[list[int]], num_generations: int) -> list[list[int]]:
    """Sample completions with the trainer's own generation path (no tool loop, no decoding); in a vision-language
    round, each row with its own prompt's images (``trainer.media_for``)."""
    media = getattr(trainer, "media_for", None)  # a VLM round: each row's images (armor_trl.rollout.multimodal.RowMedia)
    images, fields = (None, {}) if media is None else media(prompt_ids)
    completion_ids, _ = GRPOTrainer._generate_single_turn(trainer, prompt_ids, images, fields, num_generations)
    check_row_count(completion_ids, prompt_ids)
    return completion_ids


def check_row_count(completion_ids: list, prompt_ids: list) -> None:
    """One completion per prompt row, or a loud error: TRL's continuous-batching path logs requests that failed or
    went missing and returns the others, which would shift every later row onto another prompt."""
    if len(completion_ids) != len(prompt_ids):
        raise RuntimeError(
            f"The generation path returned {len(completion_ids)} completions for {len(prompt_ids)} prompt rows (with "
            "use_transformers_continuous_batching, requests failed or went missing: see transformers' log above); "
            "anchors cannot be placed on rows that do not match their prompts."
        )


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
    """Route the trainer's generation path through ``model`` (the reference) within the block, and leave it as it was
    found: in eval mode, with its own tensors. TRL's continuous-batching path casts the model it generates with in
    place (``bf16`` / ``fp16``: the whole model; ``cast_lm_head_to_fp32``: the LM head) and sets it to train mode;
    the reference gets back the very tensors it had (a cast makes new ones), so its log-probs and resets stay exact."""
    if model is None:
        yield
        return
    policy = trainer.model_wrapped
    trainer.model_wrapped = model
    tensors = [(t, t.data) for t in (*model.parameters(), *model.buffers())]
    try:
        yield
    finally:
        trainer.model_wrapped = policy
        with torch.no_grad():
            for tensor, data in tensors:
                if tensor.dtype != data.dtype:  # (a ZeRO-3 gather puts its own data back itself: same dtype)
                    tensor.data = data
        model.eval()


def decode(trainer: GRPOTrainer, completion_ids: list[list[int]], conversational: bool) -> list:
    """Decode completions the way GRPOTrainer hands them to reward functions."""
    texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    if conversational:
        return [[{"role": "assistant", "content": text}] for text in texts]
    return texts


def decode_for_rewards(trainer: GRPOTrainer, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                       prompts: list) -> list:
    """Decode completions exactly as ``GRPOTrainer._generate`` hands them to reward functions (no tools: anchors
    refuse them): chat prompts parsed by the tokenizer's response schema where transformers >= 5 has one, else
    decoded into an assistant message; text prompts decoded."""
    if not is_conversational({"prompt": prompts[0]}):
        return trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    tokenizer = trainer._tokenizer
    schema = getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema",
                                                                                  None) is not None
    if schema and Version(transformers.__version__) >= Version("5.0.0"):  # parse_response: transformers 5
        from trl.chat_template_utils import parse_response

        return [[parse_response(tokenizer, ids, prefix=prefix, tools=None)]
                for ids, prefix in zip(completion_ids, prompt_ids)]
    return decode(trainer, completion_ids, True)


def score(trainer: GRPOTrainer, inputs: list[dict], prompts: list, completions: list, completion_ids: list):
    """TRL's own scoring of rows of the round (``GRPOTrainer._calculate_rewards``, not ARMOR's override): the reward
    functions, their logged metrics and completion columns, gathered over processes (every process must call it with
    the same number of rows)."""
    return GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, completion_ids)


def is_truncated(trainer: GRPOTrainer, completion_ids: list[int]) -> bool:
    """Whether TRL's ``mask_truncated_completions`` masks this completion out of the loss (as it judges a round's
    rows: on, and the completion does not end in EOS or padding)."""
    if not trainer.mask_truncated_completions or not completion_ids:
        return False
    return completion_ids[-1] not in [*trainer.eos_token_ids, trainer._tokenizer.pad_token_id]


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


def per_token_logps(trainer: GRPOTrainer, model, input_ids, attention_mask, logits_to_keep, batch_size,
                    **image_fields):
    """Per-token log-probs of the completion tokens under ``model`` (TRL's chunked fused-head forward; a VLM batch's
    ``image_fields`` as TRL passes them: pixel_values, image_grid_thw, num_images, ...)."""
    logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
        trainer, model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **image_fields
    )
    return logps


def vllm_correction(trainer: GRPOTrainer) -> bool:
    """Whether TRL corrects vLLM's sampling with an importance ratio (it then needs the old policy's log-probs in the
    round that generated the rows)."""
    return trainer.use_vllm and trainer.vllm_importance_sampling_correction


def old_logps_needed(trainer: GRPOTrainer) -> bool:
    """Whether TRL computes the old policy's log-probs of a generation batch (``OLD_LOGPS_TEST``): its rows are trained
    over more than one optimizer step (``steps_per_generation`` × ``num_iterations`` does not divide the gradient
    accumulation steps), or vLLM's importance-sampling correction reads them."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    return trainer.args.gradient_accumulation_steps % generate_every != 0 or vllm_correction(trainer)


@contextlib.contextmanager
def round_logps_skipped(trainer: GRPOTrainer):
    """Within the block (one call of ``GRPOTrainer._generate_and_score_completions`` with β = 0 and no vLLM
    importance-sampling correction), TRL's forward pass for the old policy's log-probs is not made: the override of
    ``_get_per_token_logps_and_entropies`` returns None while :func:`logps_call_skipped` says so, and TRL leaves
    them out of the round's output (``OLD_LOGPS_KEPT``). The caller computes them for the rows that train."""
    if trainer.beta != 0.0 or vllm_correction(trainer):
        raise RuntimeError("round_logps_skipped needs beta=0 and no vLLM importance-sampling correction: TRL reads the "
                           "skipped log-probs within the round then")
    trainer._armor_skip_logps = True
    try:
        yield
    finally:
        trainer._armor_skip_logps = False


def logps_call_skipped(trainer: GRPOTrainer) -> bool:
    """Whether a call of ``_get_per_token_logps_and_entropies`` now is the round's skipped pass (round_logps_skipped)."""
    return getattr(trainer, "_armor_skip_logps", False)


# --- the mixed ratio's path into TRL's loss ---------------------------------------------------------------------------
@contextlib.contextmanager
def loss_logps_replaced(trainer: GRPOTrainer, replace):
    """Within the block (one call of ``GRPOTrainer._compute_loss``), the policy log-probs TRL's loss is built from are
    ``replace(logps)``: the override of ``_get_per_token_logps_and_entropies`` hands its result to
    :func:`replaced_loss_logps`, which applies ``replace`` to the first call only (``LOSS_LOGPS_CALLS``). Yields a
    dict whose ``"logps"`` and ``"entropies"`` hold that call's results afterwards. Raises if TRL did not make exactly that call."""
    seen = {"replace": replace, "calls": 0}
    trainer._armor_loss_logps = seen
    try:
        yield seen
    finally:
        trainer._armor_loss_logps = None
    if seen["calls"] != LOSS_LOGPS_CALLS:
        raise RuntimeError(
            f"GRPOTrainer._compute_loss computed the policy's log-probs {seen['calls']} times, armor_trl expects "
            f"{LOSS_LOGPS_CALLS} (trl_seam.LOSS_LOGPS_CALLS): this TRL version is not supported ({SUPPORTED_TRL})."
        )


def replaced_loss_logps(trainer: GRPOTrainer, logps, entropies=None):
    """The log-probs to hand TRL from ``_get_per_token_logps_and_entropies``: ``replace(logps)`` for the loss's own
    call inside :func:`loss_logps_replaced` (which keeps ``logps`` and ``entropies``), else ``logps`` unchanged."""
    seen = getattr(trainer, "_armor_loss_logps", None)
    if seen is None:
        return logps
    seen["calls"] += 1
    if seen["calls"] > LOSS_LOGPS_CALLS:
        return logps
    seen["logps"], seen["entropies"] = logps, entropies
    return seen["replace"](logps)
