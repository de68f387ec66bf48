"""avg@k and pass@k of a model on a verifiable dataset, and a validation callback for training.

* :func:`pass_at_k` is the unbiased estimator 1 − C(n−c, k)/C(n, k) (Chen et al., 2021) from n samples with c
  correct; avg@k is the mean accuracy over the samples of each problem, averaged over problems.
* :func:`evaluate` samples with ``transformers`` ``generate`` (batched, temperature/top-p configurable) and
  scores with a verifier in TRL's reward signature (:mod:`armor_trl.rewards`); :func:`evaluate_with_trainer` does
  the same through a GRPOTrainer's own generation path (transformers or vLLM), sharded over its processes.
* :class:`ValidationCallback` evaluates every N optimizer steps on a held-out set during training and logs
  ``val/avg@k``, ``val/pass@k`` and ``val/reward_gap`` (training reward minus validation accuracy, the
  reward–validation gap ARMOR targets) through the trainer's logging, so every ``report_to`` integration gets
  them, and optionally to a JSONL file.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import SaveStrategy
from transformers.utils import logging
from trl import GRPOTrainer

from . import trl_seam
from .rewards import completion_text

logger = logging.get_logger(__name__)

# Training-reward log keys, in order of preference: ARMOR's on-policy reward (TRL's `reward` includes anchors).
TRAIN_REWARD_KEYS = ("armor/policy_reward_mean", "reward")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 − C(n−c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _prompt_ids(tokenizer, prompts: Sequence) -> list[list[int]]:
    """Token ids of prompts, exactly as GRPOTrainer tokenizes them (chat template for message lists)."""
    if prompts and not isinstance(prompts[0], str):
        out = tokenizer.apply_chat_template(
            conversation=list(prompts), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return [list(ids) for ids in out["input_ids"]]
    return tokenizer(text=list(prompts))["input_ids"]


@torch.no_grad()
def sample_completions(
    model,
    tokenizer,
    prompts: Sequence,
    num_samples: int,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    batch_size: int = 64,
) -> list[list[str]]:
    """``num_samples`` decoded completions per prompt (greedy, once, repeated when ``temperature == 0``).

    ``batch_size`` counts sequences (prompts × samples) per ``generate`` call. The model's train/eval mode is restored.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    greedy = temperature == 0
    per_call = max(1, batch_size // (1 if greedy else num_samples))
    all_ids = _prompt_ids(tokenizer, prompts)
    results: list[list[str]] = []
    try:
        for start in range(0, len(all_ids), per_call):
            chunk = all_ids[start : start + per_call]
            width = max(len(ids) for ids in chunk)
            input_ids = torch.tensor([[pad_id] * (width - len(ids)) + list(ids) for ids in chunk], device=device)
            attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk], device=device)
            sampling = {} if greedy else {"do_sample": True, "temperature": temperature, "top_p": top_p}
            output = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                num_return_sequences=1 if greedy else num_samples,
                pad_token_id=pad_id,
                eos_token_id=tokenizer.eos_token_id,
                **({"do_sample": False} if greedy else sampling),
            )
            texts = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
            step = 1 if greedy else num_samples
            for i in range(len(chunk)):
                group = texts[i * step : (i + 1) * step]
                results.append(group * num_samples if greedy else group)
    finally:
        model.train(was_training)
    return results


# Why a problem could not be judged (the keys of ``evaluate()``'s ``unjudged_reasons``).
UNJUDGED_REASONS = {
    "no_ground_truth": "no ground truth (the answer/solution column is missing or empty)",
    "verifier_cannot_judge": "the verifier returned None for every sample (it cannot judge this ground truth, e.g. "
    "one it cannot parse)",
    "verifier_cannot_judge_some": "the verifier returned None for some of the samples",
}
GROUND_TRUTH_COLUMNS = ("answer", "solution")


class NothingJudgedError(ValueError):
    """The verifier could judge none of the problems, so there is no avg@k or pass@k to report."""


def _unjudged_reason(row: dict, rewards: list) -> str | None:
    unjudged = sum(r is None for r in rewards)
    if not unjudged:
        return None
    if not any(row.get(c) is not None and str(row[c]).strip() for c in GROUND_TRUTH_COLUMNS):
        return "no_ground_truth"
    return "verifier_cannot_judge" if unjudged == len(rewards) else "verifier_cannot_judge_some"


