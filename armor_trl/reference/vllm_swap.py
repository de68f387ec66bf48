"""Anchors from the reference with TRL's vLLM engine (colocate or server): all vLLM-specific code of ARMOR.

The engine serves one set of weights. To sample anchor candidates from π_ref, the reference's weights
are pushed (for LoRA: merged with the "ref" adapter active), the candidates sampled, and the engine
is marked stale so that TRL pushes the policy's weights again before the next policy rollout. When the
reference equals the policy (right after a reset, or at the start of a run from the same weights) no
swap is needed. Anchors are never reweighted by vLLM's importance-sampling correction: their sampling
log-probs are NaN, which TRL neutralises, and the trainer sets their ratio to 1.

This is the fallback: with `vllm_reference_server_base_url` / `_port` the reference has its own vLLM server and no swap
happens (``vllm_reference``).
"""

from __future__ import annotations

import contextlib

from armor_trl.integration import trl_seam as seam
from armor_trl.integration import vllm_engine


@contextlib.contextmanager
def reference_in_engine(trainer):
    """Within the block, ``trainer.vllm_generation`` samples from the reference policy. Re-entrant: inside an
    enclosing block (the waves of a lazy round) the engine already holds π_ref and nothing is pushed."""
    if getattr(trainer, "_armor_engine_holds_reference", False):
        yield
        return
    trainer._armor_engine_holds_reference = True
    try:
        with _reference_pushed(trainer):
            yield
    finally:
        trainer._armor_engine_holds_reference = False


@contextlib.contextmanager
def _reference_pushed(trainer):
    reference, engine = trainer.reference, trainer.vllm_generation
    step = trainer.state.global_step
    if reference.holds_policy_weights():
        # The engine may still hold older policy weights: bring it to the current ones, which are π_ref's too.
        if seam.engine_step(trainer) != step:
            vllm_engine.push_to_engine(engine)
            seam.set_engine_step(trainer, step)
        yield
        return
    policy_model = vllm_engine.engine_model(engine)
    try:
        if reference.kind == "full":
            vllm_engine.push_to_engine(engine, trainer.accelerator.unwrap_model(reference.model))
        else:
            with reference.active(trainer.accelerator.unwrap_model(trainer.model)):
                vllm_engine.push_to_engine(engine)
        seam.set_engine_step(trainer, step)  # keep TRL's generation path from pushing the policy inside the block
        yield
    finally:
        vllm_engine.set_engine_model(engine, policy_model)
        seam.set_engine_step(trainer, -1)  # the engine holds π_ref: TRL pushes the policy before its next rollout


def neutral_sampling_logprobs(completion_ids: list[list[int]]) -> list[list[float]]:
    """Sampling log-probs for rows the policy engine did not sample: NaN, which TRL treats as 'no correction'."""
    return [[float("nan")] * len(ids) for ids in completion_ids]
