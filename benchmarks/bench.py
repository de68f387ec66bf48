"""Step time, time split and peak memory of ArmorGRPOTrainer vs trl.GRPOTrainer on one machine, in one run.

Configurations (same tiny model, data, reward, seed, G = num_generations, K = anchor_num_samples, steps):

=================  ===================================================================================
``grpo_b0``        trl.GRPOTrainer, beta = 0 (no reference at all)
``grpo_b004``      trl.GRPOTrainer, beta = 0.04, full fine-tuning: a full frozen reference model  <- baseline
``armor_full``     ArmorGRPOTrainer, full fine-tuning, full frozen reference (the policy's initial weights)
``armor_cache``    as ``armor_full`` with ``anchor_cache=True``
``armor_cache_failures`` as ``armor_cache`` with ``anchor_cache_failures=True`` (failed prompts remembered too)
``grpo_b004_lora`` trl.GRPOTrainer, beta = 0.04, LoRA: reference = the base model (adapter disabled)  <- LoRA baseline
``armor_lora``     ArmorGRPOTrainer, same LoRA: reference = a frozen "ref" adapter
``armor_column``   as ``armor_full`` with ``anchor_source="column"``: anchors pre-generated once by
                   ``armor_trl.pregenerate`` (K = 2 x anchor_num_samples candidates per prompt, before the runs)
``armor_column_lora`` as ``armor_lora`` with the same pre-generated column anchors
=================  ===================================================================================

Each (configuration, repetition) trains in its own process, forked from a forkserver that imported torch,
transformers, TRL and PEFT once, so ``ru_maxrss`` is per configuration and start-up stays cheap. Repetitions run
round-robin with a rotated order, so machine noise shows in the spread across repetitions.

The time split comes from wrapping methods on the trainer instance (and the ``armor_trl.trl_seam`` helpers the
trainer calls), inside the worker process only:

* ``policy_gen``   ``_generate_single_turn`` (instance) minus the ARMOR anchor sampling inside it
* ``anchor_gen``   ``trl_seam.generate`` called from ``_sample_anchors`` (reference candidates, K per group)
* ``anchor_score`` ``trl_seam.score_quietly`` (rewards of the candidates) + decode/cache bookkeeping
* ``ref_fwd``      reference log-probs: ``trl_seam.per_token_logps`` (ARMOR) or, for GRPO with beta > 0,
                   ``_get_per_token_logps_and_entropies`` called during ``_generate_and_score_completions``
* ``reward``       ``_calculate_rewards`` (instance) for the training rows
* ``gen_other``    rest of ``_generate_and_score_completions`` (tokenize, decode, advantages, metrics)
* ``loss_bwd``     ``training_step`` minus ``_prepare_inputs``: forward with grad, loss, backward
* ``other``        rest of the optimizer step: optimizer, scheduler, callbacks (reference resets), logging

Usage: ``python benchmarks/bench.py`` (``make bench``, a few minutes on 2 cores); ``--smoke`` for a seconds-long
structural run; ``--preset memory`` for peak RSS with a 19M-parameter model (weights visible above the runtime's
~320 MB); ``--configs grpo_b004,armor_cache`` runs a subset.
Writes ``<out>/bench.json`` (settings, per-run per-step raw timings, summary, targets) and ``<out>/bench.md``
(the printed tables), default ``results/bench``; worker logs go to ``<out>/logs``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

for _name, _value in (
    ("HF_HUB_OFFLINE", "1"),
    ("HF_DATASETS_OFFLINE", "1"),
    ("HF_HUB_DISABLE_TELEMETRY", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
    ("TRANSFORMERS_VERBOSITY", "error"),
):
    os.environ.setdefault(_name, _value)

BASELINE = "grpo_b004"
LORA_BASELINE = "grpo_b004_lora"
CONFIGS = {
    # name: (trainer, beta, lora, anchor_cache, description)
    "grpo_b0": ("grpo", 0.0, False, False, "TRL GRPO, beta=0, full FT"),
    "grpo_b004": ("grpo", 0.04, False, False, "TRL GRPO, beta=0.04, full FT, full ref model"),
    "armor_full": ("armor", 0.0, False, False, "ARMOR, full FT, full ref model"),
    "armor_cache": ("armor", 0.0, False, True, "ARMOR, full FT, full ref, anchor_cache=True"),
    "grpo_b004_lora": ("grpo", 0.04, True, False, "TRL GRPO, beta=0.04, LoRA, ref = adapter disabled"),
    "armor_lora": ("armor", 0.0, True, False, "ARMOR, LoRA, ref = frozen 'ref' adapter"),
    "armor_cache_failures": ("armor", 0.0, False, True, "ARMOR, anchor_cache + anchor_cache_failures=True"),
    "grpo_dynamic": ("dapo", 0.0, False, False, "GRPO beta=0 + dynamic_sampling (ArmorGRPOTrainer, ARMOR off), 0/1 reward"),
    "armor_dynamic": ("armor", 0.0, False, False, "ARMOR + dynamic_sampling (refill up to 10 rounds), 0/1 reward"),
    "armor_column": ("armor", 0.0, False, False, "ARMOR, full FT, anchor_source='column' (pre-generated anchors)"),
    "armor_column_lora": ("armor", 0.0, True, False, "ARMOR, LoRA, anchor_source='column' (pre-generated anchors)"),
}
# Configs trained on anchors pre-generated by `armor-trl anchors` (armor_trl.pregenerate), once, before the runs.
COLUMN = ("armor_column", "armor_column_lora")
# Configs trained with DAPO's dynamic sampling. Their reward is the digit share thresholded to 0/1, so that groups can
# tie (all right / all wrong) as with a verifier; the refill cost shows as armor/generation_rounds per step.
DYNAMIC = ("grpo_dynamic", "armor_dynamic")
DEFAULT_CONFIGS = [
    "grpo_b0", "grpo_b004", "armor_full", "armor_cache", "armor_cache_failures", "grpo_b004_lora", "armor_lora",
    "grpo_dynamic", "armor_dynamic", "armor_column", "armor_column_lora",
]
# Each row: the ratio it checks (numerator config, denominator config, quantity), its bound.
TARGETS = [
    ("step time armor_full / grpo_b004 <= 1.25", "armor_full", BASELINE, "step", 1.25),
    ("step time armor_cache / grpo_b004 <= 1.10", "armor_cache", BASELINE, "step", 1.10),
    ("step time armor_cache_failures / grpo_b004 <= 1.10", "armor_cache_failures", BASELINE, "step", 1.10),
    ("peak RSS armor_full / grpo_b004 <= 1.05", "armor_full", BASELINE, "rss", 1.05),
    ("LoRA reset / armor_lora step < 0.01", "armor_lora", "armor_lora", "lora_reset", 0.01),
    ("step time armor_column / grpo_b004 <= 1.05", "armor_column", BASELINE, "step", 1.05),
    ("step time armor_column_lora / grpo_b004_lora <= 1.05", "armor_column_lora", LORA_BASELINE, "step", 1.05),
    ("peak RSS armor_column / grpo_b004 <= 1.05", "armor_column", BASELINE, "rss", 1.05),
]
PRELOAD = [
    "torch", "transformers", "transformers.models.llama.modeling_llama", "datasets", "peft", "trl",
    "trl.trainer.grpo_trainer", "armor_trl", "armor_trl.trainer",
]
PARTS = ("policy_gen", "anchor_gen", "anchor_score", "ref_fwd", "reward", "gen_other", "loss_bwd", "other")

PRESETS = {
    # the measurement: generation dominates (long completions, 4 layers), `make bench` fits in a few minutes
    "full": dict(hidden=128, layers=3, completion=48, batch=32, steps=7, warmup=2, reps=3, prompts=8),
    # structure only (tests): seconds per run
    "smoke": dict(hidden=32, layers=1, completion=8, batch=16, steps=2, warmup=1, reps=1, prompts=4),
    # peak RSS where the weights are not lost in the runtime's ~320 MB (19M parameters, 76 MB per fp32 copy);
    # step times are measured too but with one warm-up step and one repetition. About 3 minutes on 2 cores.
    "memory": dict(hidden=512, layers=8, completion=48, batch=32, steps=3, warmup=1, reps=1, prompts=8),
}


# ---------------------------------------------------------------------------------------------------------------
# Task and reward
# ---------------------------------------------------------------------------------------------------------------
def make_prompts(n: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def digit_reward(completions, **kwargs):
    """Graded arithmetic-style reward: the share of digits in the completion (an answer should be a number).

    With ``anchor_reward_threshold`` calibrated on the initial model (see ``build_and_calibrate``), a realistic share of
    reference candidates counts as verified, and rewards within a group almost never tie.
    """
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


# ---------------------------------------------------------------------------------------------------------------
# Worker side (forked processes)
# ---------------------------------------------------------------------------------------------------------------
def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _quiet(log_path: str | None, threads: int):
    import torch
    import transformers

    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("accelerate").setLevel(logging.ERROR)


def build_and_calibrate(settings: dict) -> dict:
    """Worker task: write the tiny model and pick ``anchor_reward_threshold`` on the initial model.

    The threshold is chosen so that about ``target_found`` of the groups have at least one of K reference
    candidates at or above it (sampled as TRL samples: temperature 1, no top-k/top-p).
    """
    _quiet(settings.get("log"), settings["threads"])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from armor_trl.tiny import build_tiny_model

    path = build_tiny_model(
        settings["model_dir"], hidden_size=settings["hidden"], num_layers=settings["layers"], seed=settings["seed"]
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    k, draws = settings["k"], settings["calibration_draws"]
    prompts = [row["prompt"] for row in make_prompts(settings["prompts"], settings["seed"])]
    group_max = []
    torch.manual_seed(settings["seed"] + 1)
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]] * (k * draws))
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=settings["completion"], pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        texts = tokenizer.batch_decode(out[:, ids.size(1):], skip_special_tokens=True)
        rewards = digit_reward(texts)
        group_max += [max(rewards[d * k : (d + 1) * k]) for d in range(draws)]
    group_max.sort()
    # threshold = the (1 - target_found) quantile of the per-group best candidate reward
    index = min(len(group_max) - 1, max(0, int(round((1 - settings["target_found"]) * len(group_max)))))
    threshold = group_max[index]
    found = sum(v >= threshold for v in group_max) / len(group_max)
    return {"model_path": path, "threshold": threshold, "calibration_found_frac": found, "groups": len(group_max)}


def pregenerate_anchors(settings: dict) -> dict:
    """Worker task: ``armor-trl anchors``' code on the bench prompts (the bulk pass column configs train on)."""
    _quiet(settings.get("log"), settings["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer

    from armor_trl.pregenerate import AnchorSettings, TransformersSampler, finalize, generate_shards, prepare_output

    anchor_settings = AnchorSettings(
        reference=settings["model_path"], num_candidates=2 * settings["k"], max_anchors_per_prompt=settings["k"],
        threshold=settings["threshold"], reward_funcs=["digit_reward"], max_completion_length=settings["completion"],
        seed=settings["seed"], shard_size=settings["prompts"],
    )
    tokenizer = AutoTokenizer.from_pretrained(settings["model_path"])
    dataset = Dataset.from_list(make_prompts(settings["prompts"], settings["seed"]))
    prepare_output(settings["output"], anchor_settings, is_main=True)
    sampler = TransformersSampler(settings["model_path"], anchor_settings, tokenizer, "cpu", batch_size=settings["prompts"])
    counts = generate_shards(dataset, anchor_settings, [digit_reward], tokenizer, sampler, settings["output"], progress=False)
    metadata = finalize(settings["output"], anchor_settings, len(dataset), counts["prompts"] / counts["seconds"])
    return {"path": settings["output"], "seconds": counts["seconds"], "prompts": counts["prompts"],
            "prompts_per_s": metadata["prompts_per_second"], "share_with_anchor": metadata["share_with_anchor"],
            "num_candidates": anchor_settings.num_candidates}


def anchor_break_even(summary: dict, pregeneration: dict | None, batch: int, g: int, prompts: int) -> dict | None:
    """After how many epochs the bulk pass costs less than armor_full's online anchor sampling."""
    if pregeneration is None or "armor_full" not in summary:
        return None
    split = summary["armor_full"]["split_s"]
    online_per_step = split["anchor_gen"] + split["anchor_score"]
    steps_per_epoch = prompts / (batch // g)
    per_epoch = online_per_step * steps_per_epoch
    return {"bulk_s": pregeneration["seconds"], "online_anchor_s_per_step": online_per_step,
            "online_anchor_s_per_epoch": per_epoch,
            "break_even_epochs": pregeneration["seconds"] / per_epoch if per_epoch else None}


class _Timers:
    def __init__(self):
        from collections import defaultdict

        self.current = defaultdict(float)  # wall seconds per key, this optimizer step
        self.cpu = defaultdict(float)  # process CPU seconds per key, this optimizer step
        self.calls = defaultdict(int)
        self.flags = set()

    def wrap(self, fn, key, flag=None, only_when=None, key_fn=None):
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            name = key_fn() if key_fn else key
            if (only_when is not None and only_when not in self.flags) or name is None:
                return fn(*args, **kwargs)
            if flag:
                self.flags.add(flag)
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - start
                self.cpu[name] += time.process_time() - cpu_start
                self.calls[name] += 1
                if flag:
                    self.flags.discard(flag)

        return wrapper


def _instrument(trainer, timers: _Timers, is_armor: bool):
    """Wrap the trainer instance's methods (and the seam helpers ARMOR calls) with timers. Worker process only."""
    from transformers import TrainerCallback

    t = trainer
    t._generate_and_score_completions = timers.wrap(t._generate_and_score_completions, "gs_total", flag="gen")
    t._generate_single_turn = timers.wrap(t._generate_single_turn, "gen_single_turn")
    t._calculate_rewards = timers.wrap(t._calculate_rewards, "rewards")
    t._prepare_inputs = timers.wrap(t._prepare_inputs, "prepare_inputs")
    t.training_step = timers.wrap(t.training_step, "training_step")
    # GRPO with beta > 0: the only per-token-logps forward during generation is the reference's (old log-probs are
    # not computed: steps_per_generation * num_iterations divides gradient_accumulation_steps).
    t._get_per_token_logps_and_entropies = timers.wrap(
        t._get_per_token_logps_and_entropies, None, key_fn=lambda: "logps_in_gen" if "gen" in timers.flags else None
    )
    if is_armor:
        from armor_trl import trl_seam

        t._sample_anchors = timers.wrap(t._sample_anchors, "sample_anchors", flag="anchors")
        trl_seam.generate = timers.wrap(trl_seam.generate, "anchor_generate", only_when="anchors")
        trl_seam.score_quietly = timers.wrap(trl_seam.score_quietly, "anchor_score")
        trl_seam.per_token_logps = timers.wrap(trl_seam.per_token_logps, "ref_fwd_armor")

    steps = []

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.last = self.last_cpu = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            now, now_cpu = time.perf_counter(), time.process_time()
            steps.append({
                "step": state.global_step, "raw": {"step_s": now - self.last, **timers.current},
                "raw_cpu": {"step_s": now_cpu - self.last_cpu, **timers.cpu},
            })
            timers.current.clear()
            timers.cpu.clear()
            self.last, self.last_cpu = now, now_cpu

    t.add_callback(StepTimer())  # last callback: its on_step_end runs after ARMOR's reference reset
    return steps


def _split(raw: dict) -> dict:
    """Derived time split (seconds) of one optimizer step from the raw timer totals."""
    g = raw.get
    anchors = g("sample_anchors", 0.0)
    ref = g("ref_fwd_armor", 0.0) + g("logps_in_gen", 0.0)
    split = {
        "policy_gen": g("gen_single_turn", 0.0) - anchors,
        "anchor_gen": g("anchor_generate", 0.0),
        "anchor_score": anchors - g("anchor_generate", 0.0),
        "ref_fwd": ref,
        "reward": g("rewards", 0.0),
        "gen_other": g("gs_total", 0.0) - g("gen_single_turn", 0.0) - g("rewards", 0.0) - ref,
        "loss_bwd": g("training_step", 0.0) - g("prepare_inputs", 0.0),
    }
    split["other"] = raw["step_s"] - sum(split.values())
    return split


def _whatif_generate_rows(trainer, rows_list: list[int], repeats: int) -> dict:
    """Generate time vs batch rows (full length) with the policy: is generation latency- or throughput-bound here?"""
    import torch

    model = trainer._unwrapped_policy()
    tok = trainer.processing_class
    prompt = tok("12+34=")["input_ids"]
    length = trainer.max_completion_length
    was_training = model.training
    model.eval()
    times = {}
    with torch.no_grad():
        for rows in rows_list:
            ids = torch.tensor([prompt] * rows)
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                    top_p=1.0, max_new_tokens=length, min_new_tokens=length, pad_token_id=tok.pad_token_id,
                )
                samples.append(time.perf_counter() - start)
            times[str(rows)] = statistics.median(samples)
    model.train(was_training)
    return times


def _whatif_merged_generation(trainer, policy_rows: int, anchor_rows: int, repeats: int) -> dict:
    """LoRA only: two generate calls (policy rows, then reference rows) vs ONE mixed-adapter call (PEFT adapter_names).

    Quantifies the fix suggested for the anchor generation cost: the LoRA reference is a second adapter of the same
    model, so candidates can be sampled in the same batch as the on-policy completions.
    """
    import torch

    from armor_trl.reference import REF_ADAPTER

    model = trainer._unwrapped_policy()
    tok = trainer.processing_class
    prompt = tok("12+34=")["input_ids"]
    gen = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=trainer.max_completion_length,
        min_new_tokens=trainer.max_completion_length, pad_token_id=tok.pad_token_id,
    )
    trained = trainer.reference.trained_adapter
    was_training = model.training
    model.eval()
    ids_p = torch.tensor([prompt] * policy_rows)
    ids_a = torch.tensor([prompt] * anchor_rows)
    ids_m = torch.tensor([prompt] * (policy_rows + anchor_rows))
    names = [trained] * policy_rows + [REF_ADAPTER] * anchor_rows
    separate, merged = [], []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(input_ids=ids_p, attention_mask=torch.ones_like(ids_p), **gen)
            model.set_adapter(REF_ADAPTER)
            model.generate(input_ids=ids_a, attention_mask=torch.ones_like(ids_a), **gen)
            model.set_adapter(trained)
            separate.append(time.perf_counter() - start)
            start = time.perf_counter()
            model.generate(input_ids=ids_m, attention_mask=torch.ones_like(ids_m), adapter_names=names, **gen)
            merged.append(time.perf_counter() - start)
    for name, param in model.named_parameters():  # set_adapter may flip requires_grad; restore ARMOR's state
        param.requires_grad_(f".{trained}." in name)
    model.train(was_training)
    return {
        "separate_s": statistics.median(separate),
        "merged_s": statistics.median(merged),
        "rows": [policy_rows, anchor_rows],
    }


def run_config(task: dict) -> dict:
    """Worker task: train one configuration for ``steps`` optimizer steps; return timings, split, RSS, metrics."""
    _quiet(task.get("log"), task["threads"])
    rss_start = _rss_mb()
    peak_start = _peak_rss_mb()
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from armor_trl import ArmorConfig, ArmorGRPOTrainer

    kind, beta, lora, cache, _ = CONFIGS[task["config"]]
    is_armor = kind == "armor"
    torch.manual_seed(task["seed"])
    common = dict(
        output_dir=task["output_dir"],
        per_device_train_batch_size=task["batch"],
        num_generations=task["g"],
        max_completion_length=task["completion"],
        max_steps=task["steps"],
        learning_rate=task["lr_lora"] if lora else task["lr"],
        beta=beta,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=task["seed"],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    reward = digit_reward
    if task["config"] in DYNAMIC:
        threshold = task["threshold"]
        reward = lambda completions, **kw: [float(r >= threshold) for r in digit_reward(completions)]  # noqa: E731
        reward.__name__ = "digit_reward_01"
    if is_armor or kind == "dapo":
        args = ArmorConfig(
            **common,
            anchor_num_samples=task["k"],
            anchor_reward_threshold=task["threshold"],
            anchor_cache=cache,
            anchor_cache_failures=task["config"] == "armor_cache_failures",
            dynamic_sampling=task["config"] in DYNAMIC,
            use_anchors=is_armor,
            use_mixed_ratio=is_armor,
            anchor_source="column" if task["config"] in COLUMN else "reference",
        )
    else:
        args = GRPOConfig(**common)
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
    tokenizer = AutoTokenizer.from_pretrained(task["model_path"])
    dataset = Dataset.from_list(make_prompts(task["prompts"], task["seed"]))
    if task["config"] in COLUMN:
        from armor_trl.pregenerate import attach_anchors

        dataset = attach_anchors(dataset, task["anchors_path"])
    cls = ArmorGRPOTrainer if is_armor or kind == "dapo" else GRPOTrainer
    build_start = time.perf_counter()
    trainer = cls(
        model=task["model_path"], reward_funcs=reward, args=args, train_dataset=dataset,
        processing_class=tokenizer, peft_config=peft_config,
    )
    build_s = time.perf_counter() - build_start
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    timers = _Timers()
    steps = _instrument(trainer, timers, is_armor)
    rss_before_train = _rss_mb()
    train_start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - train_start
    peak = _peak_rss_mb()

    result = {
        "config": task["config"],
        "rep": task["rep"],
        "order": task["order"],
        "build_s": build_s,
        "train_s": train_s,
        "rss_start_mb": rss_start,
        "peak_rss_start_mb": peak_start,
        "rss_before_train_mb": rss_before_train,
        "peak_rss_mb": peak,
        "steps": [
            {"step": s["step"], "step_s": s["raw"]["step_s"], "cpu_s": s["raw_cpu"]["step_s"], "split": _split(s["raw"]),
             "split_cpu": _split(s["raw_cpu"]), "raw": s["raw"]}
            for s in steps
        ],
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "total_params": sum(p.numel() for p in trainer.model.parameters()),
        "calls": dict(timers.calls),
    }
    history = trainer.state.log_history
    for key in (
        "armor/anchor_found_frac", "armor/anchor_cache_hit_frac", "armor/candidates_verified_frac",
        "completions/mean_length", "reward", "armor/policy_reward_mean", "armor/generation_rounds",
        "armor/groups_kept_frac",
    ):
        values = [h[key] for h in history if key in h]
        if values:
            result.setdefault("metrics", {})[key] = values

    # Cost of a reference reset (pi_ref <- pi_theta), measured after training on the same instance.
    if is_armor and trainer.reference is not None:
        policy = trainer._unwrapped_policy()
        times = []
        for i in range(task["reset_repeats"]):
            start = time.perf_counter()
            trainer.reference.reset(policy, trainer.state.global_step + i)
            times.append(time.perf_counter() - start)
        result["reset_s"] = times
        result["reset_kind"] = trainer.reference.kind
        result["reset_params"] = sum(p.numel() for p in trainer.reference.parameters_of(policy))
        if task["config"] == "armor_full" and task["whatif_repeats"]:
            groups = task["batch"] // task["g"]
            g, k = task["g"], task["k"]
            result["whatif_generate_rows"] = _whatif_generate_rows(
                trainer, [groups * k, groups * (g - 1), groups * g, groups * (g - 1 + k)], task["whatif_repeats"]
            )
        if lora and task["whatif_repeats"]:
            groups = task["batch"] // task["g"]
            result["whatif_merged_generation"] = _whatif_merged_generation(
                trainer, groups * (task["g"] - 1), groups * task["k"], task["whatif_repeats"]
            )
    return result


# ---------------------------------------------------------------------------------------------------------------
# Parent side: schedule, aggregate, report
# ---------------------------------------------------------------------------------------------------------------
def _load() -> list[float]:
    return list(os.getloadavg())


def _stats(values: list[float]) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "n": 0}
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {
        "median": statistics.median(values), "min": values[0], "max": values[-1], "q1": q[0], "q3": q[2],
        "n": len(values),
    }


def summarize(runs: list[dict], warmup: int) -> dict:
    by_config: dict[str, list[dict]] = {}
    for run in runs:
        by_config.setdefault(run["config"], []).append(run)
    summary = {}
    for name, config_runs in by_config.items():
        per_run_step, per_run_cpu, pooled = [], [], []
        per_run_split, per_run_split_cpu = {p: [] for p in PARTS}, {p: [] for p in PARTS}
        no_candidate_steps, measured_count = [], 0
        for run in config_runs:
            measured = run["steps"][warmup:] or run["steps"][-1:]
            measured_count += len(measured)
            step_times = [s["step_s"] for s in measured]
            pooled += step_times
            run["median_step_s"] = statistics.median(step_times)
            run["median_cpu_s"] = statistics.median(s["cpu_s"] for s in measured)
            per_run_step.append(run["median_step_s"])
            per_run_cpu.append(run["median_cpu_s"])
            for part in PARTS:
                per_run_split[part].append(statistics.median(s["split"][part] for s in measured))
                per_run_split_cpu[part].append(statistics.median(s["split_cpu"][part] for s in measured))
            if CONFIGS[name][0] == "armor":
                # steps in which every group's anchor came from the cache: no reference generate call at all
                no_candidate_steps += [s["step_s"] for s in measured if s["raw"].get("anchor_generate", 0.0) == 0.0]
        entry = {
            "description": CONFIGS[name][4],
            "measured_steps": measured_count,
            "step_s": _stats(per_run_step),
            "cpu_s": _stats(per_run_cpu),
            "step_s_pooled": _stats(pooled),
            # mean over every measured step: the throughput figure (cache steps are bimodal: with/without a call)
            "step_s_mean": statistics.mean(pooled),
            "cpu_s_mean": statistics.mean(s["cpu_s"] for r in config_runs for s in (r["steps"][warmup:] or r["steps"][-1:])),
            "split_s": {p: statistics.median(v) for p, v in per_run_split.items()},
            "split_cpu_s": {p: statistics.median(v) for p, v in per_run_split_cpu.items()},
            "peak_rss_mb": _stats([r["peak_rss_mb"] for r in config_runs]),
            "rss_growth_mb": _stats([r["peak_rss_mb"] - r["rss_start_mb"] for r in config_runs]),
            "trainable_params": config_runs[0]["trainable_params"],
        }
        step_median = entry["step_s"]["median"]
        entry["split_share"] = {p: v / step_median for p, v in entry["split_s"].items()} if step_median else {}
        if CONFIGS[name][0] == "armor":
            entry["steps_without_candidate_generation"] = {
                "share": len(no_candidate_steps) / measured_count,
                "median_step_s": statistics.median(no_candidate_steps) if no_candidate_steps else None,
            }
        resets = [t for r in config_runs for t in r.get("reset_s", [])]
        if resets:
            entry["reset_s"] = _stats(resets)
            entry["reset_over_step"] = entry["reset_s"]["median"] / step_median
            entry["reset_kind"] = config_runs[0]["reset_kind"]
            entry["reset_params"] = config_runs[0]["reset_params"]
        for key in (
            "armor/anchor_found_frac", "armor/anchor_cache_hit_frac", "completions/mean_length",
            "armor/generation_rounds", "armor/groups_kept_frac",
        ):
            values = [v for r in config_runs for v in r.get("metrics", {}).get(key, [])[warmup:]]
            if values:
                entry.setdefault("metrics", {})[key] = statistics.mean(values)
        whatif = [r["whatif_merged_generation"] for r in config_runs if "whatif_merged_generation" in r]
        if whatif:
            entry["whatif_merged_generation"] = {
                "separate_s": statistics.median(w["separate_s"] for w in whatif),
                "merged_s": statistics.median(w["merged_s"] for w in whatif),
                "rows": whatif[0]["rows"],
            }
        rows = [r["whatif_generate_rows"] for r in config_runs if "whatif_generate_rows" in r]
        if rows:
            entry["whatif_generate_rows"] = {n: statistics.median(r[n] for r in rows) for n in rows[0]}
        summary[name] = entry

    # Ratios to the baselines: ratio of medians, and the spread of per-repetition (paired, same round) ratios.
    def paired(name, base, key):
        ratios = []
        for run in by_config.get(name, []):
            partner = [r for r in by_config.get(base, []) if r["rep"] == run["rep"]]
            if partner:
                ratios.append(run[key] / partner[0][key])
        return _stats(ratios)

    for name, entry in summary.items():
        for base, label in ((BASELINE, "vs_grpo_b004"), (LORA_BASELINE, "vs_grpo_b004_lora")):
            if base not in summary:
                continue
            entry[label] = {
                "step": entry["step_s"]["median"] / summary[base]["step_s"]["median"],
                "step_paired": paired(name, base, "median_step_s"),
                "cpu": entry["cpu_s"]["median"] / summary[base]["cpu_s"]["median"],
                "step_mean": entry["step_s_mean"] / summary[base]["step_s_mean"],
                "cpu_mean": entry["cpu_s_mean"] / summary[base]["cpu_s_mean"],
                "cpu_paired": paired(name, base, "median_cpu_s"),
                "rss": entry["peak_rss_mb"]["median"] / summary[base]["peak_rss_mb"]["median"],
                "rss_paired": paired(name, base, "peak_rss_mb"),
                "rss_growth": entry["rss_growth_mb"]["median"] / summary[base]["rss_growth_mb"]["median"],
            }
    return summary


def check_targets(summary: dict) -> list[dict]:
    rows = []
    for label, name, base, quantity, bound in TARGETS:
        if name not in summary or base not in summary:
            continue
        cpu = mean = None
        if quantity == "lora_reset":
            value = summary[name].get("reset_over_step")
            spread = None
        else:
            ratios = summary[name]["vs_grpo_b004" if base == BASELINE else "vs_grpo_b004_lora"]
            value = ratios[quantity]
            spread = [ratios[quantity + "_paired"]["min"], ratios[quantity + "_paired"]["max"]]
            cpu = ratios["cpu"] if quantity == "step" else None
            mean = ratios["step_mean"] if quantity == "step" else None
        rows.append({
            "target": label, "bound": bound, "measured": value, "paired_min_max": spread, "measured_cpu_time": cpu,
            "measured_mean_step": None if quantity != "step" else mean,
            "met": None if value is None else bool(value <= bound if quantity != "lora_reset" else value < bound),
        })
    return rows


def _fmt(value, digits=2, suffix=""):
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def format_report(result: dict) -> str:
    meta, summary = result["meta"], result["summary"]
    load = lambda xs: "/".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = [
        f"# ARMOR vs GRPO benchmark ({meta['mode']})",
        "",
        f"Tiny Llama hidden={meta['hidden']} layers={meta['layers']}, G={meta['g']}, K={meta['k']}, "
        f"{meta['batch']} rows/step ({meta['batch'] // meta['g']} groups), {meta['prompts']} distinct prompts, "
        f"max_completion_length={meta['completion']}, {meta['steps']} steps per run ({meta['warmup']} warm-up), "
        f"{meta['reps']} repetition(s) round-robin, one process per run, torch threads={meta['threads']}, "
        f"anchor_reward_threshold={meta['threshold']:.3f} (calibrated: {meta['calibration_found_frac']:.2f} of groups "
        f"find an anchor at start). Load average (1/5/15 min) before {load(meta['load_before'])}, after "
        f"{load(meta['load_after'])}, on {meta['cpus']} CPUs; wall {meta['wall_s']:.0f} s.",
        "",
        "Step time: median over repetitions of each run's median s/step after warm-up [min–max over repetitions]; "
        "all steps: median [IQR] of every measured step of every repetition; ratios: ratio of medians (min–max of "
        "the per-repetition ratios, paired by round). CPU: ratio of process CPU time per step (less sensitive to load).",
        "",
        "| config | s/step [min–max] | all steps: median [IQR], mean | × grpo_b004 (paired) | CPU × grpo_b004 | "
        "× grpo_b004_lora | peak RSS MB | × RSS | RSS growth MB | anchors found | cache hits | reset (share of step) | "
        "generation rounds/step (dynamic sampling) | groups kept |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in summary.items():
        s, v, vl, m = e["step_s"], e.get("vs_grpo_b004", {}), e.get("vs_grpo_b004_lora", {}), e.get("metrics", {})
        pool = e["step_s_pooled"]
        sp = v.get("step_paired", {})
        reset = f"{e['reset_s']['median'] * 1e3:.2f} ms ({e['reset_over_step'] * 100:.3f}%)" if "reset_s" in e else "—"
        lines.append(
            f"| {name} | {_fmt(s['median'], 3)} [{_fmt(s['min'], 3)}–{_fmt(s['max'], 3)}] | "
            f"{_fmt(pool['median'], 3)} [{_fmt(pool['q1'], 3)}–{_fmt(pool['q3'], 3)}], {_fmt(e['step_s_mean'], 3)} | "
            f"{_fmt(v.get('step'))} ({_fmt(sp.get('min'))}–{_fmt(sp.get('max'))}) | {_fmt(v.get('cpu'))} | "
            f"{_fmt(vl.get('step'))} | {_fmt(e['peak_rss_mb']['median'], 0)} | {_fmt(v.get('rss'), 3)} | "
            f"{_fmt(e['rss_growth_mb']['median'], 0)} | {_fmt(m.get('armor/anchor_found_frac'))} | "
            f"{_fmt(m.get('armor/anchor_cache_hit_frac'))} | {reset} | {_fmt(m.get('armor/generation_rounds'))} | "
            f"{_fmt(m.get('armor/groups_kept_frac'))} |"
        )
    pre, even = meta.get("pregeneration"), meta.get("anchor_break_even")
    if pre:
        lines += ["", f"Column anchors (`armor-trl anchors` code, before the runs): {pre['prompts']} prompts x "
                  f"{pre['num_candidates']} candidates in {pre['seconds']:.2f} s = {pre['prompts_per_s']:.1f} prompts/s, "
                  f"{pre['share_with_anchor']:.0%} of prompts with an anchor."]
    if even and even["break_even_epochs"] is not None:
        lines.append(f"armor_full samples anchors online for {even['online_anchor_s_per_step']:.3f} s/step = "
                     f"{even['online_anchor_s_per_epoch']:.2f} s per epoch over the prompts: the bulk pass pays for "
                     f"itself after {even['break_even_epochs']:.2f} epoch(s).")
    lines += [
        "",
        "Time split, median seconds per step (share of the median step):",
        "",
        "| config | " + " | ".join(PARTS) + " |",
        "|---|" + "---|" * len(PARTS),
    ]
    for name, e in summary.items():
        cells = [f"{e['split_s'][p]:.3f} ({e['split_share'].get(p, 0) * 100:.0f}%)" for p in PARTS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Targets (tiny model, G={meta['g']}, K={meta['k']}):",
        "",
        "| target | measured (ratio of medians) | paired min–max | CPU-time ratio | ratio of mean steps | met |",
        "|---|---|---|---|---|---|",
    ]
    for t in result["targets"]:
        spread = "—" if not t["paired_min_max"] else f"{_fmt(t['paired_min_max'][0], 3)}–{_fmt(t['paired_min_max'][1], 3)}"
        met = {True: "yes", False: "**no**", None: "—"}[t["met"]]
        lines.append(
            f"| {t['target']} | {_fmt(t['measured'], 4)} | {spread} | {_fmt(t['measured_cpu_time'], 3)} | "
            f"{_fmt(t.get('measured_mean_step'), 3)} | {met} |"
        )
    notes = []
    for name, e in summary.items():
        skip = e.get("steps_without_candidate_generation")
        if skip and e.get("metrics", {}).get("armor/anchor_cache_hit_frac") is not None:
            notes.append(
                f"- {name}: {skip['share'] * 100:.0f}% of measured steps needed no reference generate call (every group was a "
                f"cache hit{' or a remembered failure' if name == 'armor_cache_failures' else ''}); their median step {_fmt(skip['median_step_s'], 3)} s"
                + (f" = {skip['median_step_s'] / summary[BASELINE]['step_s']['median']:.2f} × grpo_b004."
                   if skip["median_step_s"] and BASELINE in summary else ".")
            )
    rows = summary.get("armor_full", {}).get("whatif_generate_rows")
    if rows:
        notes.append(
            "- generate time vs rows (policy model, full length): "
            + ", ".join(f"{n} rows {t:.3f} s" for n, t in rows.items())
            + " — a second generate call for the K·groups reference candidates costs about as much as the policy's."
        )
    whatif = summary.get("armor_lora", {}).get("whatif_merged_generation")
    if whatif:
        notes.append(
            f"- what-if (LoRA): policy {whatif['rows'][0]} rows + reference {whatif['rows'][1]} rows as two generate "
            f"calls {whatif['separate_s']:.3f} s vs one mixed-adapter call (PEFT adapter_names) {whatif['merged_s']:.3f} s "
            f"(full length, {meta['completion']} tokens)."
        )
    if notes:
        lines += ["", "Notes:", "", *notes]
    return "\n".join(lines) + "\n"


def rerender(source: Path, out: Path) -> int:
    """Summary, targets and tables again from the raw runs of a saved bench.json (no training)."""
    result = json.loads(source.read_text())
    result["summary"] = summarize(result["runs"], result["meta"]["warmup"])
    result["targets"] = check_targets(result["summary"])
    report = format_report(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "bench.md").write_text(report)
    print(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny structural run (same as --preset smoke)")
    parser.add_argument(
        "--preset", choices=list(PRESETS), default="full",
        help="full: the measurement (default); smoke: seconds, structure only; memory: a 19M-parameter model for RSS",
    )
    parser.add_argument("--out", default="results/bench", help="folder for bench.json / bench.md")
    parser.add_argument(
        "--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS)
    )
    for key in ("hidden", "layers", "completion", "batch", "steps", "warmup", "reps", "prompts"):
        parser.add_argument(f"--{key}", type=int, default=None)
    parser.add_argument("--g", type=int, default=8, help="num_generations")
    parser.add_argument("--k", type=int, default=4, help="anchor_num_samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (1: least sensitive to load)")
    parser.add_argument("--target-found", type=float, default=0.7, help="share of groups that should find an anchor")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--lr-lora", type=float, default=1e-4)
    parser.add_argument("--reset-repeats", type=int, default=5)
    parser.add_argument("--whatif-repeats", type=int, default=None, help="mixed-adapter generation what-if (LoRA)")
    parser.add_argument("--from-json", default=None, help="recompute summary and tables from a saved bench.json")
    args = parser.parse_args(argv)
    if args.from_json:
        return rerender(Path(args.from_json), Path(args.out))

    if args.smoke:
        args.preset = "smoke"
    preset = dict(PRESETS[args.preset])
    for key in preset:
        if getattr(args, key, None) is not None:
            preset[key] = getattr(args, key)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    if preset["batch"] % args.g:
        parser.error("--batch must be a multiple of --g")
    whatif_repeats = args.whatif_repeats if args.whatif_repeats is not None else {"full": 2, "smoke": 1}.get(args.preset, 0)

    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    started, load_before = time.perf_counter(), _load()

    def submit(fn, payload):
        # a fresh process per task (max_tasks_per_child=1), so ru_maxrss is that task's own peak
        with ProcessPoolExecutor(max_workers=1, mp_context=context, max_tasks_per_child=1) as pool:
            return pool.submit(fn, payload).result()

    with tempfile.TemporaryDirectory(prefix="armor-bench-") as tmp:
        base = dict(
            seed=args.seed, threads=args.threads, k=args.k, g=args.g, hidden=preset["hidden"],
            layers=preset["layers"], completion=preset["completion"], prompts=preset["prompts"],
        )
        calibration = submit(
            build_and_calibrate,
            {**base, "model_dir": os.path.join(tmp, "model"), "target_found": args.target_found,
             "calibration_draws": 2 if args.preset == "smoke" else (4 if args.preset == "memory" else 8), "log": str(logs / "calibrate.log")},
        )
        print(
            f"model {preset['hidden']}x{preset['layers']}: anchor_reward_threshold={calibration['threshold']:.3f} "
            f"(found share {calibration['calibration_found_frac']:.2f} over {calibration['groups']} groups)",
            flush=True,
        )
        pregeneration = None
        if any(name in COLUMN for name in configs):
            pregeneration = submit(pregenerate_anchors, {
                **base, "model_path": calibration["model_path"], "threshold": calibration["threshold"],
                "output": os.path.join(tmp, "anchors"), "log": str(logs / "anchors.log"),
            })
            print(f"anchors pre-generated: {pregeneration['prompts']} prompts x {pregeneration['num_candidates']} "
                  f"candidates in {pregeneration['seconds']:.2f} s ({pregeneration['prompts_per_s']:.1f} prompts/s), "
                  f"{pregeneration['share_with_anchor']:.0%} with an anchor", flush=True)
        runs = []
        for rep in range(preset["reps"]):
            order = configs[rep % len(configs):] + configs[: rep % len(configs)]  # rotate: no config always first
            for position, name in enumerate(order):
                task = {
                    **base, **{k: preset[k] for k in ("batch", "steps")}, "config": name, "rep": rep,
                    "order": position, "model_path": calibration["model_path"], "threshold": calibration["threshold"],
                    "output_dir": os.path.join(tmp, f"{name}-{rep}"), "lr": args.lr, "lr_lora": args.lr_lora,
                    "reset_repeats": args.reset_repeats, "whatif_repeats": whatif_repeats,
                    "log": str(logs / f"{name}-{rep}.log"),
                    "anchors_path": pregeneration and pregeneration["path"],
                }
                run = submit(run_config, task)
                steps = [s["step_s"] for s in run["steps"][preset["warmup"]:]] or [run["steps"][-1]["step_s"]]
                print(
                    f"rep {rep + 1}/{preset['reps']} {name:15s} median {statistics.median(steps):.3f} s/step, "
                    f"peak RSS {run['peak_rss_mb']:.0f} MB, load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
                runs.append(run)

    summary = summarize(runs, preset["warmup"])
    import torch
    import transformers
    import trl

    result = {
        "meta": {
            "mode": args.preset, **preset, "g": args.g, "k": args.k, "seed": args.seed,
            "threads": args.threads, "threshold": calibration["threshold"],
            "calibration_found_frac": calibration["calibration_found_frac"], "configs": configs,
            "load_before": load_before, "load_after": _load(), "cpus": os.cpu_count(),
            "wall_s": time.perf_counter() - started, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "baseline": BASELINE, "lora_baseline": LORA_BASELINE,
            "pregeneration": pregeneration,
            "anchor_break_even": anchor_break_even(summary, pregeneration, preset["batch"], args.g, preset["prompts"]),
        },
        "summary": summary,
        "targets": check_targets(summary),
        "runs": runs,
    }
    report = format_report(result)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "bench.md").write_text(report)
    print()
    print(report)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
