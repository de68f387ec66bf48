"""Anchor candidates from a second vLLM server that holds π_ref (`vllm_reference_server_base_url` / `_port`).

Without it, ARMOR samples anchors with the policy's own engine and swaps weights twice per step (``vllm_swap``). With
it, a second ``trl vllm-serve`` instance serves the reference, and the policy's engine only ever serves the policy:
no swap, and TRL's push bookkeeping (``_last_loaded_step``) is left alone.

Which weights the reference server holds:

* At the start it is assumed to hold the model it was started with, ``trl vllm-serve --model <path>``, which must be
  the reference's initial weights: ``ref_model`` when that is a path, else the policy's model path. When the initial
  reference cannot be known to equal a file (a LoRA reference, whose "ref" adapter is merged into the base model; a
  model instance), its weights are pushed once, before the first anchor candidates.
* After a reference reset (and after resuming from a checkpoint whose reference was reset) the new weights are pushed
  once, before the next anchor candidates, i.e. at the step of the reset, before the policy moves on. Never per step.

The server is identified with the reference's reset count (``ReferencePolicy.resets``), like the anchor cache.
"""

from __future__ import annotations

from typing import Callable, Protocol

from armor_trl.integration import vllm_engine
from armor_trl.reference.policy import ReferencePolicy

# VLLMGeneration settings taken from the policy's engine, so that the reference server samples like it.
SHARED_SETTINGS = (
    "structured_outputs_regex", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "max_completion_length", "logprobs", "generation_kwargs", "server_timeout",
)


class Engine(Protocol):
    """What ARMOR uses of TRL's ``VLLMGeneration`` (in server mode): the model whose weights ``sync_weights`` pushes,
    and ``generate``, which is collective (every process calls it; the main process talks to the server)."""

    model: object

    def sync_weights(self) -> None: ...

    def generate(self, prompts, images, num_generations, profiler=None) -> tuple: ...


class ReferenceServer:
    """Samples completions from π_ref on its own vLLM engine and keeps that engine's weights equal to π_ref's."""

    def __init__(self, engine: Engine, reference: ReferencePolicy, unwrap: Callable, holds_initial_reference: bool):
        self.engine = engine
        self.reference = reference
        self.unwrap = unwrap
        # reset count of the reference whose weights the server holds (None: unknown, push before the first use)
        self.held_resets: int | None = 0 if holds_initial_reference else None

    @classmethod
    def connect(cls, trainer, holds_initial_reference: bool) -> "ReferenceServer":
        """Connect to the server named by the trainer's ArmorConfig; sample with the policy engine's settings."""
        args = trainer.args
        engine = vllm_engine.server_engine(trainer, args.vllm_reference_server_url, args.vllm_reference_group_port,
                                           SHARED_SETTINGS)
        return cls(engine, trainer.reference, trainer.accelerator.unwrap_model, holds_initial_reference)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, policy) -> list[list[int]]:
        """Completions of π_ref for ``prompt_ids`` (each repeated ``num_generations`` times, as TRL passes them).

        ``policy`` is the unwrapped policy model (it carries the "ref" adapter of a LoRA reference). Collective.
        """
        if self.held_resets != self.reference.resets:
            self.push(policy)
        return vllm_engine.engine_generate(self.engine, prompt_ids, num_generations)

    def push(self, policy) -> None:
        """Send π_ref's current weights to the server (for LoRA: the base model with the "ref" adapter merged)."""
        if self.reference.kind == "full":
            vllm_engine.push_to_engine(self.engine, self.unwrap(self.reference.model))
        else:
            vllm_engine.set_engine_model(self.engine, policy)
            with self.reference.active(policy):  # TRL's sync merges the active adapter: "ref"
                vllm_engine.push_to_engine(self.engine)
        self.held_resets = self.reference.resets
