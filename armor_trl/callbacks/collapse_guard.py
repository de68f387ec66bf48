"""The collapse guard: watch validation, detect the collapse, then stop or switch ARMOR on (the two-stage protocol).

The paper's protocol (docs/protocol.md) is: train DAPO, watch validation, take the best checkpoint before the collapse and
continue from it with ARMOR, that checkpoint also being the initial reference. With ``collapse_guard="armor"`` one run
does it: ARMOR is dormant (plain GRPO/DAPO) until :func:`collapse_detected` says so, then :meth:`CollapseGuard._fire`
loads the best checkpoint's weights and optimizer state into the policy, resets π_ref to them and starts ARMOR.
``collapse_guard="rollback"`` is its control: the same rollback, then the run's own method goes on (without it, a gain
of the protocol cannot be told apart from the gain of restarting at the best checkpoint).

The rule (:func:`collapse_detected`), over the validations so far: s_i the watched score, r_i the mean training reward
logged since the previous validation, b the first validation with the highest score. The guard fires at validation n
when each of the last ``patience`` validations (all after b) has s_b − s_i ≥ ``drop`` and the mean of their r_i is
≥ r_b (training reward has not fallen: the gap is over-optimization, not a broken run). Unknown rewards are not checked.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from transformers import Trainer, TrainerCallback
from transformers.utils import logging

from armor_trl.integration import trl_seam as seam
from armor_trl.callbacks.validation import TRAIN_REWARD_KEYS

logger = logging.get_logger(__name__)

TOLERANCE = 1e-9  # rounding slack in the rule's comparisons


def best_index(scores: Sequence[float]) -> int:
    """Index of the first highest score."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def collapse_detected(scores: Sequence[float], rewards: Sequence[float | None], drop: float, patience: int) -> bool:
    """Whether the guard fires after the last of these validations (scores and training rewards, in order)."""
    n = len(scores)
    if n <= patience:
        return False
    best = best_index(scores)
    window = range(n - patience, n)
    if best >= window.start or any(scores[best] - scores[i] < drop - TOLERANCE for i in window):
        return False
    known = [rewards[i] for i in window if rewards[i] is not None]
    if rewards[best] is None or not known:
        return True
    return sum(known) / len(known) >= rewards[best] - TOLERANCE


