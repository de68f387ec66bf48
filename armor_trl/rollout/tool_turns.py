"""Equal generation calls on every process during TRL's tool loop (docs/agents.md, "Several processes").

In TRL's tool loop each process makes one generation call per turn that any of its rows still needs: a process whose
trajectories finish in fewer turns stops calling. Where a generation call is a collective over the processes
(DeepSpeed ZeRO-3 gathers the parameters for every call and transformers' ``generate`` syncs every decoding step;
FSDP; vLLM in server mode or with tensor parallelism: :func:`~armor_trl.integration.trl_generation.
generation_is_collective`), the others then wait for a call that never comes (gloo: "collective mismatch"; NCCL: a
hang). :func:`turns_agreed` keeps the calls equal: before each turn of the loop a process says it generates; a
process whose loop has ended keeps answering "done" and, while any other process still generates, joins that call
with a throw-away turn (one row: its loop's first prompt, the completion discarded), until all of them are done.

It wraps every tool loop ArmorGRPOTrainer runs: the policy's rows and π_ref's candidates in an anchored round
(:class:`~armor_trl.rollout.tool_anchors.ToolAnchorRollout`) and TRL's own loop elsewhere (``use_anchors=False``,
rounds before ARMOR starts, evaluation), since both go through the trainer's loop hooks. A throw-away turn samples
one row, so the finished process draws from its RNG where it would have waited.
"""

from __future__ import annotations

import contextlib

import torch

from armor_trl.integration import trl_generation


class TurnAgreement:
    """The generation calls of one tool loop on this process, agreed with the other processes'."""

    def __init__(self, trainer, prompt_ids: list[int]):
        self.trainer, self.prompt_ids = trainer, list(prompt_ids[:1]) or [0]
        self.throwaway_turns = 0

    def _anyone_generates(self, generating: bool) -> bool:
        flag = torch.tensor([int(generating)], device=self.trainer.accelerator.device)
        return bool(self.trainer.accelerator.gather(flag).max().item())

    def turn(self) -> None:
        """This process generates a turn of its loop now (every other process joins the call)."""
        self._anyone_generates(True)

    def finish(self) -> None:
        """This process's loop has ended: join the others' calls with throw-away turns until none generates."""
        while self._anyone_generates(False):
            trl_generation.throwaway_turn(self.trainer, self.prompt_ids)
            self.throwaway_turns += 1
        self.trainer._armor_throwaway_turns = getattr(self.trainer, "_armor_throwaway_turns", 0) + self.throwaway_turns


@contextlib.contextmanager
def turns_agreed(trainer, prompt_ids: list):
    """Within the block (one call of TRL's tool loop on rows with ``prompt_ids``) every generation call of the loop is
    agreed with the other processes, and at its end this process joins their remaining calls; a no-op where a
    generation call is not collective."""
    if not trl_generation.generation_is_collective(trainer):
        yield
        return
    agreement = TurnAgreement(trainer, prompt_ids[0] if prompt_ids else [])
    saved, trainer._armor_turns_agreed = getattr(trainer, "_armor_turns_agreed", None), agreement
    try:
        yield
    finally:
        trainer._armor_turns_agreed = saved
    agreement.finish()


def before_turn(trainer) -> None:
    """Called by the trainer's generation hook before a turn of the tool loop (a call after a tool result)."""
    agreement = getattr(trainer, "_armor_turns_agreed", None)
    if agreement is not None:
        agreement.turn()
