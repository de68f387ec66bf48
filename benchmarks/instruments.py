"""Timers around the training step's phases, and memory readings. Used inside worker processes only.

The time split of one optimizer step comes from wrapping TRL's hook methods on the trainer instance (the ones
``armor_trl.integration.trl_seam`` lists, plus ``_prepare_inputs`` and ``training_step``) and the ``trl_generation`` helpers
through which ARMOR samples and scores reference candidates and computes reference log-probs (and ``vllm_engine``'s, through
which it pushes π_ref's weights). Nothing of
ArmorGRPOTrainer's own methods is touched, so the same instruments serve trl.GRPOTrainer and ArmorGRPOTrainer:

* ``policy_gen``   TRL's ``GRPOTrainer._generate_single_turn`` for the training rows (for ARMOR: the on-policy rows
                   only; its anchor candidates go through the same method inside ``trl_generation.generate``)
* ``anchor_gen``   ``trl_generation.generate``: the reference candidates, K per group
* ``anchor_score`` the rest of ARMOR's ``_generate_single_turn``: ``trl_generation.score_quietly`` (rewards of the
                   candidates), decoding, selection, cache bookkeeping, the switch to the reference; where only
                   eligible groups get candidates (dynamic sampling) also the on-policy rows' rewards, scored there
                   first (``reward`` then holds TRL's reuse of them)
* ``ref_fwd``      log-probs computed while the generation batch is built (π_ref's and, when TRL needs them, π_old's):
                   ``trl_generation.per_token_logps`` (ArmorGRPOTrainer; under dynamic sampling π_old's too) or, for GRPO
                   with beta > 0,
                   ``_get_per_token_logps_and_entropies`` called during ``_generate_and_score_completions``
* ``reward``       ``_calculate_rewards`` (instance) for the training rows
* ``gen_other``    rest of ``_generate_and_score_completions`` (tokenize, decode, advantages, metrics)
* ``loss_bwd``     ``training_step`` minus ``_prepare_inputs``: forward with grad, loss, backward
* ``push_ref``     with vLLM: pushing π_ref's weights into the engine for the anchor candidates
                   (``vllm_engine.push_to_engine``, inside ARMOR's ``_generate_single_turn``)
* ``push_policy``  with vLLM: TRL's pushes of the policy's weights (its ``sync_weights`` at a rollout after an
                   optimizer step, and after an anchor call), taken out of ``policy_gen``
* ``policy_tools`` with tools (TRL's tool loop): the training rows' turns after their first (the tools run, each
                   later generation), for GRPO TRL's ``_tool_call_loop``, for ARMOR ``trl_generation.tool_call_loop``
                   (an anchored round runs the rows' loops in its rollout), taken out of ``gen_other`` /
                   ``anchor_score``
* ``anchor_tools`` with tools: π_ref's candidates' turns after their first (TRL's loop inside
                   ``ToolAnchorRollout._reference_candidates``), taken out of ``anchor_score``
* ``other``        rest of the optimizer step: optimizer, scheduler, callbacks (reference resets), logging

Besides the times, the work of each optimizer step (:data:`WORK`): TRL's generate calls for the policy's rows (one per
generation round) and the rows they generate, generate calls for the anchor candidates (lazy waves: one per wave),
and the rows of every log-prob forward pass made while generation batches are built (π_old's and π_ref's; not the
loss's).
"""

from __future__ import annotations

import functools
import resource
import time
from collections import defaultdict

PARTS = ("policy_gen", "anchor_gen", "anchor_score", "ref_fwd", "reward", "gen_other", "loss_bwd", "push_ref",
         "push_policy", "policy_tools", "anchor_tools", "other")
WORK = ("policy_calls", "policy_rows", "anchor_calls", "logp_rows", "policy_turn_calls", "anchor_turn_calls")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class Timers:
    """Wall and process-CPU seconds per key, accumulated over one optimizer step."""

    def __init__(self):
        self.current = defaultdict(float)
        self.cpu = defaultdict(float)
        self.calls = defaultdict(int)
        self.step_calls, self.step_rows = defaultdict(int), defaultdict(int)  # this optimizer step's
        self.flags = set()  # names of the wrapped calls in progress that set a flag

    def wrap(self, fn, key, flag=None, key_fn=None, rows_fn=None):
        """``fn`` timed under ``key`` (or ``key_fn()``; None: not timed); ``flag`` is set while it runs (a call made
        while its own flag is set, from inside itself, is not timed again); ``rows_fn(args, result)``: the rows of
        the call, counted per step."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            name = key_fn() if key_fn else key
            if name is None or (flag is not None and flag in self.flags):
                return fn(*args, **kwargs)
            if flag:
                self.flags.add(flag)
            start, cpu_start = time.perf_counter(), time.process_time()
            result = None
            try:
                result = fn(*args, **kwargs)
                return result
            finally:
                self.current[name] += time.perf_counter() - start
                self.cpu[name] += time.process_time() - cpu_start
                self.calls[name] += 1
                self.step_calls[name] += 1
                if rows_fn is not None and result is not None:
                    self.step_rows[name] += rows_fn(args, result)
                if flag:
                    self.flags.discard(flag)

        return wrapper

    def take(self) -> tuple[dict, dict, dict]:
        """This step's wall and CPU totals and its work (:func:`work`); starts the next step."""
        wall, cpu, done = dict(self.current), dict(self.cpu), work(self.step_calls, self.step_rows)
        for totals in (self.current, self.cpu, self.step_calls, self.step_rows):
            totals.clear()
        return wall, cpu, done


