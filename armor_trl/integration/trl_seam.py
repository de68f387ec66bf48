"""Every touch point of TRL's (and transformers') private surface: the list of them and its check, the trainer's
state, checkpoints, models, the KL term and the mixed ratio's path into TRL's loss. Its generation and scoring
helpers are in :mod:`armor_trl.integration.trl_generation`, TRL's vLLM wrapper in
:mod:`armor_trl.integration.vllm_engine`.

ArmorGRPOTrainer overrides a few private methods of ``trl.GRPOTrainer`` (``OVERRIDDEN``), reads or writes a few
private attributes (``ATTRIBUTES``), calls a few private methods (``CALLED``) and helpers that TRL does not export
(``HELPERS``), here and in ``trl_generation``; what it calls on TRL's vLLM wrapper, and the names of vLLM it replaces,
are in ``vllm_engine``. No module of armor_trl but these three touches any of them (tests/test_trl_seam.py greps for
it). ``check_trl_surface`` verifies that all of them (the vLLM wrapper's methods included;
``vllm_engine.check_vllm_surface`` checks vLLM's own names) still exist with the parameters we rely on, and that
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

from transformers import PreTrainedModel, Trainer
from transformers.core_model_loading import revert_weight_conversion
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from trl import GRPOTrainer
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
    # the tool loop (armor_trl.rollout.tool_anchors): the round's prompts, and the loop's result for rows it already ran
    "_generate": ["prompts"],
    "_tool_call_loop": ["prompts", "prompt_ids", "completion_ids", "completions", "logprobs", "images",
                        "multimodal_fields"],
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
# What GRPOTrainer sets up for its tool loop (read and swapped by trl_generation's tool-loop helpers): at construction
# the standalone tools, the environment factories by name, each environment's tools and the environments' own instance
# pool; per round, each row's tool dicts, environment name and instance (the ones set at batch time, or only with
# environment_factory, are checked in TRL's source, not on a built trainer)
TOOL_ATTRIBUTES = ("_standalone_tools", "environment_factories", "_multi_environment", "_env_tools",
                   "_environment_pool", "environments", "_sync_tool_dicts", "_async_tool_dicts", "_batch_environments")
# helpers imported from TRL (and transformers) modules that their top level does not export (here and in
# trl_generation)
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
    trainer_source = inspect.getsource(GRPOTrainer)
    if missing := [name for name in TOOL_ATTRIBUTES if f"self.{name} =" not in trainer_source]:
        problems.append(f"GRPOTrainer no longer sets {missing}: anchors on the tool loop read and swap them "
                        "(armor_trl.rollout.tool_anchors)")
    for helper in HELPERS:
        helper_module, _, helper_name = helper.rpartition(".")
        try:
            getattr(importlib.import_module(helper_module), helper_name)
        except (ImportError, AttributeError) as error:
            problems.append(f"{helper} cannot be imported: {error}")
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
    so TRL's completions table stays aligned with its rows. With ``environment_factory`` the reward functions get
    the environments of ``rows`` (TRL hands them the round's, one per row)."""
    before = {column: len(values) for column, values in trainer._pending_extra_logs.items()}
    environments = trainer.environments
    if environments is not None and len(environments) == total:
        trainer.environments = [environments[row] for row in rows]
    try:
        yield
    finally:
        trainer.environments = environments
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


def step_micro_batches(trainer: GRPOTrainer, inputs: dict) -> list[dict]:
    """The micro-batches (this process's rows) of the optimizer step that ``inputs`` belongs to, taken from TRL's
    buffered generation batch (split into ``steps_per_generation`` micro-batches; TRL's ``_step`` counts those trained
    so far, so during a loss it indexes ``inputs``); ``[inputs]`` alone for a loss computed outside TRL's training
    step."""
    buffered, per_generation, step = trainer._buffered_inputs, trainer.args.steps_per_generation, trainer._step
    if not buffered or buffered[step % per_generation] is not inputs:
        return [inputs]
    start = step - step % trainer.current_gradient_accumulation_steps
    return [buffered[s % per_generation] for s in range(start, start + trainer.current_gradient_accumulation_steps)]


def rollout_batch_ended(trainer: GRPOTrainer) -> bool:
    """Whether TRL generates a new rollout batch for the next micro-batch (its buffered one is used up, or none is
    buffered), as ``GRPOTrainer._prepare_inputs`` decides (``NEW_ROLLOUT_TEST``)."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    return trainer._buffered_inputs is None or trainer._step % generate_every == 0


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
