"""The seam's part for TRL's generation and scoring path: sampling with the trainer's own generation path
(with other sampling settings, or through π_ref), decoding and scoring completions as GRPOTrainer does, the
per-token log-probs of its forward pass, and the old policy's log-prob pass that dynamic sampling defers.

Like :mod:`armor_trl.integration.trl_seam`, this module may touch TRL's private names; every one it touches is listed
there (``OVERRIDDEN``, ``ATTRIBUTES``, ``HELPERS``, ...) and verified by ``trl_seam.check_trl_surface``
(tests/test_trl_seam.py checks that it touches no name outside those lists).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect

import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig
from trl import GRPOTrainer
from trl.data_utils import is_conversational

from armor_trl.integration.trl_seam import SAMPLING_ATTRIBUTES


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
                       prompts: list, tools: list | None = None) -> list:
    """Decode completions exactly as ``GRPOTrainer._generate`` hands them to reward functions (and, with tools, to its
    tool loop): chat prompts parsed by the tokenizer's response schema where transformers >= 5 has one (with each
    row's ``tools``, :func:`row_tools`), else decoded into an assistant message; text prompts decoded."""
    if not is_conversational({"prompt": prompts[0]}):
        return trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    tokenizer = trainer._tokenizer
    schema = getattr(tokenizer, "response_template", None) is not None or getattr(tokenizer, "response_schema",
                                                                                  None) is not None
    if schema and Version(transformers.__version__) >= Version("5.0.0"):  # parse_response: transformers 5
        from trl.chat_template_utils import parse_response

        tools = tools or [None] * len(completion_ids)
        return [[parse_response(tokenizer, ids, prefix=prefix, tools=row)]
                for ids, prefix, row in zip(completion_ids, prompt_ids, tools, strict=True)]
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
    """Whether TRL computes the old policy's log-probs of a generation batch (``trl_seam.OLD_LOGPS_TEST``): its rows are trained
    over more than one optimizer step (``steps_per_generation`` × ``num_iterations`` does not divide the gradient
    accumulation steps), or vLLM's importance-sampling correction reads them."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    return trainer.args.gradient_accumulation_steps % generate_every != 0 or vllm_correction(trainer)


@contextlib.contextmanager
def round_logps_skipped(trainer: GRPOTrainer):
    """Within the block (one call of ``GRPOTrainer._generate_and_score_completions`` with β = 0 and no vLLM
    importance-sampling correction), TRL's forward pass for the old policy's log-probs is not made: the override of
    ``_get_per_token_logps_and_entropies`` returns None while :func:`logps_call_skipped` says so, and TRL leaves
    them out of the round's output (``trl_seam.OLD_LOGPS_KEPT``). The caller computes them for the rows that train."""
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


# --- the tool loop and environments (armor_trl.rollout.tool_anchors) ---------------------------------------------------
ENVIRONMENT_ONLY_METHODS = ("reset", "get_reward")  # an environment's methods that TRL does not expose as tools


@dataclasses.dataclass
class ToolRow:
    """What TRL's tool loop reads of one row: its tools (sync and async, by name) and its environment (name and
    instance; None without ``environment_factory``)."""

    sync_tools: dict
    async_tools: dict
    environment_name: object = None
    environment: object = None


def uses_tools(trainer: GRPOTrainer) -> bool:
    """Whether TRL runs its tool loop (``tools``, or an ``environment_factory`` whose environments have tools)."""
    return bool(trainer.tools)


def uses_environments(trainer: GRPOTrainer) -> bool:
    return trainer.environment_factories is not None


def round_tool_rows(trainer: GRPOTrainer, rows: int) -> list[ToolRow]:
    """The round's rows as TRL set them up for its tool loop (its tool dicts, environment names and instances)."""
    names = trainer._batch_environments if uses_environments(trainer) else [None] * rows
    environments = trainer.environments or [None] * rows
    if not uses_tools(trainer):  # environments without tool methods: TRL builds no tool dicts (and runs no loop)
        return [ToolRow({}, {}, name, environment) for name, environment in zip(names, environments, strict=True)]
    return [ToolRow(sync, async_, name, environment) for sync, async_, name, environment
            in zip(trainer._sync_tool_dicts, trainer._async_tool_dicts, names, environments, strict=True)]


