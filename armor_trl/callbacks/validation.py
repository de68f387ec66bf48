"""The validation callback for training: :class:`ValidationCallback` evaluates every N optimizer steps on a held-out
set (with :mod:`armor_trl.callbacks.evaluation`) and logs ``val/avg@k``, ``val/pass@k`` and ``val/reward_gap``
(training reward minus validation accuracy, the reward–validation gap ARMOR targets) through the trainer's logging,
so every ``report_to`` integration gets them, and optionally to a JSONL file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import SaveStrategy
from transformers.utils import logging
from trl import GRPOTrainer

from armor_trl.integration import trl_seam
from armor_trl.callbacks.evaluation import (
    StartKL, check_k, evaluate, evaluate_with_trainer, pass_curve, sampling_settings,
)

logger = logging.get_logger(__name__)

# Training-reward log keys, in order of preference: ARMOR's on-policy reward (TRL's `reward` includes anchors).
TRAIN_REWARD_KEYS = ("armor/policy_reward_mean", "reward")


def _from_main_process(value):
    """``value`` as the main process has it, on every process (a no-op in a single process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


class ValidationCallback(TrainerCallback):
    """Evaluate on a held-out set every ``every_steps`` optimizer steps (and before training) and log the results.

    Attach it with :meth:`attach` (``ValidationCallback(...).attach(trainer)``, or pass ``trainer=``): the values
    (``val/avg@n``, ``val/pass@k``, ``val/reward_gap`` = training reward − ``val/avg@n``, with the training reward
    taken from :data:`TRAIN_REWARD_KEYS` of the same step's log) are then logged through the trainer's own
    ``log()`` as one entry at the step they were measured, after that step's training log. Every callback's
    ``on_log`` sees them, so they reach each ``report_to`` integration (wandb, trackio, tensorboard, ...) and
    ``trainer.state.log_history`` once. ``transformers.Trainer.log`` is called, not TRL's ``GRPOTrainer.log``,
    which would average and clear the training metrics buffered for the step's own log.

    ``eval_dataset`` may be a dict of named sets (e.g. ``{"aime24": ..., "aime25": ...}``): each is logged under its
    own name, ``val/<name>/avg@n``, ``val/<name>/pass@k``, ``val/<name>/reward_gap`` (the key ``None`` keeps
    ``val/avg@n``). With ``metric_for_best_model`` naming one of the values (e.g. ``"val/aime24/avg@32"``), they drive
    transformers' best checkpoint like evaluation metrics: ``save_strategy="best"``, ``load_best_model_at_end`` and the
    rotation of ``save_total_limit`` (needs the callback attached).

    Passed in ``callbacks=[...]`` without a trainer it still works, but it runs after the reporting integrations
    (transformers puts them first): the values are then merged into the step's log entry in ``log_history`` and
    reach no reporter (warned once at the start of training when ``report_to`` names one).

    With ``mode_classifier`` (completion text → mode label, e.g. :func:`armor_trl.rewards.modes.classify`) each set also
    logs the share of its sampled completions in each mode, ``val/mode/<mode>`` (``val/<name>/mode/<mode>``).

    Besides ``val/pass@k`` each set logs ``val/pass@j`` for every power of two j <= k (the pass@k curve). With
    ``kl_prompts`` > 0 (needs the callback attached to a GRPOTrainer) it also logs ``val/kl_reverse_start`` and
    ``val/kl_forward_start``: the KL between the policy and the model training started from, on the first
    ``kl_prompts`` prompts of the held-out set (the unnamed set, else the first), ``kl_samples`` completions each
    (:class:`StartKL`; keeps a copy of the trainable weights).

    The evaluation before training (step 0) is kept in ``self.history`` and the JSONL file only. Each record is
    kept in ``self.history`` and appended to ``jsonl_path`` (by the main process) if given.

    Attached to a GRPOTrainer, validation generates through the trainer's own generation path
    (:func:`evaluate_with_trainer`: transformers or vLLM, as the run does, with this callback's sampling settings),
    sharded over all processes, so it works under DDP, ZeRO-2 and ZeRO-3. Otherwise it generates with
    ``transformers`` ``generate`` on the main process only (refused under ZeRO-3) and broadcasts the values. Either
    way every process logs the same entry.
    """

    def __init__(
        self,
        eval_dataset,
        verifier: Callable,
        every_steps: int,
        k: int = 4,
        num_samples: int | None = None,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        batch_size: int = 64,
        seed: int = 0,
        jsonl_path: str | None = None,
        run_name: str | None = None,
        on_evaluate: Callable[[dict], None] | None = None,
        trainer: Trainer | None = None,
        mode_classifier: Callable[[str], str] | None = None,
        kl_prompts: int = 0,
        kl_samples: int = 4,
    ):
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        if kl_prompts < 0 or kl_samples < 1:
            raise ValueError(f"need kl_prompts >= 0 (0 = off) and kl_samples >= 1, got {kl_prompts}, {kl_samples}.")
        if kl_prompts and temperature == 0:
            raise ValueError("kl_prompts > 0 needs sampled validation (temperature > 0): the KL to the start model is "
                             "estimated from samples.")
        self.eval_dataset, self.verifier, self.every_steps = eval_dataset, verifier, every_steps
        self.eval_sets = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset}
        for name in self.eval_sets:
            if name is not None and (not isinstance(name, str) or not name or "/" in name):
                raise ValueError(f"eval_dataset names must be non-empty strings without '/', got {name!r}.")
        self.k, self.num_samples = k, check_k(k, num_samples)
        self.generation = sampling_settings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                            batch_size=batch_size)
        self.seed, self.jsonl_path, self.run_name, self.on_evaluate = seed, jsonl_path, run_name, on_evaluate
        self.mode_classifier = mode_classifier
        self.kl_prompts, self.kl_samples = kl_prompts, kl_samples
        self.start_kl: StartKL | None = None  # built at the start of training
        self.history: list[dict] = []
        self._pending: dict | None = None
        self._logging = False  # inside our own trainer.log call
        self.trainer: Trainer | None = None
        if trainer is not None:
            self.attach(trainer)

    def attach(self, trainer: Trainer) -> ValidationCallback:
        """Log through ``trainer`` (so every reporter gets the values) and add this callback to it if needed."""
        if not isinstance(trainer, Trainer):
            raise ValueError(f"trainer must be a transformers.Trainer (e.g. a GRPOTrainer), got {type(trainer).__name__}.")
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return self

    @property
    def on_every_process(self) -> bool:
        """Whether validation runs through the trainer's generation path, sharded over all processes (attached to
        a GRPOTrainer), rather than with ``transformers`` ``generate`` on the main process only."""
        return isinstance(self.trainer, GRPOTrainer)

    def _evaluate(self, state, model, tokenizer) -> dict:
        values = {}
        for name, dataset in self.eval_sets.items():
            seed = self.seed + state.global_step
            if self.on_every_process:
                result = evaluate_with_trainer(
                    self.trainer, dataset, self.verifier, self.k, self.num_samples, seed=seed,
                    classify=self.mode_classifier, **self.generation
                )
            else:
                result = evaluate(
                    model, tokenizer, dataset, self.verifier, self.k, self.num_samples, seed=seed,
                    classify=self.mode_classifier, **self.generation
                )
            prefix = "val/" if name is None else f"val/{name}/"
            values[f"{prefix}avg@{self.num_samples}"] = result[f"avg@{self.num_samples}"]
            values[f"{prefix}pass@{self.k}"] = result[f"pass@{self.k}"]
            for j, value in pass_curve(result["correct_counts"], self.num_samples, self.k).items():
                values.setdefault(f"{prefix}pass@{j}", value)
            for mode, share in result.get("mode_shares", {}).items():
                values[f"{prefix}mode/{mode}"] = share
            for key in ("tool_call_rate", "tool_calls"):  # an agent's (a trainer with tools)
                if key in result:
                    values[prefix + key] = result[key]
        if self.start_kl is not None:  # collective, like validation through the trainer
            values.update({f"val/{key}": value for key, value in self.start_kl.measure(state.global_step).items()})
        return values

    def _record(self, step: int, metrics: dict, logs: dict | None, write: bool = True) -> dict:
        record = {"step": step, **({"run": self.run_name} if self.run_name else {}), **metrics}
        train_reward = next((logs[key] for key in TRAIN_REWARD_KEYS if logs and logs.get(key) is not None), None)
        if train_reward is not None:
            record["train_reward"] = train_reward
            avg = f"avg@{self.num_samples}"
            for key in [key for key in metrics if key.endswith(avg)]:
                record[key.removesuffix(avg) + "reward_gap"] = train_reward - metrics[key]
        self.history.append(record)
        if not write:
            return record
        if self.jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.jsonl_path)), exist_ok=True)
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.on_evaluate is not None:
            self.on_evaluate(record)
        return record

    def _feed_best_metric(self, values: dict, control) -> None:
        """Hand the values to transformers' best-checkpoint machinery like evaluation metrics, so that
        ``metric_for_best_model`` (e.g. "val/avg@4"), ``save_strategy="best"``, ``load_best_model_at_end`` and the
        rotation of ``save_total_limit`` (which keeps the best checkpoint) work with validation."""
        args = self.trainer.args
        name = args.metric_for_best_model
        if name is None or name.removeprefix("eval_") not in values:
            return
        is_new_best = trl_seam.is_new_best(self.trainer, {f"eval_{k}": v for k, v in values.items()})
        if is_new_best and args.save_strategy == SaveStrategy.BEST:
            control.should_save = True  # transformers saves only after its own evaluation otherwise

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        plugin = getattr(args, "deepspeed_plugin", None)
        if not self.on_every_process and plugin is not None and getattr(plugin, "zero_stage", None) == 3:
            # generation on one process of a model sharded over all of them would wait forever for the others
            raise ValueError(
                "A ValidationCallback not attached to a GRPOTrainer runs on the main process only and does not work "
                "with DeepSpeed ZeRO-3, which shards the weights. Attach it (ValidationCallback(...).attach(trainer)) "
                "to validate through the trainer's generation on every process."
            )
        reporters = [r for r in (getattr(args, "report_to", None) or []) if r != "none"]
        if self.trainer is None and reporters and state.is_world_process_zero:
            logger.warning(
                f"ValidationCallback was passed without its trainer: val/* metrics go to trainer.state.log_history "
                f"and the JSONL file but not to report_to={reporters}. Use ValidationCallback(...).attach(trainer) "
                "(or trainer=...) instead of callbacks=[...] so every reporter gets them."
            )
        if self.kl_prompts:
            self._start_kl(args, state)
        if state.global_step == 0 and self.on_every_process:
            self._record(0, self._evaluate(state, model, processing_class), None, write=state.is_world_process_zero)
        elif state.global_step == 0 and state.is_world_process_zero:
            self._record(0, self._evaluate(state, model, processing_class), None)

    def _start_kl(self, args, state) -> None:
        if not self.on_every_process:
            raise ValueError("kl_prompts > 0 needs the ValidationCallback attached to a GRPOTrainer "
                             "(ValidationCallback(...).attach(trainer)): the KL samples use its generation path.")
        plugin = getattr(args, "deepspeed_plugin", None)
        if plugin is not None and getattr(plugin, "zero_stage", None) == 3:
            raise ValueError("kl_prompts > 0 does not support DeepSpeed ZeRO-3 (the start model's weights are swapped "
                             "into the policy, which ZeRO-3 shards). Use ZeRO-2 or DDP, or kl_prompts=0.")
        dataset = self.eval_sets.get(None, next(iter(self.eval_sets.values())))
        if self.kl_prompts > len(dataset):
            raise ValueError(f"kl_prompts ({self.kl_prompts}) exceeds the {len(dataset)} prompts of the held-out set.")
        if state.global_step > 0 and state.is_world_process_zero:
            logger.warning(f"Resumed at step {state.global_step}: val/kl_*_start measure the KL to the weights this "
                           "run resumed from, not to the model the first run started from.")
        generation = self.generation
        self.start_kl = StartKL(self.trainer, dataset["prompt"][: self.kl_prompts], self.kl_samples, self.seed,
                                generation["temperature"], generation["top_p"], generation["max_new_tokens"],
                                generation["batch_size"])

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step % self.every_steps == 0 or state.global_step == state.max_steps:
            # Log this step on every process (logging gathers the loss across processes): the training log of the
            # step carries the training reward the gap is measured against, and the values follow it at this step.
            control.should_log = True
            if self.on_every_process:  # collective: every process evaluates its share and gets all values
                self._pending = self._evaluate(state, model, processing_class)
            else:
                values = self._evaluate(state, model, processing_class) if state.is_world_process_zero else None
                self._pending = _from_main_process(values)  # every process logs them (and a collapse guard sees them)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending is None or logs is None or self._logging:
            return
        record = self._record(state.global_step, self._pending, logs, write=state.is_world_process_zero)
        self._pending = None
        values = {key: value for key, value in record.items() if key.startswith("val/")}
        if self.trainer is not None:
            self._logging = True
            try:
                Trainer.log(self.trainer, values)  # its own log_history entry, seen by every callback's on_log
            finally:
                self._logging = False
            self._feed_best_metric(values, control)
            return
        logs.update(values)  # seen only by the callbacks after this one (the reporters come before it)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)
