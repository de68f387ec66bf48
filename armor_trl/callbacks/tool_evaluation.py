"""Validation of an agent: held-out completions sampled through TRL's own tool loop (``tools=[...]``), so that a
trajectory calls its tools, reads their results and answers as in training. :func:`trajectory_sampler` samples a
validation call's rows for a trainer with tools: the first turn through the trainer's generation path, then
``GRPOTrainer._tool_call_loop`` on the rows with the trainer's tools, every later turn through the same path with the
same sampling settings. Each trajectory comes back with the messages TRL's reward
functions get and the number of tool calls TRL ran for it, so validation can log the held-out tool-call rate
(``val/tool_call_rate``: the share of samples that called a tool at least once; ``val/tool_calls``: calls per sample).

Agents built with ``environment_factory`` are not validated this way: each held-out row would need environment
instances of its own, reset with the row; :func:`check_tool_validation` refuses them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass


from armor_trl.integration import trl_generation
from armor_trl.rollout.tool_anchors import MessageLog
from armor_trl.rollout.tool_turns import tool_loop


@dataclass
class SampledTrajectory:
    """One held-out sample of an agent: its token ids (model turns and tool results), the messages the reward
    functions get, and the tool calls TRL ran for it."""

    completion_ids: list
    messages: list
    calls: int


def check_tool_validation(trainer) -> None:
    """A ValueError for an agent whose validation cannot run through TRL's tool loop here (``environment_factory``)."""
    if trl_generation.uses_environments(trainer):
        raise ValueError(
            "Validation through a GRPOTrainer with environment_factory is not supported: each held-out sample would "
            "need an environment instance of its own, reset with its row. Validate with tools=[...] (the same "
            "functions as standalone tools), or evaluate the environments yourself after training."
        )


def trajectory_sampler(trainer, prompts: list) -> Callable[[list, list, int], list[SampledTrajectory]]:
    """What :func:`armor_trl.callbacks.evaluation.sample_ids_with_trainer` samples a call's rows with for an agent:
    the first turn through the trainer's generation path, then TRL's tool loop with the trainer's tools (the call's
    sampling settings bound the whole trajectory, as ``max_completion_length`` does in training), each row answering
    the chat prompt ``prompts[i]`` of its problem ``i``."""
    check_tool_validation(trainer)

    def sample(rows: list[int], row_ids: list[list[int]], draws: int) -> list[SampledTrajectory]:
        row_prompts = [prompts[i] for i in rows]
        return _run_tool_loop(trainer, row_prompts, row_ids, trl_generation.generate(trainer, row_ids, draws))

    return sample


def _run_tool_loop(trainer, prompts: list, prompt_ids: list, first_ids: list) -> list[SampledTrajectory]:
    """TRL's tool loop on the first turns ``first_ids``, each row with the trainer's tools."""
    rows = [trl_generation.environment_tool_row(trainer, None, None) for _ in prompts]
    tools = trl_generation.row_tools(trainer, rows)
    messages = [MessageLog(m) for m in trl_generation.decode_for_rewards(trainer, prompt_ids, first_ids, prompts, tools)]
    # (turns agreed with the other processes where a generation call is collective, as in training's loops)
    with trl_generation.tool_rows_as(trainer, rows), tool_loop(trainer, prompt_ids):
        _, messages, ids, _, _, _, _ = trl_generation.tool_call_loop(
            trainer, copy.deepcopy(prompts), [list(p) for p in prompt_ids], [list(c) for c in first_ids], messages,
            None, None, {})
    return [SampledTrajectory(list(ids[i]), list(messages[i]), len(messages[i].tool_results))
            for i in range(len(prompts))]
