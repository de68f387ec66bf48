"""Equal generation calls, and equal rows where the engine needs them, on every process during TRL's tool loop
(docs/agents.md, "Several processes").

In TRL's tool loop each process makes one generation call per turn that any of its rows still needs: a process whose
trajectories finish in fewer turns stops calling. Where a generation call is a collective over the processes
(DeepSpeed ZeRO-3 gathers the parameters for every call and transformers' ``generate`` syncs every decoding step;
FSDP; vLLM in server mode or with tensor parallelism: :func:`~armor_trl.integration.trl_generation.
generation_is_collective`), the others then wait for a call that never comes (gloo: "collective mismatch"; NCCL: a
hang). And vLLM in server mode (or colocated with tensor parallelism) gathers every process's prompts and hands each
process back the slice at ``process_index × its row count``: with unequal row counts a process gets another's
completions (:func:`~armor_trl.integration.trl_generation.generation_slices_rows`).

:func:`tool_loop` wraps every tool loop ArmorGRPOTrainer runs: the policy's rows and π_ref's candidates in an anchored
round (:class:`~armor_trl.rollout.tool_anchors.ToolAnchorRollout`), TRL's own loop elsewhere (``use_anchors=False``,
rounds before ARMOR starts) and validation's loop (:mod:`~armor_trl.callbacks.tool_evaluation`). Within it every turn
after a tool result goes through :func:`agreed_turn` (the trainer's ``_generate_single_turn`` hook): the processes
agree, with one small all-gather, how many rows the call has at most; where the engine slices by row count a process
pads its rows to that count with throw-away rows (its loop's first prompt token), and drops their completions. A
process whose loop has ended keeps answering "0 rows" and, while any other process still generates, joins that call
with a throw-away turn: one row of one token (the transformers paths: ZeRO-3, FSDP), or as many throw-away rows as
the call has (vLLM, whose sampling settings the finished process leaves as they are: the server samples every
process's rows with the main process's settings). A throw-away turn samples on the finished process, which therefore
draws from its random generator where it would have waited.
"""

from __future__ import annotations

import contextlib

import torch

from armor_trl.integration import trl_generation


class TurnAgreement:
    """The generation calls of one tool loop on this process, agreed with the other processes'."""

    def __init__(self, trainer, prompt_ids: list[int]):
        self.trainer, self.prompt_ids = trainer, list(prompt_ids[:1]) or [0]
        self.pads_rows = trl_generation.generation_slices_rows(trainer)
        self.throwaway_turns = 0

    def _most_rows(self, rows: int) -> int:
        """The most rows any process generates in this call of the loop (0: none generates)."""
        count = torch.tensor([rows], device=self.trainer.accelerator.device)
        return int(self.trainer.accelerator.gather(count).max().item())

    def turn(self, rows: int) -> int:
        """This process generates a turn of ``rows`` rows now (every other process joins the call); returns the
        throw-away rows it adds to them: as many as make every process's count equal where the engine slices by row
        count, else none."""
        most = self._most_rows(rows)
        return most - rows if self.pads_rows else 0

    def finish(self) -> None:
        """This process's loop has ended: join the others' calls with throw-away turns until none generates."""
        while (most := self._most_rows(0)) > 0:
            trl_generation.throwaway_turn(self.trainer, self.prompt_ids, most if self.pads_rows else 1)
            self.throwaway_turns += 1
        self.trainer._armor_throwaway_turns = getattr(self.trainer, "_armor_throwaway_turns", 0) + self.throwaway_turns


def in_tool_turns(trainer) -> bool:
    """Whether the trainer's generation is inside a tool loop (a turn after a tool result): such calls go straight
    to TRL's generation, with whatever model is routed in."""
    return getattr(trainer, "_armor_tool_turns", 0) > 0


@contextlib.contextmanager
def tool_loop(trainer, prompt_ids: list):
    """Within the block (one call of TRL's tool loop on rows with ``prompt_ids``) the trainer's generation calls are
    the loop's turns after a tool result (:func:`in_tool_turns`), each agreed with the other processes where a call
    is collective (:func:`agreed_turn`); at its end this process joins their remaining calls."""
    agreement = TurnAgreement(trainer, prompt_ids[0] if prompt_ids else []) if (
        trl_generation.generation_is_collective(trainer)) else None
    saved = getattr(trainer, "_armor_turns_agreed", None)
    trainer._armor_tool_turns, trainer._armor_turns_agreed = getattr(trainer, "_armor_tool_turns", 0) + 1, agreement
    try:
        yield
    finally:
        trainer._armor_tool_turns -= 1
        trainer._armor_turns_agreed = saved
    if agreement is not None:
        agreement.finish()


def agreed_turn(trainer, generate, prompt_ids: list, images, *args, **kwargs):
    """One turn of a tool loop (``generate``: TRL's ``_generate_single_turn``), agreed with the other processes where a
    generation call is collective: padded with throw-away rows where the engine slices by row count, whose completions
    are dropped. Returns (completion ids, log-probs) of ``prompt_ids``' rows."""
    agreement = getattr(trainer, "_armor_turns_agreed", None)
    pad = 0 if agreement is None else agreement.turn(len(prompt_ids))
    if not pad:
        return generate(prompt_ids, images, *args, **kwargs)
    rows = len(prompt_ids)
    padded_images = None if images is None else list(images) + [None] * pad
    completion_ids, logprobs = generate(list(prompt_ids) + [list(agreement.prompt_ids)] * pad, padded_images, *args,
                                        **kwargs)
    return completion_ids[:rows], None if logprobs is None else logprobs[:rows]