def score_with_reasons(
    completions: list[list[str]], dataset, verifier: Callable, threshold: float = 1.0
) -> tuple[list[int | None], list[str | None]]:
    """Correct samples per problem (the verifier's reward ≥ ``threshold``) and, where a problem cannot be judged
    (any sample scored ``None``), its count is ``None`` and its reason a key of :data:`UNJUDGED_REASONS`."""
    columns = {c: dataset[c] for c in dataset.column_names if c not in ("prompt", "completion")}
    counts: list[int | None] = []
    reasons: list[str | None] = []
    for i, samples in enumerate(completions):
        conversational = not isinstance(dataset[i]["prompt"], str)
        batch = [[{"role": "assistant", "content": s}] if conversational else s for s in samples]
        kwargs = {c: [values[i]] * len(samples) for c, values in columns.items()}
        rewards = verifier(batch, prompts=[dataset[i]["prompt"]] * len(samples), **kwargs)
        reason = _unjudged_reason({c: values[i] for c, values in columns.items()}, rewards)
        reasons.append(reason)
        counts.append(None if reason else sum(float(r) >= threshold for r in rewards))
    return counts, reasons


def score(completions: list[list[str]], dataset, verifier: Callable, threshold: float = 1.0) -> list[int | None]:
    """Correct samples per problem: the verifier's reward ≥ ``threshold``; ``None`` where it cannot judge."""
    return score_with_reasons(completions, dataset, verifier, threshold)[0]


def check_k(k: int, num_samples: int | None, k_name: str = "k", n_name: str = "num_samples") -> int:
    """The number of samples per problem n (``num_samples``, default k); a ValueError unless 1 <= k <= n."""
    if k < 1:
        raise ValueError(f"{k_name} must be >= 1, got {k}.")
    n = k if num_samples is None else num_samples
    if n < k:
        raise ValueError(f"{n_name} ({n}) must be >= {k_name} ({k}): pass@k needs at least k samples per problem.")
    return n


def describe_unjudged(result: dict) -> str:
    """One line on the problems ``evaluate()`` left out and why ('' when none were)."""
    if not result.get("num_unjudged"):
        return ""
    why = "; ".join(f"{count} {UNJUDGED_REASONS.get(reason, reason)}"
                    for reason, count in result["unjudged_reasons"].items())
    return (f"{result['num_unjudged']} of {result['num_total']} problems left out because they could not be judged: "
            f"{why}")


def evaluate(
    model,
    tokenizer,
    dataset,
    verifier: Callable,
    k: int = 8,
    num_samples: int | None = None,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    batch_size: int = 64,
    seed: int | None = None,
) -> dict:
    """avg@n and pass@k of ``model`` on ``dataset`` (columns ``prompt``, ``answer``, ...) with ``verifier``.

    ``num_samples`` (n, default k; must be >= k, checked before generating) completions are drawn per problem;
    avg is their mean accuracy, pass@k the unbiased estimator. Problems the verifier cannot judge (a sample
    scored ``None``) are left out of both and reported: ``num_problems`` counts the judged ones, ``num_total``
    all, ``num_unjudged`` the difference, ``unjudged_reasons`` counts per reason (:data:`UNJUDGED_REASONS`)
    and ``unjudged`` lists each left-out problem (index, reason, ground truth).
    With ``seed`` sampling is reproducible and leaves the global RNG state as it was.
    """
    n = check_k(k, num_samples)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        completions = sample_completions(
            model, tokenizer, dataset["prompt"], n, max_new_tokens, temperature, top_p, batch_size
        )
    counts, reasons = score_with_reasons(completions, dataset, verifier)
    samples = [[completion_text(s) for s in group[:2]] for group in completions[:4]]
    return summarize(counts, reasons, dataset, n, k, samples)


def summarize(counts: list, reasons: list, dataset, n: int, k: int, samples: list | None = None) -> dict:
    """``evaluate()``'s result from the correct counts and unjudged reasons of every problem of ``dataset``."""
    judged = [c for c in counts if c is not None]
    reason_counts = dict(Counter(reason for reason in reasons if reason is not None))
    if not judged:
        why = "; ".join(f"{count} {UNJUDGED_REASONS[reason]}" for reason, count in reason_counts.items())
        raise NothingJudgedError(f"The verifier could judge none of the {len(counts)} problems ({why}). Is the "
                                 "ground-truth column missing, or the verifier the wrong one for this dataset?")
    truth_column = next((c for c in GROUND_TRUTH_COLUMNS if c in dataset.column_names), None)
    return {
        f"avg@{n}": sum(c / n for c in judged) / len(judged),
        f"pass@{k}": sum(pass_at_k(n, c, k) for c in judged) / len(judged),
        "num_problems": len(judged),
        "num_total": len(counts),
        "num_unjudged": len(counts) - len(judged),
        "unjudged_reasons": reason_counts,
        "unjudged": [
            {"index": i, "reason": reason, "ground_truth": dataset[i][truth_column] if truth_column else None}
            for i, reason in enumerate(reasons)
            if reason is not None
        ],
        "num_samples": n,
        "correct_counts": counts,
        "samples": samples or [],
    }


def problem_seed(seed: int, index: int) -> int:
    """The generation seed of problem ``index`` (the first of its call) in the validation seeded ``seed``."""
    return (seed * 1_000_003 + index) % 2**63


