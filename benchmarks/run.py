"""One measured run (worker process): train one variant for ``steps`` optimizer steps under the instruments and
return its per-step timings and split, peak RSS, logged metrics, the cost of a reference reset and the what-ifs."""

from __future__ import annotations

import gc
import time

from benchmarks import instruments, whatif
from benchmarks.workload import build_trainer, quiet

# logged metrics kept per step in the run's record
METRICS = (
    "armor/anchor_found_frac", "armor/anchor_cache_hit_frac", "armor/candidates_verified_frac",
    "completions/mean_length", "reward", "armor/policy_reward_mean", "armor/generation_rounds",
    "armor/groups_kept_frac", "armor/anchor_same_call", "armor/anchor_eligible_frac", "armor/anchor_candidate_rows",
    "armor/dropped_all_correct_frac", "armor/dropped_all_wrong_frac",
)
# ArmorGRPOTrainer's running anchor totals (AnchorRollout.counts), recorded at the end of every optimizer step
COUNTS = ("candidate_rows", "candidates_scored", "anchors_from_candidates", "groups", "eligible_groups", "rounds",
          "deferred_groups", "deferred_calls")


def run_variant(task: dict) -> dict:
    """Worker task; ``task`` holds the variant, the bench config and the run's settings."""
    quiet(task.get("log"), task["threads"])
    # Trainer.train starts with a full garbage collection (accelerate's free_memory) that walks every object of the
    # modules the forkserver imported, 0.4 s per run before its first step; frozen, those objects stay out of it and
    # of any full collection during the steps, alike in every variant.
    gc.freeze()
    rss_start, peak_start = instruments.rss_mb(), instruments.peak_rss_mb()
    variant = task["variant"]
    trainer, build_s = build_trainer(task, variant, task["bench"])
    timers = instruments.Timers()
    # the seam helpers for every ArmorGRPOTrainer: with dynamic sampling its π_old log-probs pass through them too
    steps = instruments.instrument(trainer, timers, variant.trainer == "armor_trl")
    counts = _record_anchor_counts(trainer)
    rss_before_train = instruments.rss_mb()
    train_start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - train_start
    peak = instruments.peak_rss_mb()

    result = {
        "config": variant.name, "rep": task["rep"], "order": task["order"], "build_s": build_s, "train_s": train_s,
        "rss_start_mb": rss_start, "peak_rss_start_mb": peak_start, "rss_before_train_mb": rss_before_train,
        "peak_rss_mb": peak,
        "steps": [
            {"step": s["step"], "step_s": s["raw"]["step_s"], "cpu_s": s["raw_cpu"]["step_s"],
             "split": instruments.split(s["raw"]), "split_cpu": instruments.split(s["raw_cpu"]), "raw": s["raw"],
             "work": s["work"]}
            for s in steps
        ],
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "total_params": sum(p.numel() for p in trainer.model.parameters()),
        "calls": dict(timers.calls),
    }
    if counts is not None:  # cumulative per step; summaries take differences over the measured steps
        result["anchor_counts"] = counts
    if task.get("device") == "cuda":  # the GPU preset: peak GPU memory next to the process's RSS
        import torch

        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    if "mini_batches" in task:
        result.update(mini_batches=task["mini_batches"], warmup_steps=task["warmup_steps"])
    for key in METRICS:
        values = [h[key] for h in trainer.state.log_history if key in h]
        if values:
            result.setdefault("metrics", {})[key] = values
    # dynamic sampling's drops with their optimizer step (with M > 1 only rollout steps log them): shares of the
    # groups generated that were all correct, all wrong, without an anchor (the gate), and the groups generated
    drops = [[h["step"], h["armor/dropped_all_correct_frac"], h["armor/dropped_all_wrong_frac"],
              h.get("armor/dropped_no_anchor_frac", 0.0), h.get("armor/prompts_per_step")]
             for h in trainer.state.log_history if "armor/dropped_all_correct_frac" in h]
    if drops:
        result["dropped_by_step"] = drops
    if variant.armor and trainer.reference is not None and "mini_batches" not in task:
        result.update(_reset_cost(trainer, task["reset_repeats"]))
        result.update(_whatifs(trainer, task))
    return result


def _reset_cost(trainer, repeats: int) -> dict:
    """Cost of a reference reset (pi_ref <- pi_theta), measured after training on the same instance."""
    policy = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        trainer.reference.reset(policy, trainer.state.global_step + i)
        times.append(time.perf_counter() - start)
    return {"reset_s": times, "reset_kind": trainer.reference.kind,
            "reset_params": sum(p.numel() for p in trainer.reference.parameters_of(policy))}


def _whatifs(trainer, task: dict) -> dict:
    repeats, names = task["whatif_repeats"], task["variant"].whatif
    if not repeats:
        return {}
    groups, g, k = task["batch"] // task["g"], task["g"], task["k"]
    out = {}
    if "generate_rows" in names:
        out["whatif_generate_rows"] = whatif.generate_rows(
            trainer, [groups * k, groups * (g - 1), groups * g, groups * (g - 1 + k)], repeats
        )
    if "merged_generation" in names:
        out["whatif_merged_generation"] = whatif.merged_generation(trainer, groups * (g - 1), groups * k, repeats)
    return out


def _record_anchor_counts(trainer) -> list | None:
    """A list that receives the anchor rollout's running totals at the end of every optimizer step (None: no anchor
    rollout, e.g. trl.GRPOTrainer)."""
    from transformers import TrainerCallback

    rollout = getattr(trainer, "anchor_rollout", None)
    if rollout is None:
        return None
    records = []

    class AnchorCounts(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            records.append({key: rollout.counts.get(key, 0) for key in COUNTS})

    trainer.add_callback(AnchorCounts())
    return records