def environment_name(trainer: GRPOTrainer, row: dict):
    """The environment a dataset row selects (its ``environment`` column with a dict factory; else None)."""
    return row.get("environment") if trainer._multi_environment else None


def reset_kwargs(trainer: GRPOTrainer, row: dict) -> dict:
    """What TRL passes an environment's ``reset`` for a row: the row, without its ``environment`` control column when
    several environments are configured."""
    return {k: v for k, v in row.items() if k != "environment"} if trainer._multi_environment else row


def new_environment(trainer: GRPOTrainer, name):
    """A new instance of the environment ``name``, made by the user's factory."""
    return trainer.environment_factories[name]()


def environment_tool_row(trainer: GRPOTrainer, name, environment) -> ToolRow:
    """A row's tool dicts as TRL builds them: the standalone tools and the environment's public methods (all but
    ``reset`` and ``get_reward``), split into sync and async by name."""
    methods = [] if environment is None else [
        getattr(environment, member) for member, _ in inspect.getmembers(type(environment), inspect.isfunction)
        if member not in ENVIRONMENT_ONLY_METHODS and not member.startswith("_")]
    sync, async_ = {}, {}
    for tool in list(trainer._standalone_tools) + methods:
        (async_ if inspect.iscoroutinefunction(tool) else sync)[tool.__name__] = tool
    return ToolRow(sync, async_, name, environment)


def prompt_after_reset(prompt: list, observation) -> list:
    """A chat prompt with an environment's ``reset`` observation appended to its last message, as TRL appends it
    (text to text, content parts to content parts), leaving ``prompt`` itself untouched."""
    if observation is None:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]


def default_prompt(trainer: GRPOTrainer, row: dict):
    """A row's prompt as TRL reads it: with ``environment_factory`` a row may have none (the environment's reset
    supplies it), an empty user message then."""
    if uses_environments(trainer):
        return row.get("prompt", [{"role": "user", "content": ""}])
    return row["prompt"]


def row_tools(trainer: GRPOTrainer, rows: list[ToolRow]) -> list:
    """The tools each row's prompt was rendered with (its environment's, with ``environment_factory``), which TRL
    parses its completions with."""
    return [trainer._env_tools[row.environment_name] if uses_environments(trainer) else trainer.tools for row in rows]


@contextlib.contextmanager
def tool_rows_as(trainer: GRPOTrainer, rows: list[ToolRow]):
    """Within the block TRL's tool loop reads ``rows`` as the round's rows (their tool dicts and environments)."""
    saved = {name: getattr(trainer, name, None) for name in ("_sync_tool_dicts", "_async_tool_dicts",
                                                             "_batch_environments")}
    trainer._sync_tool_dicts = [row.sync_tools for row in rows]
    trainer._async_tool_dicts = [row.async_tools for row in rows]
    trainer._batch_environments = [row.environment_name for row in rows]
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(trainer, name, value)


def tool_call_loop(trainer: GRPOTrainer, prompts, prompt_ids, completion_ids, completions, logprobs, images,
                   multimodal_fields):
    """TRL's own tool loop (``GRPOTrainer._tool_call_loop``) on the given rows: (tool_mask, completions,
    completion_ids, logprobs, tool calls, tool failures, tool images); its generation calls go through the trainer's
    ``_generate_single_turn``."""
    return GRPOTrainer._tool_call_loop(trainer, prompts, prompt_ids, completion_ids, completions, logprobs, images,
                                       multimodal_fields)


@contextlib.contextmanager
def environments_as(trainer: GRPOTrainer, environments: list | None):
    """Within the block the reward functions (``get_reward`` among them) get ``environments`` as the rows' instances."""
    saved = trainer.environments
    trainer.environments = environments
    try:
        yield
    finally:
        trainer.environments = saved