def work(calls: dict, rows: dict) -> dict:
    """One step's :data:`WORK` from its call and row counts per timer key."""
    return {"policy_calls": calls.get("policy_generate", calls.get("gen_single_turn", 0)),
            "policy_rows": rows.get("policy_generate", rows.get("gen_single_turn", 0)),
            "anchor_calls": calls.get("anchor_generate", 0) + calls.get("anchor_generate_after", 0),
            "logp_rows": rows.get("ref_fwd_armor", 0) + rows.get("logps_in_gen", 0),
            # with tools: the generate calls of the turns after a tool result, the training rows' and the candidates'
            "policy_turn_calls": calls.get("policy_turn_generate", calls.get("gen_turn", 0)),
            "anchor_turn_calls": calls.get("anchor_turn_generate", 0)}


def instrument(trainer, timers: Timers, armor: bool) -> list[dict]:
    """Wrap the trainer's TRL hooks (and, for ArmorGRPOTrainer, ``armor``, the seam helpers: with dynamic sampling
    its π_old log-probs go through them even with ARMOR off) with timers; return the list that receives one
    ``{"step", "raw", "raw_cpu", "work"}`` record per optimizer step."""
    from transformers import TrainerCallback

    t = trainer
    t._generate_and_score_completions = timers.wrap(t._generate_and_score_completions, "gs_total", flag="gen")
    # (a tool loop's later turns call it again from inside: timed as the loop's, below)
    # (a tool loop's turn outside an anchored round: counted as a turn call, timed within the loop's)
    t._generate_single_turn = timers.wrap(t._generate_single_turn, None, flag="single_turn",
                                          key_fn=lambda: "gen_turn" if "tool_turns" in timers.flags else "gen_single_turn",
                                          rows_fn=lambda args, result: len(args[0]))  # (prompt_ids, ...)
    if t.tools:  # TRL's tool loop (ARMOR's hook answers an anchored round's call with the trajectories it ran)
        t._tool_call_loop = timers.wrap(t._tool_call_loop, None, flag="tool_turns", key_fn=tool_turns_key(timers))
    t._calculate_rewards = timers.wrap(t._calculate_rewards, "rewards")
    t._prepare_inputs = timers.wrap(t._prepare_inputs, "prepare_inputs")
    t.training_step = timers.wrap(t.training_step, "training_step")
    # GRPO with beta > 0: the only per-token-logps forward during generation is the reference's (old log-probs are
    # not computed: steps_per_generation * num_iterations divides gradient_accumulation_steps).
    t._get_per_token_logps_and_entropies = timers.wrap(
        t._get_per_token_logps_and_entropies, None, key_fn=lambda: "logps_in_gen" if "gen" in timers.flags else None,
        # (model, input_ids, ...); a round's skipped π_old pass (dynamic sampling) returns None: no rows
        rows_fn=lambda args, result: 0 if result[0] is None else args[1].size(0),
    )
    if t.use_vllm:  # every weight push into the engine; ARMOR's pushes of π_ref also under "ref_push"
        engine = t.vllm_generation
        engine.sync_weights = timers.wrap(engine.sync_weights, "weight_sync")
    if armor:
        _instrument_seam(timers)
    if getattr(t, "anchor_rollout", None) is not None:  # the deferred groups' draw, after the refill loop
        rollout = t.anchor_rollout
        rollout.deferred_anchors = timers.wrap(rollout.deferred_anchors, "deferred_anchors", flag="deferred")
    steps = []

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            now, now_cpu = time.perf_counter(), time.process_time()
            wall, cpu, done = timers.take()
            steps.append({"step": state.global_step, "raw": {"step_s": now - self.last, **wall},
                          "raw_cpu": {"step_s": now_cpu - self.last_cpu, **cpu}, "work": done})
            self.last, self.last_cpu = now, now_cpu

    t.add_callback(StepTimer())  # last callback: its on_step_end runs after ARMOR's reference reset
    return steps