class CollapseGuard(TrainerCallback):
    """Applies :func:`collapse_detected` to the validations the trainer logs and acts once, per ``collapse_guard``.

    Added by ``ArmorGRPOTrainer`` when ``args.collapse_guard`` is set. It reads the watched metric from every log entry
    (a ValidationCallback attached to the trainer logs it), forces a checkpoint at each new best validation, and
    records its history in the checkpoints, so a resumed run continues the same decision.
    """

    def __init__(self, trainer: Trainer):
        args = trainer.args
        self.trainer = trainer
        self.action, self.drop, self.patience = args.collapse_guard, args.collapse_guard_drop, args.collapse_guard_patience
        self.metric = args.collapse_guard_watches  # None: the first val/…avg@n logged
        self.steps: list[int] = []
        self.checkpoints: list[str] = []  # per validation: the folder its step's checkpoint is (or would be) written to
        self.scores: list[float] = []
        self.rewards: list[float | None] = []
        self.rewards_since: list[float] = []  # training rewards logged since the last validation
        self.fired: dict | None = None  # the event, once it happened
        self._written_into = self._read_from = None  # the run folder of the checkpoint being written / read
        trainer.add_callback(self)

    # --- state ---------------------------------------------------------------------------------------------------
    STATE_FIELDS = ("metric", "steps", "checkpoints", "scores", "rewards", "rewards_since", "fired")

    def state_dict(self) -> dict:
        """The history, its checkpoint folders relative to the run folder the state is written into (so that a run
        folder moved as a whole still finds them; one of an earlier run resumed from elsewhere is "../other/...")."""
        state = {key: getattr(self, key) for key in self.STATE_FIELDS}
        base = self._written_into
        if base is not None:
            state["checkpoints"] = [os.path.relpath(path, base) for path in self.checkpoints]
            if self.fired is not None and self.fired.get("best_checkpoint"):
                state["fired"] = {**self.fired, "best_checkpoint": os.path.relpath(self.fired["best_checkpoint"], base)}
        return state

    def load_state_dict(self, state: dict) -> None:
        for key in self.STATE_FIELDS:  # known fields only: a checkpoint cannot set anything else on the guard
            if key in state:
                setattr(self, key, state[key])
        if "checkpoints" not in state:  # written before the guard kept its checkpoints' folders: the run's own folder
            self.checkpoints = [os.path.abspath(self.checkpoint_of(step)) for step in self.steps]
        # relative folders are the run folder's the state was read from (absolute ones, written before, stay)
        base = self._read_from or os.path.abspath(self.trainer.args.output_dir)
        self.checkpoints = [os.path.normpath(os.path.join(base, path)) for path in self.checkpoints]
        if self.fired is not None and self.fired.get("best_checkpoint"):
            self.fired = {**self.fired, "best_checkpoint": os.path.normpath(os.path.join(base,
                                                                                         self.fired["best_checkpoint"]))}
        self._read_from = None

    def register(self, armor_state) -> None:
        armor_state.register("collapse_guard", self.state_dict, self.load_state_dict,
                             save_files=self._saving_into, load_files=self._loading_from)

    # (the checkpoint folder's parent is the run folder; both hooks run just before state_dict / load_state_dict)
    def _saving_into(self, directory: str, write: bool) -> None:
        self._written_into = os.path.dirname(os.path.abspath(directory))

    def _loading_from(self, directory: str) -> None:
        self._read_from = os.path.dirname(os.path.abspath(directory))

    def checkpoint_of(self, step: int) -> str:
        return seam.checkpoint_dir(self.trainer, step)

    @property
    def best_checkpoint(self) -> str | None:
        """The checkpoint of the best validation, in the folder it was written to (a run resumed into another
        output_dir keeps the folder of the validations before the resume)."""
        return self.checkpoints[best_index(self.scores)] if self.scores else None

    # --- events --------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        if self.action != "stop" and (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled):
            raise ValueError(
                f"collapse_guard={self.action!r} cannot load the best checkpoint into a DeepSpeed or FSDP engine "
                "mid-run yet. "
                "Run stage 1 with collapse_guard='stop', then start ARMOR from its best checkpoint "
                "(armor-trl train ... --resume_best_as_reference <run dir>)."
            )
        if not any(type(c).__name__ == "ValidationCallback" for c in trainer.callback_handler.callbacks):
            logger.warning(
                f"collapse_guard={self.action!r} watches {self.metric or 'val/…avg@n'}, but no ValidationCallback is "
                "attached to this trainer (val_every_steps in the CLI): unless something else logs that metric, the "
                "guard never fires."
            )

    def _watched(self, logs: dict) -> str | None:
        if self.metric is None:
            self.metric = next((k for k in logs if k.startswith("val/") and "avg@" in k), None)
        return self.metric if self.metric in logs else None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.fired is not None or not logs:
            return
        reward = next((logs[key] for key in TRAIN_REWARD_KEYS if logs.get(key) is not None), None)
        if reward is not None:
            self.rewards_since.append(float(reward))
        metric = self._watched(logs)
        if metric is None or not math.isfinite(logs[metric]):
            return
        self.steps.append(state.global_step)
        self.checkpoints.append(os.path.abspath(self.checkpoint_of(state.global_step)))
        self.scores.append(float(logs[metric]))
        self.rewards.append(sum(self.rewards_since) / len(self.rewards_since) if self.rewards_since else None)
        self.rewards_since = []
        if best_index(self.scores) == len(self.scores) - 1:
            control.should_save = True  # the checkpoint of a new best is written right after this log
        elif collapse_detected(self.scores, self.rewards, self.drop, self.patience):
            self._fire(state, control)

    def _fire(self, state, control) -> None:
        best = best_index(self.scores)
        checkpoint = self.best_checkpoint
        window = slice(len(self.scores) - self.patience, None)
        self.fired = {"step": state.global_step, "action": self.action, "best_step": self.steps[best],
                      "best_score": self.scores[best], "best_checkpoint": checkpoint}
        what = (f"collapse guard: {self.metric} fell from {self.scores[best]:.4f} (step {self.steps[best]}) by at "
                f"least {self.drop} for {self.patience} validations (steps {self.steps[window]}: "
                f"{[round(s, 4) for s in self.scores[window]]}) while training reward did not fall")
        if self.action == "stop":
            control.should_training_stop = True
            logger.warning(f"{what}: training stops at step {state.global_step}; best checkpoint: {checkpoint}")
            Trainer.log(self.trainer, {"collapse_guard/fired": 1.0})
            return
        if not os.path.isdir(checkpoint):
            raise ValueError(
                f"{what}, but the best checkpoint {checkpoint} is missing, so training cannot go on from it. Keep "
                "checkpoints (save_total_limit with metric_for_best_model = the watched metric keeps the best one)."
            )
        if self.action == "rollback":
            roll_back(self.trainer, checkpoint, state.global_step, self.steps[best])
            logger.warning(f"{what}: training goes on at step {state.global_step} from {checkpoint} (its weights and "
                           "optimizer state), with the same method")
            Trainer.log(self.trainer, {"collapse_guard/fired": 1.0})
            return
        switch_to_armor(self.trainer, checkpoint, state.global_step, self.steps[best])
        logger.warning(f"{what}: ARMOR starts at step {state.global_step} from {checkpoint} (policy and π_ref = its "
                       "weights, optimizer state from it)")
        Trainer.log(self.trainer, {"collapse_guard/fired": 1.0, "armor/stage": 1.0})


def roll_back(trainer, checkpoint: str, step: int, checkpoint_step: int) -> None:
    """Training goes on at optimizer step ``step`` from ``checkpoint`` (written after ``checkpoint_step``): the policy
    gets its weights and optimizer state, and every piece of ARMOR state its own (π_ref, the reset counter, the anchor
    cache, the column rotation; not the guard's history nor the refill stream), with the α / reset schedule shifted so
    that it continues from where the checkpoint was. Buffered rollouts of the collapsed policy go."""
    seam.load_weights(trainer, checkpoint)
    optimizer_file = os.path.join(checkpoint, "optimizer.pt")
    if os.path.isfile(optimizer_file):
        state = torch.load(optimizer_file, map_location=trainer.args.device, weights_only=True)
        trainer.optimizer.load_state_dict(state)
    trainer.armor_state.load(checkpoint, skip=("collapse_guard", "refill"))
    if trainer.armor_started_at is not None:
        trainer.armor_started_at += step - checkpoint_step
    seam.discard_rollouts(trainer)


def switch_to_armor(trainer, checkpoint: str, step: int, checkpoint_step: int) -> None:
    """Stage 2 of the protocol: the policy gets ``checkpoint``'s weights (saved after optimizer step
    ``checkpoint_step``) and optimizer state, π_ref becomes an exact copy of them, and ARMOR acts from optimizer step
    ``step`` on (α decay and reset schedules count from there)."""
    roll_back(trainer, checkpoint, step, checkpoint_step)
    trainer.reference.reset(trainer.unwrapped_policy(), step, weights_step=checkpoint_step)
    trainer.armor_started_at = step
