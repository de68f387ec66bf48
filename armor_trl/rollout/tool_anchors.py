"""Anchors on TRL's tool loop (``tools=[...]``) and with ``environment_factory`` (docs/anchors.md, "Tools and
environments").

With tools a completion is a multi-turn trajectory: the model's turns, the tool calls TRL runs, and the tool results it
masks out of the loss (``tool_mask``). In an anchored round :class:`ToolAnchorRollout` runs every trajectory of the
round itself, through TRL's own loop (``GRPOTrainer._tool_call_loop``), before anything is scored:

1. the policy's rows: their first turn on TRL's path, then TRL's loop on them with their own tool dicts and
   environments (what TRL would have run after the first turn); in a same-call round the K candidates per group are
   extra rows of that same call and that same loop;
2. π_ref's candidates: their first turn with π_ref routed into the generation path, then TRL's loop with π_ref still
   routed in (every turn after a tool result goes through ``_generate_single_turn`` too). With ``environment_factory``
   each candidate gets an environment instance of its own, made by the factory (pooled apart from the policy's),
   reset with its group's row exactly as TRL resets the policy's (same kwargs, the ``environment`` column selecting
   it), and scored on that instance by the reward functions and ``get_reward``.

TRL's ``_generate`` then calls its loop on the round's rows; the trainer answers with the trajectories already run
(:func:`finished_loop`): each row's own ``tool_mask``, messages, tool images, and TRL's tool-call
counts over the round. An anchor is a π_ref trajectory placed in its slot like a single-turn anchor: its tool_mask masks
its tool results out of the mixed ratio, π_ref's and π_old's log-probs and the loss; its sampling log-probs are NaN.

An anchor compares trajectories from one initial state. Each environment reset must therefore reproduce the group's
state from the row it is given: an environment that samples its own task on ``reset`` (environment-owned data drawing
a new word each time from a generator of its own) gives a group's rows different prompts, and anchors are refused
there at the first round, with the fix named. Draws from the global random generators are made alike within a group
(:mod:`~armor_trl.rollout.environment_resets`), shown in the prompt or hidden.

Every loop here and TRL's own loop elsewhere agree their generation calls with the other processes where a call is
collective (:mod:`~armor_trl.rollout.tool_turns`: ZeRO-3 and others, with different turn counts per process).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from armor_trl.integration import trl_generation
from armor_trl.integration import trl_seam as seam
from armor_trl.rollout.anchor_rollout import AnchorRollout
from armor_trl.rollout.anchors import policy_rows
from armor_trl.rollout.rollout_func import RolloutFuncAnchors
from armor_trl.rollout.environment_resets import GroupResets
from armor_trl.rollout.tool_turns import agreed_turn, in_tool_turns, tool_loop

logger = logging.get_logger(__name__)


@dataclass
class Trajectory:
    """One row's multi-turn completion as TRL's tool loop leaves it."""

    completion_ids: list  # the model's turns and the tool results between them, as one token sequence
    tool_mask: list  # 1 on the model's tokens, 0 on tool results
    completions: list  # the messages the reward functions get (assistant turns and tool results)
    prompt: object  # the chat prompt it answers (after its environment's reset)
    tool_images: list = field(default_factory=list)
    environment: object = None  # the environment instance it ran in (None: tools without an environment)
    logprobs: list | None = None  # the engine's sampling log-probs (vLLM), None elsewhere
    calls: int = 0  # tool calls TRL ran for it (a result it dropped for overflowing the budget included)
    failures: int = 0  # of which failed (TRL's error result: an unknown tool, bad arguments, an exception)
    ran: bool = True  # its loop ran this round (False: a cached anchor's stored trajectory, replayed)


class MessageLog(list):
    """A row's messages for TRL's loop that remember every tool result appended, also the ones TRL removes again when
    they would overflow ``max_completion_length`` (TRL counts those calls too), and how many of its calls returned
    (:func:`counted_tools`)."""

    def __init__(self, messages):
        super().__init__(messages)
        self.tool_results = []
        self.returned = 0  # tool calls of this row whose tool returned (did not raise)

    def append(self, message):
        if isinstance(message, dict) and message.get("role") == "tool":
            self.tool_results.append(message)
        super().append(message)

    def counts(self) -> tuple[int, int]:
        """(calls, failures) as TRL counts them: one tool result per call TRL ran; a failure is a call whose tool
        raised, or that named no tool of the row, or was of a type TRL does not run, i.e. every call whose tool did
        not return (a tool that returns ``{"error": ...}`` as its result succeeded)."""
        return len(self.tool_results), len(self.tool_results) - self.returned


def counted_tools(row, log: MessageLog):
    """``row`` (a :class:`~armor_trl.integration.trl_generation.ToolRow`) with each tool wrapped to count the calls
    that return in ``log``; what TRL's loop gets for that row."""

    def counted(tool):
        @functools.wraps(tool)
        def call(*args, **kwargs):
            result = tool(*args, **kwargs)
            log.returned += 1
            return result

        return call

    def counted_async(tool):
        @functools.wraps(tool)
        async def call(*args, **kwargs):
            result = await tool(*args, **kwargs)
            log.returned += 1
            return result

        return call

    return dataclasses.replace(row, sync_tools={name: counted(tool) for name, tool in row.sync_tools.items()},
                               async_tools={name: counted_async(tool) for name, tool in row.async_tools.items()})


