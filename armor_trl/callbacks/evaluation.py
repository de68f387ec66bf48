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

from armor_trl.integration import trl_seam
from armor_trl.algorithm.mixture import sequence_log_ratios
from armor_trl.rewards import completion_text

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
    classify: Callable[[str], str] | None = None,
) -> dict:
    """avg@n and pass@k of ``model`` on ``dataset`` (columns ``prompt``, ``answer``, ...) with ``verifier``.

    ``num_samples`` (n, default k; must be >= k, checked before generating) completions are drawn per problem;
    avg is their mean accuracy, pass@k the unbiased estimator. Problems the verifier cannot judge (a sample
    scored ``None``) are left out of both and reported: ``num_problems`` counts the judged ones, ``num_total``
    all, ``num_unjudged`` the difference, ``unjudged_reasons`` counts per reason (:data:`UNJUDGED_REASONS`)
    and ``unjudged`` lists each left-out problem (index, reason, ground truth).
    With ``seed`` sampling is reproducible and leaves the global RNG state as it was. With ``classify`` (completion
    text → mode label, e.g. :func:`armor_trl.rewards.modes.classify`), ``mode_shares`` gives each mode's share of all samples.
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
    result = summarize(counts, reasons, dataset, n, k, samples)
    if classify is not None:
        result["mode_shares"] = mode_shares(mode_counts(completions, classify), classify)
    return result


def mode_counts(completions: list[list], classify: Callable[[str], str]) -> Counter:
    """How many of the completions (a list per problem) ``classify`` puts in each mode."""
    return Counter(classify(completion_text(c)) for group in completions for c in group)


def mode_shares(counts: Counter, classify: Callable[[str], str]) -> dict[str, float]:
    """Each mode's share of the counted completions; every label in ``classify.modes`` (if it has one) is listed,
    zeros included, so the logged columns do not come and go."""
    total = sum(counts.values())
    labels = list(getattr(classify, "modes", ())) + sorted(set(counts) - set(getattr(classify, "modes", ())))
    return {label: counts[label] / total if total else 0.0 for label in labels}


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


def sample_ids_with_trainer(trainer, all_ids: list[list[int]], indices: list[int], draws: int, seed: int,
                            per_call: int, temperature: float, top_p: float, max_new_tokens: int) -> list[list[list[int]]]:
    """``draws`` completions (token ids) for each prompt ``all_ids[i]``, ``i`` in ``indices``, through the trainer's
    generation path with these sampling settings; each call holds ``per_call`` prompts and is seeded from its first
    (:func:`problem_seed`). The global RNG state and the model's train/eval mode are restored."""
    model, was_training = trainer.model, trainer.model.training
    device = trainer.accelerator.device
    groups: list[list[list[int]]] = []
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                trl_seam.sampling_with(trainer, temperature, top_p, max_new_tokens):
            for start in range(0, len(indices), per_call):
                chunk = indices[start : start + per_call]
                torch.manual_seed(problem_seed(seed, chunk[0]))
                ids = trl_seam.generate(trainer, [all_ids[i] for i in chunk for _ in range(draws)], draws)
                groups += [ids[j * draws : (j + 1) * draws] for j in range(len(chunk))]
    finally:
        model.train(was_training)
    return groups


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
    classify: Callable[[str], str] | None = None,
) -> dict:
    """:func:`evaluate` through a GRPOTrainer's own generation path (transformers, or vLLM colocate/server when
    ``use_vllm``), sharded over all its processes; every process must call it and gets the same result.

    Each process generates for its block of problems (:func:`shard`) with validation's sampling settings (set for
    the block by :func:`armor_trl.integration.trl_seam.sampling_with`) and scores them with ``verifier``; the correct counts are
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
    groups = sample_ids_with_trainer(trainer, all_ids, indices, draws, seed, max(1, batch_size // draws), temperature,
                                     top_p, max_new_tokens)
    completions = [tokenizer.batch_decode(ids, skip_special_tokens=True) * (n // draws) for ids in groups]
    own = indices[:real]
    counts, reasons = score_with_reasons(completions[:real], dataset.select(own), verifier) if own else ([], [])
    local = [(i, c, r, group[:2]) for i, c, r, group in zip(own, counts, reasons, completions)]
    rows = sorted((row for part in _all_gather(local) for row in part), key=lambda row: row[0])
    if [row[0] for row in rows] != list(range(len(all_ids))):
        raise RuntimeError(f"validation gathered problems {[row[0] for row in rows]}, expected 0..{len(all_ids) - 1}")
    samples = [[completion_text(s) for s in row[3]] for row in rows[:4]]
    result = summarize([row[1] for row in rows], [row[2] for row in rows], dataset, n, k, samples)
    if classify is not None:  # collective, like the gather above: every process has the same classify
        modes = sum(_all_gather(mode_counts(completions[:real], classify)), Counter())
        result["mode_shares"] = mode_shares(modes, classify)
    return result


def _from_main_process(value):
    """``value`` as the main process has it, on every process (a no-op in a single process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


# Sequences per forward pass when scoring KL samples: full-vocabulary logits of long completions are large.
KL_FORWARD_ROWS = 4


@torch.no_grad()
def completion_logps(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], temperature: float,
                     pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (logits / ``temperature``) of each completion after its prompt under ``model``, and the
    completion mask: (rows, longest completion) each. Prompts are left-padded, completions right-padded."""
    device = next(model.parameters()).device
    logps, masks = [], []
    width = max(len(ids) for ids in completion_ids)
    for start in range(0, len(prompt_ids), KL_FORWARD_ROWS):
        prompts, completions = prompt_ids[start : start + KL_FORWARD_ROWS], completion_ids[start : start + KL_FORWARD_ROWS]
        left = max(len(ids) for ids in prompts)
        rows = [[pad_id] * (left - len(p)) + p + c + [pad_id] * (width - len(c)) for p, c in zip(prompts, completions)]
        attention = [[0] * (left - len(p)) + [1] * (len(p) + len(c)) + [0] * (width - len(c))
                     for p, c in zip(prompts, completions)]
        input_ids, attention = torch.tensor(rows, device=device), torch.tensor(attention, device=device)
        positions = (attention.cumsum(1) - 1).clamp(min=0)  # left padding must not shift the prompt's positions
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits
        logits = logits[:, left - 1 : -1].float() / temperature  # the logits that predict each completion token
        logps.append(logits.log_softmax(-1).gather(-1, input_ids[:, left:, None]).squeeze(-1))
        masks.append(attention[:, left:])
    return torch.cat(logps), torch.cat(masks)


class StartKL:
    """KL between the policy and the model training started from, on fixed prompts: reverse KL(π_θ‖π_0) on samples
    of the policy, forward KL(π_0‖π_θ) on samples of the start model, each the Monte-Carlo mean over completions of
    Σ_t log-ratio (:func:`armor_trl.algorithm.mixture.kl_estimate`), with validation's sampling settings (log-probs of the
    temperature-scaled distribution; top-p truncation is not modelled).

    Built at the start of training (π_θ = π_0 then): keeps a copy of the trainable weights (all of them in a full
    fine-tune, the adapter with LoRA) and draws the start model's samples once. π_0's log-probs are computed with
    those weights swapped into the policy for the forward pass and swapped back. Prompts are sharded over processes
    like validation's problems (:func:`shard`); every process must call :meth:`measure`."""

    def __init__(self, trainer, prompts: Sequence, num_samples: int, seed: int, temperature: float, top_p: float,
                 max_new_tokens: int, batch_size: int):
        self.trainer, self.num_samples, self.seed = trainer, num_samples, seed
        self.sampling = dict(per_call=max(1, batch_size // num_samples), temperature=temperature, top_p=top_p,
                             max_new_tokens=max_new_tokens)
        tokenizer = trainer.processing_class
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.all_ids = _prompt_ids(tokenizer, prompts)
        self.indices, self.real = shard(len(self.all_ids), trainer.accelerator.process_index,
                                        trainer.accelerator.num_processes)
        self.start_weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()
                              if p.requires_grad}
        self.start_samples = self._sample(seed)

    def _sample(self, seed: int):
        """(prompt ids, completion ids) of this process's real prompts, ``num_samples`` rows each."""
        groups = sample_ids_with_trainer(self.trainer, self.all_ids, self.indices, self.num_samples, seed,
                                         **self.sampling)
        pairs = [(self.all_ids[i], ids) for i, group in zip(self.indices[: self.real], groups) for ids in group]
        return [p for p, _ in pairs], [c for _, c in pairs]

    def _swap_start_weights(self) -> None:
        """Exchange the policy's trainable weights with the stored start weights (twice: back as they were)."""
        params = dict(self.trainer.model.named_parameters())
        for name, stored in self.start_weights.items():
            self.start_weights[name], params[name].data = params[name].data, stored

    def _log_ratio_sums(self, samples, forward: bool) -> list[float]:
        """[Σ over rows of log π_θ(y)/π_0(y) (``forward``: log π_0(y)/π_θ(y)), rows] of ``samples`` (none on a
        process without prompts)."""
        prompts, completions = samples
        if not completions:
            return [0.0, 0]
        model, was_training = self.trainer.model, self.trainer.model.training
        temperature = self.sampling["temperature"]
        model.eval()
        try:
            policy, mask = completion_logps(model, prompts, completions, temperature, self.pad_id)
            self._swap_start_weights()
            try:
                start, _ = completion_logps(model, prompts, completions, temperature, self.pad_id)
            finally:
                self._swap_start_weights()
        finally:
            model.train(was_training)
        first, second = (start, policy) if forward else (policy, start)
        return [sequence_log_ratios(first, second, mask).sum().item(), len(completions)]

    def measure(self, step: int) -> dict:
        """``kl_reverse_start`` and ``kl_forward_start`` now (policy samples seeded ``seed + step``)."""
        reverse = self._log_ratio_sums(self._sample(self.seed + step), forward=False)
        forward = self._log_ratio_sums(self.start_samples, forward=True)
        totals = [sum(values) for values in zip(*_all_gather(reverse + forward))]
        return {"kl_reverse_start": totals[0] / totals[1], "kl_forward_start": totals[2] / totals[3]}


def pass_curve(counts: list, n: int, k: int) -> dict[int, float]:
    """pass@j of the judged problems for every power of two j <= k (1, 2, 4, ...)."""
    judged = [c for c in counts if c is not None]
    return {j: sum(pass_at_k(n, c, j) for c in judged) / len(judged)
            for j in (2**e for e in range(k.bit_length())) if j <= k}


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
        self.generation = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, batch_size=batch_size)
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