def shard(num_problems: int, rank: int, world_size: int) -> tuple[list[int], int]:
    """Problem indices of process ``rank``: a contiguous block, padded by repeating its last (or the last overall)
    problem, so every process holds the same number and makes the same number of generation calls (collective
    under ZeRO-3 and vLLM server mode). Returns the padded indices and how many of them are real."""
    per = -(-num_problems // world_size)
    own = list(range(min(rank * per, num_problems), min((rank + 1) * per, num_problems)))
    filler = own[-1] if own else num_problems - 1
    return own + [filler] * (per - len(own)), len(own)


def _all_gather(value) -> list:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [value]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def evaluate_with_trainer(
    trainer,
    dataset,
    verifier: Callable,
    k: int = 8,
    num_samples: int | None = None,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    batch_size: int = 64,
    seed: int = 0,
) -> dict:
    """:func:`evaluate` through a GRPOTrainer's own generation path (transformers, or vLLM colocate/server when
    ``use_vllm``), sharded over all its processes; every process must call it and gets the same result.

    Each process generates for its block of problems (:func:`shard`) with validation's sampling settings (set for
    the block by :func:`armor_trl.trl_seam.sampling_with`) and scores them with ``verifier``; the correct counts are
    gathered and the estimators computed on every process. Each generation call holds ``batch_size // n`` problems
    (at least one) and is seeded from its first problem (:func:`problem_seed`): with ``batch_size <= n`` (one
    problem per call) the transformers path draws the same completions for a problem whatever the number of
    processes. vLLM samples with its own seeds. The global RNG state and the model's train/eval mode are restored.
    """
    n = check_k(k, num_samples)
    draws = 1 if temperature == 0 else n  # greedy: one completion per problem, repeated n times
    tokenizer = trainer.processing_class
    all_ids = _prompt_ids(tokenizer, dataset["prompt"])
    indices, real = shard(len(all_ids), trainer.accelerator.process_index, trainer.accelerator.num_processes)
    per_call = max(1, batch_size // draws)
    model, was_training = trainer.model, trainer.model.training
    device = trainer.accelerator.device
    completions: list[list[str]] = []
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                trl_seam.sampling_with(trainer, temperature, top_p, max_new_tokens):
            for start in range(0, len(indices), per_call):
                chunk = indices[start : start + per_call]
                torch.manual_seed(problem_seed(seed, chunk[0]))
                ids = trl_seam.generate(trainer, [all_ids[i] for i in chunk for _ in range(draws)], draws)
                texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
                completions += [texts[j * draws : (j + 1) * draws] * (n // draws) for j in range(len(chunk))]
    finally:
        model.train(was_training)
    own = indices[:real]
    counts, reasons = score_with_reasons(completions[:real], dataset.select(own), verifier) if own else ([], [])
    local = [(i, c, r, group[:2]) for i, c, r, group in zip(own, counts, reasons, completions)]
    rows = sorted((row for part in _all_gather(local) for row in part), key=lambda row: row[0])
    if [row[0] for row in rows] != list(range(len(all_ids))):
        raise RuntimeError(f"validation gathered problems {[row[0] for row in rows]}, expected 0..{len(all_ids) - 1}")
    samples = [[completion_text(s) for s in row[3]] for row in rows[:4]]
    return summarize([row[1] for row in rows], [row[2] for row in rows], dataset, n, k, samples)


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
    ):
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.eval_dataset, self.verifier, self.every_steps = eval_dataset, verifier, every_steps
        self.eval_sets = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset}
        for name in self.eval_sets:
            if name is not None and (not isinstance(name, str) or not name or "/" in name):
                raise ValueError(f"eval_dataset names must be non-empty strings without '/', got {name!r}.")
        self.k, self.num_samples = k, check_k(k, num_samples)
        self.generation = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, batch_size=batch_size)
        self.seed, self.jsonl_path, self.run_name, self.on_evaluate = seed, jsonl_path, run_name, on_evaluate
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
                    self.trainer, dataset, self.verifier, self.k, self.num_samples, seed=seed, **self.generation
                )
            else:
                result = evaluate(
                    model, tokenizer, dataset, self.verifier, self.k, self.num_samples, seed=seed, **self.generation
                )
            prefix = "val/" if name is None else f"val/{name}/"
            values[f"{prefix}avg@{self.num_samples}"] = result[f"avg@{self.num_samples}"]
            values[f"{prefix}pass@{self.k}"] = result[f"pass@{self.k}"]
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
        if state.global_step == 0 and self.on_every_process:
            self._record(0, self._evaluate(state, model, processing_class), None, write=state.is_world_process_zero)
        elif state.global_step == 0 and state.is_world_process_zero:
            self._record(0, self._evaluate(state, model, processing_class), None)

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
