"""Anchors with a ``rollout_func`` (TRL's hook for custom generation; docs/anchors.md, "Generation paths").

A ``rollout_func(prompts, trainer)`` replaces TRL's generation, so ARMOR's hook in ``_generate_single_turn`` is never
reached. With anchors, ARMOR wraps the function and calls it itself, per generation round:

1. once for the policy's rows: G − m rows per group (in a same-call round, G − m + K: the last K of each group are
   the anchor candidates, sampled by the policy whose weights π_ref holds);
2. otherwise once more for the K candidates per group that need sampling, with π_ref routed into the trainer's
   model (a full reference model in place of ``trainer.model_wrapped``, or the "ref" adapter of a LoRA policy).

The contract (checked, each breach a ``ValueError`` naming it): the function returns one completion per prompt it is
given, in order, with ``prompt_ids``, ``completion_ids`` and ``logprobs`` (a list per row, or None); every other field
is a list with one value per row (TRL hands them to the reward functions). For anchors sampled online it generates
with the trainer's model, e.g. with :func:`generate_completions`: ARMOR checks that the model it routed π_ref into
ran. A function that calls its own server cannot be given π_ref's weights: it can only train with anchors that need
no generation (``anchor_source="column"`` while the reference is not reset), or with ``use_anchors=False``.

Anchor rows get the extra fields of the call that sampled them (their candidates are scored with them too); cached
and column anchors have none: None, and an ``env_mask`` of ones (every token is the model's). Their sampling
log-probs are NaN (not sampled by the policy: TRL applies no correction to them).
"""

from __future__ import annotations

import contextlib

from armor_trl.integration import trl_generation
from armor_trl.rollout.anchor_rollout import AnchorRollout

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


def generate_completions(trainer, prompt_ids: list[list[int]]) -> list[list[int]]:
    """One completion per prompt (token ids) from the trainer's own generation path (transformers ``generate`` or
    continuous batching, with the trainer's sampling settings): what a ``rollout_func`` calls to generate with the
    model ARMOR routes π_ref into."""
    return trl_generation.generate(trainer, prompt_ids, 1)


def checked_output(output, rows: int) -> dict:
    """``output`` of a rollout_func given ``rows`` prompts, or a ValueError naming what breaks the contract."""
    if not isinstance(output, dict):
        raise ValueError(f"rollout_func must return a dict with {list(REQUIRED)}; it returned {type(output).__name__}.")
    missing = [key for key in REQUIRED if key not in output]
    if missing:
        raise ValueError(f"rollout_func must return keys {list(REQUIRED)} in its output dict; {missing} missing.")
    for key, values in output.items():
        if key == "logprobs" and values is None:
            continue
        if not isinstance(values, list) or len(values) != rows:
            size = len(values) if isinstance(values, list) else type(values).__name__
            raise ValueError(
                f"With anchors, every field rollout_func returns is a list with one value per prompt it was given "
                f"(one completion per prompt, in order): it was given {rows} prompts and returned {key!r} with "
                f"{size}. ARMOR calls it on subsets of a round's rows (on-policy rows, then π_ref's candidates)."
            )
    return output