@dataclass
class ToolRound:
    """A generation round as the tool loop's hooks see it."""

    prompts: list  # its chat prompts after the environments' resets (what the trajectories answer)
    trajectories: list | None = None  # each row's trajectory, when the anchor rollout ran the round's loops


class ToolLoopHooks:
    """ArmorGRPOTrainer's hooks into TRL's tool loop (a mixin before GRPOTrainer), in the order TRL calls them:

    1. ``_generate_and_score_completions``: an anchored round's environment resets start alike per group
       (:mod:`~armor_trl.rollout.environment_resets`; TRL resets its rows' environments next);
    2. ``_generate``: starts the round's :class:`ToolRound` (``trainer.tool_round``, its chat prompts after reset);
    3. ``_tool_call_loop``: answers for an anchored round whose trajectories the anchor rollout ran already
       (:func:`finished_loop`); elsewhere TRL's loop runs within :func:`~armor_trl.rollout.tool_turns.tool_loop`;
    4. ``_generate_single_turn``: a turn after a tool result, agreed with the other processes
       (:func:`~armor_trl.rollout.tool_turns.agreed_turn`);
    5. ``train``: closes π_ref's candidates' environments at the end.
    """

    tool_round: ToolRound | None = None

    def _generate_and_score_completions(self, inputs):
        if self.group_resets is not None and self._round.inputs is not None:  # an anchored round (ArmorGRPOTrainer's)
            self.group_resets.start_round(len(inputs), self.num_generations)  # TRL resets its rows' environments next
        return super()._generate_and_score_completions(inputs)

    def _generate(self, prompts):
        self.tool_round = ToolRound(prompts)
        return super()._generate(prompts)

    def _tool_call_loop(self, prompts, prompt_ids, *loop_args):
        if self.tool_round is not None and self.tool_round.trajectories is not None:
            return finished_loop(self.tool_round.trajectories, prompts, prompt_ids, *loop_args)
        with tool_loop(self, prompt_ids):
            return super()._tool_call_loop(prompts, prompt_ids, *loop_args)

    def _generate_single_turn(self, prompt_ids, images, *args, **kwargs):
        if in_tool_turns(self):  # a turn after a tool result: agreed with the other processes where calls are collective
            return agreed_turn(self, super()._generate_single_turn, prompt_ids, images, *args, **kwargs)
        return super()._generate_single_turn(prompt_ids, images, *args, **kwargs)

    def train(self, *args, **kwargs):
        close = getattr(self.anchor_rollout, "close_environments", lambda raising: None)  # π_ref's candidates'
        try:
            output = super().train(*args, **kwargs)
        except BaseException:
            close(raising=False)  # (the training error is the one raised; a failing close() is logged)
            raise
        close(raising=True)
        return output


