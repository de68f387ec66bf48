"""avg@k and pass@k of a model on a verifiable dataset: sampling completions, scoring them with a verifier,
the estimators, and the same through a GRPOTrainer's generation path, sharded over its processes; also the KL between
the policy and the model training started from (:class:`StartKL`). :mod:`armor_trl.callbacks.validation` runs them
during training.

* :func:`pass_at_k` is the unbiased estimator 1 − C(n−c, k)/C(n, k) (Chen et al., 2021) from n samples with c
  correct; avg@k is the mean accuracy over the samples of each problem, averaged over problems.
* :func:`evaluate` samples with ``transformers`` ``generate`` (batched, temperature/top-p configurable) and
  scores with a verifier in TRL's reward signature (:mod:`armor_trl.rewards`); :func:`evaluate_with_trainer` does
  the same through a GRPOTrainer's own generation path (transformers or vLLM), sharded over its processes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from armor_trl.callbacks import tool_evaluation
from armor_trl.integration import trl_generation
from armor_trl.algorithm.mixture import sequence_log_ratios
from armor_trl.rewards import completion_text


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
        # a sample is its text, or (an agent's) the messages TRL's reward functions get
        batch = [[{"role": "assistant", "content": s}] if conversational and isinstance(s, str) else s for s in samples]
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


# How an evaluation samples (the keyword arguments of evaluate() and evaluate_with_trainer(), with their defaults):
# the longest completion, the temperature (0: greedy), top-p, and the sequences (problems × samples) per generation call.
SAMPLING = {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0, "batch_size": 64}


def sampling_settings(**given) -> dict:
    """:data:`SAMPLING` with the ``given`` settings in place of its defaults; a TypeError names any other setting."""
    if unknown := sorted(set(given) - set(SAMPLING)):
        raise TypeError(f"unknown sampling settings {unknown}: the settings are {sorted(SAMPLING)}")
    return {**SAMPLING, **given}


def evaluate(model, tokenizer, dataset, verifier: Callable, k: int = 8, num_samples: int | None = None, *,
             seed: int | None = None, classify: Callable[[str], str] | None = None, **sampling) -> dict:
    """avg@n and pass@k of ``model`` on ``dataset`` (columns ``prompt``, ``answer``, ...) with ``verifier``, sampled
    with ``sampling`` (:data:`SAMPLING`: ``max_new_tokens``, ``temperature``, ``top_p``, ``batch_size``).

    ``num_samples`` (n, default k; must be >= k, checked before generating) completions are drawn per problem;
    avg is their mean accuracy, pass@k the unbiased estimator. Problems the verifier cannot judge (a sample
    scored ``None``) are left out of both and reported: ``num_problems`` counts the judged ones, ``num_total``
    all, ``num_unjudged`` the difference, ``unjudged_reasons`` counts per reason (:data:`UNJUDGED_REASONS`)
    and ``unjudged`` lists each left-out problem (index, reason, ground truth).
    With ``seed`` sampling is reproducible and leaves the global RNG state as it was. With ``classify`` (completion
    text → mode label, e.g. :func:`armor_trl.rewards.modes.classify`), ``mode_shares`` gives each mode's share of all samples.
    """
    n, sampling = check_k(k, num_samples), sampling_settings(**sampling)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        completions = sample_completions(model, tokenizer, dataset["prompt"], n, **sampling)
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
                            per_call: int, temperature: float, top_p: float, max_new_tokens: int,
                            sample_rows: Callable | None = None) -> list[list]:
    """``draws`` completions (token ids) for each prompt ``all_ids[i]``, ``i`` in ``indices``, through the trainer's
    generation path with these sampling settings; each call holds ``per_call`` prompts and is seeded from its first
    (:func:`problem_seed`). The global RNG state and the model's train/eval mode are restored. ``sample_rows(row
    indices, row ids, draws)`` samples a call's rows instead (an agent's trajectories:
    :func:`armor_trl.callbacks.tool_evaluation.trajectory_sampler`)."""
    if sample_rows is None:
        sample_rows = lambda rows, ids, n: trl_generation.generate(trainer, ids, n)  # noqa: E731
    model, was_training = trainer.model, trainer.model.training
    device = trainer.accelerator.device
    groups: list[list[list[int]]] = []
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                trl_generation.sampling_with(trainer, temperature, top_p, max_new_tokens):
            for start in range(0, len(indices), per_call):
                chunk = indices[start : start + per_call]
                torch.manual_seed(problem_seed(seed, chunk[0]))
                rows = [i for i in chunk for _ in range(draws)]
                ids = sample_rows(rows, [all_ids[i] for i in rows], draws)
                groups += [ids[j * draws : (j + 1) * draws] for j in range(len(chunk))]
    finally:
        model.train(was_training)
    return groups


def evaluate_with_trainer(trainer, dataset, verifier: Callable, k: int = 8, num_samples: int | None = None, *,
                          seed: int = 0, classify: Callable[[str], str] | None = None, **sampling) -> dict:
    """:func:`evaluate` through a GRPOTrainer's own generation path (transformers, or vLLM colocate/server when
    ``use_vllm``), sharded over all its processes; every process must call it and gets the same result. ``sampling``:
    :data:`SAMPLING`'s settings, as for :func:`evaluate`.

    Each process generates for its block of problems (:func:`shard`) with validation's sampling settings (set for
    the block by :func:`armor_trl.integration.trl_generation.sampling_with`) and scores them with ``verifier``; the
    correct counts are gathered and the estimators computed on every process. Each generation call holds
    ``batch_size // n`` problems (at least one) and is seeded from its first problem (:func:`problem_seed`): with
    ``batch_size <= n`` (one problem per call) the transformers path draws the same completions for a problem whatever
    the number of processes. vLLM samples with its own seeds. The global RNG state and the model's train/eval mode
    are restored.
    """
    n, sampling = check_k(k, num_samples), sampling_settings(**sampling)
    temperature, batch_size = sampling["temperature"], sampling["batch_size"]
    draws = 1 if temperature == 0 else n  # greedy: one completion per problem, repeated n times
    tokenizer = trainer.processing_class
    all_ids = _prompt_ids(tokenizer, dataset["prompt"])
    indices, real = shard(len(all_ids), trainer.accelerator.process_index, trainer.accelerator.num_processes)
    settings = (max(1, batch_size // draws), temperature, sampling["top_p"], sampling["max_new_tokens"])
    calls = None
    if trl_generation.uses_tools(trainer):  # an agent: each sample runs through TRL's tool loop
        trajectories = sample_ids_with_trainer(trainer, all_ids, indices, draws, seed, *settings,
                                               sample_rows=tool_evaluation.trajectory_sampler(trainer, dataset["prompt"]))
        completions = [[t.messages for t in group] * (n // draws) for group in trajectories]
        texts = [tokenizer.batch_decode([t.completion_ids for t in group], skip_special_tokens=True) * (n // draws)
                 for group in trajectories]  # what a mode classifier reads: the whole trajectory, tool calls included
        calls = [[t.calls for t in group] * (n // draws) for group in trajectories[:real]]
    else:
        groups = sample_ids_with_trainer(trainer, all_ids, indices, draws, seed, *settings)
        completions = texts = [tokenizer.batch_decode(ids, skip_special_tokens=True) * (n // draws) for ids in groups]
    own = indices[:real]
    counts, reasons = score_with_reasons(completions[:real], dataset.select(own), verifier) if own else ([], [])
    local = [(i, c, r, group[:2]) for i, c, r, group in zip(own, counts, reasons, texts)]
    rows = sorted((row for part in _all_gather(local) for row in part), key=lambda row: row[0])
    if [row[0] for row in rows] != list(range(len(all_ids))):
        raise RuntimeError(f"validation gathered problems {[row[0] for row in rows]}, expected 0..{len(all_ids) - 1}")
    samples = [list(row[3]) for row in rows[:4]]
    result = summarize([row[1] for row in rows], [row[2] for row in rows], dataset, n, k, samples)
    if classify is not None:  # collective, like the gather above: every process has the same classify
        modes = sum(_all_gather(mode_counts(texts[:real], classify)), Counter())
        result["mode_shares"] = mode_shares(modes, classify)
    if calls is not None:  # collective: the tool calls of every process's samples
        per_sample = [c for part in _all_gather(calls) for group in part for c in group]
        result["tool_call_rate"] = sum(c > 0 for c in per_sample) / len(per_sample)
        result["tool_calls"] = sum(per_sample) / len(per_sample)
    return result


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