def tool_turns_key(timers: Timers):
    """The timer key of a tool loop's turns: the candidates' or the training rows' (``anchor_`` / ``policy_tool_turns``),
    ``_nested`` where the loop runs inside ARMOR's ``_generate_single_turn`` (an anchored round)."""

    def key():
        who = "anchor" if "candidates" in timers.flags else "policy"
        return f"{who}_tool_turns" + ("_nested" if "single_turn" in timers.flags else "")

    return key


def _instrument_seam(timers: Timers) -> None:
    """ARMOR: the seam helpers, and TRL's generation method where ARMOR calls it for the on-policy rows."""
    from trl import GRPOTrainer

    from armor_trl.integration import trl_generation, vllm_engine

    after = lambda key: (lambda: key + "_after" if "deferred" in timers.flags else key)  # noqa: E731
    trl_generation.generate = timers.wrap(trl_generation.generate, None, flag="anchor_gen",
                                          key_fn=after("anchor_generate"))
    trl_generation.score_quietly = timers.wrap(trl_generation.score_quietly, "anchor_score")
    trl_generation.per_token_logps = timers.wrap(trl_generation.per_token_logps, "ref_fwd_armor",
                                                 rows_fn=lambda args, result: args[2].size(0))  # (trainer, model, input_ids)
    vllm_engine.push_to_engine = timers.wrap(vllm_engine.push_to_engine, None, key_fn=after("ref_push"))
    # the class attribute, which ARMOR's override reaches through super(); inside trl_generation.generate it is anchors
    GRPOTrainer._generate_single_turn = timers.wrap(
        GRPOTrainer._generate_single_turn, None, key_fn=lambda: _generate_key(timers.flags),
        rows_fn=lambda args, result: len(args[1]),  # (trainer, prompt_ids, ...)
    )
    # tools: the rollout's loops (the rows' and the candidates'), and the candidates' part of them
    from armor_trl.rollout.tool_anchors import ToolAnchorRollout

    trl_generation.tool_call_loop = timers.wrap(trl_generation.tool_call_loop, None, flag="tool_turns",
                                                key_fn=tool_turns_key(timers))
    ToolAnchorRollout._reference_candidates = timers.wrap(ToolAnchorRollout._reference_candidates, None,
                                                          flag="candidates", key_fn=lambda: "candidates")


def _generate_key(flags: set) -> str | None:
    """The key of a call of TRL's generation method made by ARMOR: a tool loop's turn after a tool result (the
    candidates' or the training rows'), a candidate's first turn (counted by ``trl_generation.generate``: None), or
    the training rows' first turn."""
    if "tool_turns" in flags:
        return "anchor_turn_generate" if "candidates" in flags else "policy_turn_generate"
    return None if "anchor_gen" in flags else "policy_generate"


def split(raw: dict) -> dict:
    """Derived time split (seconds) of one optimizer step from the raw timer totals. The deferred groups' draw after
    the refill loop (``deferred_anchors``) is anchor work outside ARMOR's ``_generate_single_turn``: its generate calls
    and π_ref pushes are timed under ``*_after`` and the rest of it counts as ``anchor_score``."""
    g = raw.get
    single_turn = g("gen_single_turn", 0.0)
    policy = g("policy_generate", 0.0) if "policy_generate" in raw else single_turn
    ref = g("ref_fwd_armor", 0.0) + g("logps_in_gen", 0.0)
    push_ref = g("ref_push", 0.0) + g("ref_push_after", 0.0)
    push_policy = g("weight_sync", 0.0) - push_ref
    deferred = g("deferred_anchors", 0.0)
    # tool loops: inside ARMOR's _generate_single_turn (_nested) or beside it, in _generate_and_score_completions
    nested_tools = g("policy_tool_turns_nested", 0.0) + g("anchor_tool_turns_nested", 0.0)
    outer_tools = g("policy_tool_turns", 0.0) + g("anchor_tool_turns", 0.0)
    parts = {
        "policy_gen": policy - push_policy,
        "anchor_gen": g("anchor_generate", 0.0) + g("anchor_generate_after", 0.0),
        "anchor_score": (single_turn - policy - g("anchor_generate", 0.0) - g("ref_push", 0.0) - nested_tools
                         + deferred - g("anchor_generate_after", 0.0) - g("ref_push_after", 0.0)),
        "ref_fwd": ref,
        "reward": g("rewards", 0.0),
        "gen_other": g("gs_total", 0.0) - single_turn - g("rewards", 0.0) - ref - deferred - outer_tools,
        "loss_bwd": g("training_step", 0.0) - g("prepare_inputs", 0.0),
        "push_ref": push_ref,
        "push_policy": push_policy,
        "policy_tools": g("policy_tool_turns", 0.0) + g("policy_tool_turns_nested", 0.0),
        "anchor_tools": g("anchor_tool_turns", 0.0) + g("anchor_tool_turns_nested", 0.0),
    }
    parts["other"] = raw["step_s"] - sum(parts.values())
    return parts