# --- equal generation calls on every process during the tool loop (armor_trl.rollout.tool_turns) ----------------------
def generation_is_collective(trainer: GRPOTrainer) -> bool:
    """Whether one call of TRL's generation path is a collective over the processes, so that every process must make
    as many calls as the others: DeepSpeed ZeRO-3 (the parameters gathered for ``generate``, or each forward's shards
    with ``ds3_gather_for_generation=False``; transformers' ``generate`` then also syncs every decoding step), FSDP
    (``summon_full_params``, sharded forwards), vLLM in server mode (the prompts gathered to the main process) and vLLM
    colocated with tensor parallelism (the prompts gathered within each group). Under DDP, or alone, each process
    generates on its own."""
    if trainer.accelerator.num_processes < 2:
        return False
    if trainer.use_vllm:
        return trainer.vllm_mode == "server" or getattr(trainer.vllm_generation, "tensor_parallel_size", 1) > 1
    if trainer.is_deepspeed_enabled:
        return trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
    return trainer.is_fsdp_enabled


def generation_slices_rows(trainer: GRPOTrainer) -> bool:
    """Whether TRL's generation gathers every process's rows and hands each process back the slice at
    ``process_index × its row count`` (vLLM in server mode; colocated with tensor parallelism, within each group):
    right only when every process sends as many rows."""
    if trainer.accelerator.num_processes < 2 or not trainer.use_vllm:
        return False
    return trainer.vllm_mode == "server" or getattr(trainer.vllm_generation, "tensor_parallel_size", 1) > 1


def throwaway_turn(trainer: GRPOTrainer, prompt_ids: list[int], rows: int = 1) -> None:
    """One generation call on TRL's path (the model routed in now) for ``rows`` rows whose completions nobody reads:
    what a process whose tool loop has finished makes while another's still generates, so that the collective calls
    match. On the transformers paths it decodes one token (the other settings training's); with vLLM the engine's
    settings stay (the server samples every process's rows with the main process's, a tensor-parallel group its
    ranks' alike)."""
    if trainer.use_vllm:
        GRPOTrainer._generate_single_turn(trainer, [list(prompt_ids)] * rows, None, {}, 1)
        return
    saved, config = trainer.generation_config, copy.deepcopy(trainer.generation_config)
    config.max_new_tokens, config.min_new_tokens, config.min_length = 1, None, 0
    trainer.generation_config = config
    try:
        GRPOTrainer._generate_single_turn(trainer, [list(prompt_ids)] * rows, None, {}, 1)
    finally:
        trainer.generation_config = saved


def wrap_environment_resets(trainer: GRPOTrainer, hook) -> None:
    """Make every environment instance's ``reset`` (those in TRL's pool and every one its factories make from now on,
    the candidates' among them) call ``hook(instance, reset, **kwargs)`` instead. The wrapper is set past the class's
    own ``__setattr__`` (a pydantic model refuses new attributes, a frozen dataclass every attribute); an instance
    that can hold no attribute of its own (``__slots__`` without ``'__dict__'``) is refused, naming why."""

    def wrapped(instance):
        reset = instance.reset
        try:
            object.__setattr__(instance, "reset", lambda **kwargs: hook(instance, reset, **kwargs))
        except (AttributeError, TypeError) as error:
            name = type(instance).__name__
            raise ValueError(
                f"use_anchors=True with environment_factory starts every reset of a group from one random state, "
                f"which wraps each environment instance's reset, and {name}'s instances hold no attribute of their "
                f"own ({name} defines __slots__ without '__dict__'; {error}). What works: add '__dict__' to {name}'s "
                "__slots__, or train with use_anchors=False."
            ) from error
        return instance

    def factory_of(make):
        return lambda: wrapped(make())

    for pool in trainer._environment_pool.values():
        for instance in pool:
            wrapped(instance)
    trainer.environment_factories = {name: factory_of(make) for name, make in trainer.environment_factories.items()}