def new_anchor_rollout(trainer, train_dataset, rollout_func=None) -> AnchorRollout:
    """The anchor rollout of a trainer: a ``rollout_func``'s, TRL's tool loop's (``tools`` or ``environment_factory``;
    with a ``rollout_func`` they are refused at construction), or TRL's single-turn generation's."""
    if rollout_func is not None:
        return RolloutFuncAnchors(trainer, train_dataset, rollout_func)
    if trl_generation.uses_tools(trainer) or trl_generation.uses_environments(trainer):
        return ToolAnchorRollout(trainer, train_dataset)
    return AnchorRollout(trainer, train_dataset)


class ToolAnchorRollout(AnchorRollout):
    """:class:`~armor_trl.rollout.anchor_rollout.AnchorRollout` for a trainer with ``tools`` or
    ``environment_factory``: every trajectory of an anchored round runs through TRL's tool loop here."""

    def __init__(self, trainer, train_dataset):
        super().__init__(trainer, train_dataset)
        self.trajectories: dict[int, Trajectory] = {}  # this round's, by id() of their completion ids
        self._alive: list = []  # the completion-id lists those ids belong to, kept for the round
        self.environment_pool: dict = {}  # {environment name: instances} for π_ref's candidates only
        self._handed_out: dict = {}  # {environment name: instances handed out this round}
        self._group_prompts: dict = {}  # this round: id() of a group's (first) row -> its chat prompt (after reset)
        self._group_index: dict = {}  # this round: id() of a group's (first) row -> the group's index
        # this rollout batch's rounds, where candidates wait for the refill loop (anchor_deferred): id() of each
        # group's first row -> (the row, its chat prompt after reset, the random state its resets started from, or
        # None), for the draw after the loop
        self._batch_groups: dict = {}
        self._placed: list = []  # the trajectories of the anchors placed after the refill loop (their tool metrics)
        # the cache's trajectories (tools without environments): completion ids -> (tool_mask, messages, calls,
        # failures); a cached anchor keeps the tool_mask of the loop that made it (checkpointed with the cache)
        self.kept: dict[tuple, tuple] = {}
        if trl_generation.uses_environments(trainer):  # a group's resets from one random state
            trainer.group_resets = GroupResets(trainer)

    def register(self, state) -> None:
        super().register(state)
        if self.cache is not None:
            state.register("tool_trajectories", lambda: {"kept": [[list(k), *v] for k, v in self.kept.items()]},
                           lambda saved: setattr(self, "kept", {tuple(k): tuple(v) for k, *v in saved["kept"]}))

    # --- a round -----------------------------------------------------------------------------------------------
    def generate(self, generate_policy, prompt_ids: list, group_size: int, inputs: list[dict]):
        trainer = self.trainer
        rows = len(prompt_ids)
        self.trajectories, self._alive, self._handed_out = {}, [], {}
        prompts = trainer.tool_round.prompts
        check_group_prompts(prompts, group_size)
        self._group_prompts = {id(inputs[i]): prompts[i] for i in range(0, rows, group_size)}
        self._group_index = {id(inputs[i]): i // group_size for i in range(0, rows, group_size)}
        round_rows = trl_generation.round_tool_rows(trainer, rows)

        def policy_trajectories(ids: list, n: int):
            first, logprobs = generate_policy(ids, n)
            if self.same_call_round:  # per group: its on-policy rows, then K candidates with environments of their own
                per_group = n - self.args.anchor_num_samples
                layout = [(g * group_size + j, None) if j < per_group else (None, inputs[g * group_size])
                          for g in range(rows // group_size) for j in range(n)]
            else:
                layout = [(i, None) for i in policy_rows(rows, group_size, self.slots_per_group)]
            tool_rows, row_prompts = [], []
            for row, candidate_of in layout:
                if row is not None:
                    tool_rows.append(round_rows[row])
                    row_prompts.append(prompts[row])
                else:
                    tool_row, prompt = self._candidate_row(candidate_of)
                    tool_rows.append(tool_row)
                    row_prompts.append(prompt)
            trajectories = self._run(row_prompts, ids, first, logprobs, tool_rows)
            merged = None if logprobs is None else [t.logprobs for t in trajectories]
            return [t.completion_ids for t in trajectories], merged

        completion_ids, logprobs, anchors = super().generate(policy_trajectories, prompt_ids, group_size, inputs)
        if self.defers_candidates():  # groups that may draw after the refill loop: their candidates start from here
            starts = {} if trainer.group_resets is None else trainer.group_resets.starts
            self._batch_groups.update({id(inputs[i]): (inputs[i], prompts[i], starts.get(i // group_size))
                                       for i in range(0, rows, group_size)})
        trajectories = [self.trajectory(ids, prompt_ids[i], prompts[i], round_rows[i])
                        for i, ids in enumerate(completion_ids)]
        trainer.tool_round.trajectories = trajectories
        if trl_generation.uses_tools(trainer):  # (TRL logs its tool metrics only then)
            self._log_tool_calls(trajectories, rows, anchors)
        return completion_ids, logprobs, anchors

    def _log_tool_calls(self, trajectories: list[Trajectory], rows: int, anchors) -> None:
        """TRL's tool metrics for the anchor rows and the on-policy rows apart (:func:`log_tool_counts`)."""
        device = self.trainer.accelerator.device
        is_anchor = self.anchor_mask(rows, anchors, device).tolist()
        on_policy = torch.ones(rows, dtype=torch.bool)
        on_policy[self.slot_rows(rows, "cpu")] = False
        log_tool_counts(self.trainer, "anchor", [t for t, kept in zip(trajectories, is_anchor) if kept])
        log_tool_counts(self.trainer, "policy", [t for t, kept in zip(trajectories, on_policy.tolist()) if kept])

    def trajectory(self, completion_ids: list, prompt_ids: list, prompt, row) -> Trajectory:
        """The trajectory that made ``completion_ids`` this round; for an anchor no loop ran for this round (the
        dataset column's) it is the cache's stored trajectory, or the completion as one model turn, parsed with its
        slot's tools."""
        found = self._made(completion_ids, prompt)
        if found is not None:
            return found
        tools = trl_generation.row_tools(self.trainer, [row])
        completions = trl_generation.decode_for_rewards(self.trainer, [prompt_ids], [completion_ids], [prompt], tools)[0]
        return Trajectory(list(completion_ids), [1] * len(completion_ids), completions, prompt)

    def _made(self, completion_ids: list, prompt=None) -> Trajectory | None:
        """The trajectory a loop made ``completion_ids`` with: this round's, or a cached anchor's stored one (a loop
        of an earlier round ran it: ``ran`` False, so TRL's ``tools/*`` do not count its calls again)."""
        found = self.trajectories.get(id(completion_ids))
        if found is not None:
            return found
        kept = self.kept.get(tuple(completion_ids))
        if kept is None:
            return None
        mask, messages, calls, failures = kept
        return Trajectory(list(completion_ids), list(mask), copy.deepcopy(messages), prompt, calls=calls,
                          failures=failures, ran=False)

    def _remember(self, g, prompt_ids, anchors, scores, found, candidate_ids, rewards, verified, span) -> None:
        """As AnchorRollout's, keeping each cached candidate's trajectory (its tool_mask and messages) with it."""
        super()._remember(g, prompt_ids, anchors, scores, found, candidate_ids, rewards, verified, span)
        for i in span:
            trajectory = self.trajectories.get(id(candidate_ids[i]))
            if verified[i] and trajectory is not None:
                self.kept[tuple(trajectory.completion_ids)] = (trajectory.tool_mask, trajectory.completions,
                                                               trajectory.calls, trajectory.failures)
        cached = {tuple(ids) for ids in self.cache.completions()}
        self.kept = {key: value for key, value in self.kept.items() if key in cached}

    def deferred_anchors(self, batch: dict, group_inputs: list[dict], kept: int):
        """As AnchorRollout's, the candidates' trajectories running after the refill loop: each from its group's chat
        prompt (after its round's reset), in environments of its own from the candidates' pool, reset with the group's
        row; each anchor placed with its own ``tool_mask``. Collective: every process calls it, once per batch."""
        groups, self._batch_groups = self._batch_groups, {}
        # every group of the batch (a process's padding draws repeat one of them) with its round's chat prompt and the
        # random state its round's resets started from (GroupResets: its candidates reset from it, as in the round)
        self._group_prompts = {key: prompt for key, (_, prompt, _) in groups.items()}
        self._group_index = {key: index for index, key in enumerate(groups)}
        states = {index: state for index, (_, _, state) in enumerate(groups.values()) if state is not None}
        self.trajectories, self._alive, self._handed_out, self._placed = {}, [], {}, []
        resets = self.trainer.group_resets
        round_starts = None if resets is None else resets.starts
        if resets is not None:
            resets.starts = states
        try:
            placed = super().deferred_anchors(batch, group_inputs, kept)
        finally:
            if resets is not None:
                resets.starts = round_starts
        if placed is not None and trl_generation.uses_tools(self.trainer):  # (collective, as the draw)
            log_tool_counts(self.trainer, "anchor", self._placed)  # as a round logs its anchors'
        return placed

    def deferred_row_fields(self, completion_ids: list, width: int, device) -> dict:
        """The anchor rows' ``tool_mask`` (right-padded with 1, as TRL pads it, to ``width``): each from the loop that
        made the trajectory (or the cache's stored one)."""
        masks = []
        for ids in completion_ids:
            found = self._made(ids) or Trajectory(list(ids), [1] * len(ids), [], None, ran=False)
            self._placed.append(found)  # (their tool metrics: deferred_anchors)
            masks.append(list(found.tool_mask) + [1] * (width - len(found.tool_mask)))
        return {"tool_mask": torch.tensor(masks, dtype=torch.long, device=device)}

    # --- running trajectories ----------------------------------------------------------------------------------
    def _run(self, prompts: list, prompt_ids: list, first_ids: list, logprobs, rows: list) -> list[Trajectory]:
        """TRL's tool loop on first turns ``first_ids`` of ``prompt_ids`` (chat ``prompts``), each row with its
        own tools and environment (``rows``: :class:`~armor_trl.integration.trl_generation.ToolRow`), through whatever
        model is routed into the generation path. Where TRL runs no loop (``environment_factory`` whose environments
        have no tool methods) neither does this: each trajectory is its first turn, every token the model's."""
        trainer = self.trainer
        tools = trl_generation.row_tools(trainer, rows)
        completions = [MessageLog(c) for c in trl_generation.decode_for_rewards(trainer, prompt_ids, first_ids, prompts,
                                                                                tools)]
        if not trl_generation.uses_tools(trainer):
            ids, mask = [list(c) for c in first_ids], [[1] * len(c) for c in first_ids]
            loop_logprobs, tool_images = None if logprobs is None else [list(lp) for lp in logprobs], [[] for _ in rows]
        else:
            images, fields = trainer.media_for(prompt_ids)
            loop_logprobs = None if logprobs is None else [list(lp) for lp in logprobs]
            counted = [counted_tools(row, log) for row, log in zip(rows, completions, strict=True)]
            with trl_generation.tool_rows_as(trainer, counted), tool_loop(trainer, prompt_ids):
                mask, completions, ids, loop_logprobs, _, _, tool_images = trl_generation.tool_call_loop(
                    trainer, copy.deepcopy(prompts), [list(p) for p in prompt_ids], [list(c) for c in first_ids],
                    completions, loop_logprobs, images, fields)
        trajectories = []
        for i, row in enumerate(rows):
            calls, failures = completions[i].counts()
            trajectory = Trajectory(ids[i], mask[i], list(completions[i]), prompts[i], tool_images[i], row.environment,
                                    None if loop_logprobs is None else loop_logprobs[i], calls, failures)
            self.trajectories[id(ids[i])] = trajectory
            self._alive.append(ids[i])
            trajectories.append(trajectory)
        return trajectories

    def _candidate_row(self, row: dict):
        """A candidate's tools and environment: an instance of its row's environment of its own, reset with the row
        (its group's first) as TRL resets the policy's; and its chat prompt, which must be its group's."""
        trainer = self.trainer
        group_prompt = self._group_prompts[id(row)]
        if not trl_generation.uses_environments(trainer):
            return trl_generation.environment_tool_row(trainer, None, None), group_prompt
        name = trl_generation.environment_name(trainer, row)
        pool, handed = self.environment_pool.setdefault(name, []), self._handed_out.get(name, 0)
        if handed == len(pool):
            pool.append(trl_generation.new_environment(trainer, name))
        self._handed_out[name] = handed + 1
        environment = pool[handed]
        resets = trainer.group_resets
        with contextlib.nullcontext() if resets is None else resets.as_group(self._group_index[id(row)]):
            observation = environment.reset(**trl_generation.reset_kwargs(trainer, row))
        prompt = trl_generation.prompt_after_reset(trl_generation.default_prompt(trainer, row), observation)
        if prompt != group_prompt:
            raise not_reproducible(type(environment).__name__)
        return trl_generation.environment_tool_row(trainer, name, environment), prompt

    def close_environments(self, raising: bool = True) -> None:
        """Release π_ref's candidates' environment instances at the end of a ``train()`` call: each one's ``close()``
        where its class defines one, and the pool emptied (a later call makes new ones with the factory). Every
        instance is closed even when one's ``close()`` raises; the first such error is raised afterwards
        (``raising``), or only logged (a training error is in flight)."""
        pool, self.environment_pool, self._handed_out = self.environment_pool, {}, {}
        errors = []
        for instances in pool.values():
            for instance in instances:
                close = getattr(instance, "close", None)
                try:
                    if callable(close):
                        close()
                except Exception as error:  # noqa: BLE001 (the others are still closed)
                    errors.append(error)
        if not errors:
            return
        message = (f"close() of {len(errors)} of π_ref's candidates' environment instances raised (the others were "
                   f"closed); the first: {errors[0]!r}")
        if not raising:
            logger.error(message)
            return
        raise RuntimeError(message) from errors[0]

    # --- AnchorRollout's candidates, as trajectories ---------------------------------------------------------------
    def _reference_candidates(self, prompt_ids: list, k: int, inputs: list[dict] | None = None) -> list:
        """π_ref's trajectories: the first turn and every turn after a tool result with π_ref routed in."""
        rows = [self._candidate_row(row) for row in inputs]
        with self.reference_routed():
            first = trl_generation.generate(self.trainer, prompt_ids, k)
            trajectories = self._run([prompt for _, prompt in rows], prompt_ids, first, None,
                                     [tool_row for tool_row, _ in rows])
        return [t.completion_ids for t in trajectories]

    def _score_candidates(self, prompt_ids: list, inputs: list[dict], k: int, candidate_ids: list | None = None):
        """Candidates scored as TRL scores the policy's trajectories: their messages, their chat prompts, and (with
        ``environment_factory``) their own environment instances handed to the reward functions and ``get_reward``."""
        trainer = self.trainer
        candidate_prompt_ids = [ids for ids in prompt_ids for _ in range(k)]
        candidate_inputs = [row for row in inputs for _ in range(k)]
        if candidate_ids is None:
            candidate_ids = self._reference_candidates(candidate_prompt_ids, k, candidate_inputs)
        trajectories = [self.trajectories[id(ids)] for ids in candidate_ids]
        environments = [t.environment for t in trajectories] if trl_generation.uses_environments(trainer) else None
        with trl_generation.environments_as(trainer, environments):
            rewards = trl_generation.score_quietly(trainer, candidate_inputs, [t.prompt for t in trajectories],
                                                   [t.completions for t in trajectories], candidate_ids)
        return candidate_ids, rewards

    def reward_prompts(self, rows: list[int], inputs: list[dict]) -> list:
        """The chat prompts TRL hands the reward functions with these rows (after their environments' resets)."""
        prompts = self.trainer.tool_round.prompts
        return [prompts[i] for i in rows]

    def reward_completions(self, prompt_ids: list, completion_ids: list, prompts: list) -> list:
        """The on-policy rows' messages, as TRL's loop left them."""
        return [self.trajectories[id(ids)].completions for ids in completion_ids]


def finished_loop(trajectories: list[Trajectory], prompts, prompt_ids, completion_ids, completions, logprobs, *_):
    """What TRL's ``_tool_call_loop`` returns for a round whose trajectories were run already (they must be the rows
    TRL hands it): tool masks, messages, completion ids, log-probs, tool calls, failures, tool images."""
    if [list(ids) for ids in completion_ids] != [t.completion_ids for t in trajectories]:
        raise RuntimeError("armor_trl: TRL's tool loop was handed other rows than the round's trajectories")
    # TRL counts the calls its loop ran for the round's rows: a filler (its group's first row, the same trajectory)
    # and a cached anchor (a stored trajectory) ran none of their own
    ran = {id(t): t for t in trajectories if t.ran}.values()
    return ([list(t.tool_mask) for t in trajectories], [t.completions for t in trajectories], completion_ids,
            logprobs, sum(t.calls for t in ran), sum(t.failures for t in ran),
            [list(t.tool_images) for t in trajectories])


def log_tool_counts(trainer, kind: str, trajectories: list[Trajectory]) -> None:
    """TRL's tool metrics over one kind of row (all processes; collective): tool calls per row
    (``armor/{kind}_tool_call_frequency``) and failed calls per call (``armor/{kind}_tool_failure_frequency``). A row
    counts the calls of its trajectory (a cached anchor's stored ones too)."""
    local = torch.tensor([len(trajectories), sum(t.calls for t in trajectories), sum(t.failures for t in trajectories)],
                         dtype=torch.float, device=trainer.accelerator.device)
    rows, calls, failures = trainer.accelerator.reduce(local, reduction="sum").tolist()
    seam.log_metric(trainer, f"armor/{kind}_tool_call_frequency", calls / rows if rows else math.nan)
    seam.log_metric(trainer, f"armor/{kind}_tool_failure_frequency", failures / calls if calls else math.nan)


def check_group_prompts(prompts: list, group_size: int) -> None:
    """The rows of a group must share their prompt after their environments' resets (else their reset drew each its
    own task, and an anchor cannot compare with them)."""
    for start in range(0, len(prompts), group_size):
        if any(prompt != prompts[start] for prompt in prompts[start : start + group_size]):
            raise not_reproducible("environment_factory's environment")


def not_reproducible(name: str) -> ValueError:
    return ValueError(
        f"use_anchors=True with environment_factory needs each reset to reproduce the group's initial state from the "
        f"row it is given, and {name}'s reset did not: two resets with the same row returned different observations, "
        "so a group's rows (and π_ref's anchor candidates, which run in environments of their own reset with the same "
        "row) would start from different tasks. An anchor is a verified π_ref trajectory from the group's own "
        "starting point; with environment-owned data that draws a task on each reset there is none to share. What "
        "works: make reset depend only on its arguments (put the task, or a seed, in a train_dataset column: reset "
        "receives the row), or train with use_anchors=False (the mixed ratio only)."
    )