class RolloutFuncAnchors(AnchorRollout):
    """:class:`~armor_trl.rollout.anchor_rollout.AnchorRollout` for a trainer whose generation is a ``rollout_func``."""

    def __init__(self, trainer, train_dataset, rollout_func):
        super().__init__(trainer, train_dataset)
        self.func = rollout_func
        self._prompts: dict[tuple, object] = {}  # this round: prompt ids -> the raw prompt they came from
        self._extras: dict[int, dict] = {}  # this round: id(completion ids list) -> that row's extra fields
        self._alive: list = []  # the lists _extras is keyed by (kept alive for the round, so ids stay unique)

    # --- the wrapped function ----------------------------------------------------------------------------------
    def rollout(self, prompts: list, inputs: list[dict] | None):
        """What TRL gets from the rollout_func for ``prompts`` (a round's rows): the function's own output when the
        round has no anchors (``inputs`` None), else (output with anchors placed, AnchorRound)."""
        if inputs is None:
            return self.func(prompts, self.trainer), None
        group_size, slots = self.trainer.num_generations, self.slots_per_group
        groups = len(prompts) // group_size
        group_prompts = [prompts[g * group_size] for g in range(groups)]
        per_group = group_size - slots + (self.args.anchor_num_samples if self.same_call_applies() else 0)
        self._prompts, self._extras, self._alive = {}, {}, []
        # the policy's call: π_ref is not routed in, but an online anchor round needs the trainer's model (checked
        # here already, so that a function with its own server fails at its first round, not at its first reset)
        model = None if self._needs_no_generation() else self.trainer.unwrapped_policy()
        with self._model_ran(model):
            output = self._call([p for p in group_prompts for _ in range(per_group)])
        group_prompt_ids = [list(output["prompt_ids"][g * per_group]) for g in range(groups)]
        self._prompts = {tuple(ids): prompt for ids, prompt in zip(group_prompt_ids, group_prompts)}

        def policy_call(prompt_ids, n):
            if n != per_group or len(prompt_ids) != len(output["completion_ids"]):
                raise RuntimeError(f"armor_trl: a round asked for {n} rows per group, the rollout made {per_group}")
            return output["completion_ids"], output["logprobs"]

        row_prompt_ids = [ids for ids in group_prompt_ids for _ in range(group_size)]
        completion_ids, logprobs, anchors = self.generate(policy_call, row_prompt_ids, group_size, inputs)
        result = {"prompt_ids": row_prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}
        for key in output:
            if key not in REQUIRED:
                result[key] = [self._extra(ids, key) for ids in completion_ids]
        return result, anchors

    def _call(self, prompts: list) -> dict:
        output = checked_output(self.func(prompts, self.trainer), len(prompts))
        extras = [key for key in output if key not in REQUIRED]
        for row, ids in enumerate(output["completion_ids"]):
            self._extras[id(ids)] = {key: output[key][row] for key in extras}
            self._alive.append(ids)
        return output

    def _extra(self, completion_ids: list, key: str):
        """The extra field ``key`` of the call that made this completion; for an anchor from the cache or the column
        (no call made it): an env_mask of ones, else None."""
        extras = self._extras.get(id(completion_ids))
        if extras is not None and key in extras:
            return extras[key]
        return [1] * len(completion_ids) if key == "env_mask" else None

    def reward_fields(self, completion_ids: list) -> dict:
        """The extra fields TRL merges into this row's inputs for its reward functions: those of the call that made
        it, but ``env_mask`` (TRL takes it as the row's tool mask; no reward function sees it)."""
        extras = self._extras.get(id(completion_ids), {})
        return {key: value for key, value in extras.items() if key != "env_mask"}

    def defers_candidates(self) -> bool:
        return False  # π_ref's candidates go through the function with their round's prompts and extra fields

    def _needs_no_generation(self) -> bool:
        return self.column is not None and self.column.active(self.trainer.reference.resets)

    # --- AnchorRollout's candidate generation and scoring, through the function ---------------------------------
    def _reference_candidates(self, prompt_ids: list, k: int) -> list:
        """π_ref's candidates: the rollout_func with π_ref routed into the trainer's model (checked to have run)."""
        trainer, reference = self.trainer, self.trainer.reference
        policy = trainer.unwrapped_policy()
        model = reference.full_model if reference.kind == "full" else policy
        routed = trl_generation.generating_with(trainer, reference.full_model)
        with reference.active(policy), routed, self._model_ran(model):
            output = self._call([self._prompts[tuple(ids)] for ids in prompt_ids])
        return output["completion_ids"]

    def _score_candidates(self, prompt_ids: list, inputs: list[dict], k: int, candidate_ids: list | None = None):
        """As AnchorRollout's, with each candidate's extra fields (from the call that sampled it) in its input row."""
        trainer = self.trainer
        candidate_prompt_ids = [ids for ids in prompt_ids for _ in range(k)]
        if candidate_ids is None:
            candidate_ids = self._reference_candidates(candidate_prompt_ids, k)
        candidate_inputs = [{**row, **self.reward_fields(ids)}
                            for row, ids in zip([row for row in inputs for _ in range(k)], candidate_ids)]
        prompts = [row["prompt"] for row in candidate_inputs]
        conversational = trl_generation.is_conversational_prompt(prompts[0])
        completions = trl_generation.decode(trainer, candidate_ids, conversational)
        return candidate_ids, trl_generation.score_quietly(trainer, candidate_inputs, prompts, completions,
                                                           candidate_ids)

    @contextlib.contextmanager
    def _model_ran(self, model):
        """Within the block ``model`` (None: no check) must run a forward pass, or the rollout_func did not generate
        with the trainer's model and π_ref cannot be sampled through it."""
        if model is None:
            yield
            return
        calls = []
        handle = model.get_input_embeddings().register_forward_pre_hook(lambda *_: calls.append(1))
        try:
            yield
        finally:
            handle.remove()
        if not calls:
            raise ValueError(
                "rollout_func did not generate with the trainer's model (trainer.model_wrapped), which is where ARMOR "
                "routes π_ref to sample anchor candidates online. Generate with "
                "armor_trl.generate_completions(trainer, prompt_ids) (or through trainer.model_wrapped). A rollout_func "
                "that calls its own server can only train with anchors that need no generation: "
                "anchor_source='column' (pre-generated, e.g. armor-trl anchors) while π_ref is never reset "
                "(ref_reset_steps, ref_reset_every_step_until and ref_reset_at_steps unset), or use_anchors=False (the "
                "mixed ratio only)."
            )
