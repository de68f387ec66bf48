"""The offline demo: plain GRPO, GRPO + reverse KL, GRPO at a lower lr and ARMOR on a tiny model, in minutes.

1. Build the tiny character-level Llama (:mod:`armor_trl.tiny`) and warm it up with a short supervised phase on
   2-digit addition (``12+35=`` → ``47``); the warm checkpoint is cached under ``<output_dir>/cache``.
2. From that checkpoint, with the same seed and steps, run the recipe (``configs/tiny_demo.yaml``) four times:
   ``grpo`` (trl.GRPOTrainer, β = 0), ``grpo_kl`` (trl.GRPOTrainer, β = ``demo.kl_beta``), the control
   ``grpo_small_lr`` (β = 0 at the learning rate × (G−1)/G) and ``armor``
   (ArmorGRPOTrainer), each validated on held-out problems by :class:`~armor_trl.evaluation.ValidationCallback`.
3. Write ``metrics/<run>.jsonl`` (every logged step), ``curves.png`` (training reward and validation accuracy
   vs step), ``summary.json`` and ``summary.md`` to a fresh run folder, and print the summary table.

The training reward plotted for ARMOR is ``armor/policy_reward_mean`` (on-policy samples only), since TRL's
``reward`` there includes the anchors.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from transformers import TrainerCallback

from .runner import (VAL_KEY_PREFIX, go_offline, quiet_single_thread, read_recipe, resolve_overrides, smoke_version,
                     train_run, warm_start)
from .stats import trailing_mean

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_demo.yaml"


# --- set-up ----------------------------------------------------------------------------------------------------
def fresh_run_dir(output_dir: str, smoke: bool) -> Path:
    """A new folder under ``output_dir`` (never an existing one, so earlier results are never overwritten)."""
    stamp = time.strftime("%Y%m%d-%H%M%S") + ("-smoke" if smoke else "")
    for suffix in [""] + [f"-{i}" for i in range(1, 1000)]:
        run_dir = Path(output_dir) / f"run-{stamp}{suffix}"
        try:
            run_dir.mkdir(parents=True)
            return run_dir
        except FileExistsError:
            continue
    raise FileExistsError(f"Could not create a fresh run folder in {output_dir}.")


class _Progress(TrainerCallback):
    """Advances the demo's tqdm bar by one per optimizer step."""

    def __init__(self, bar, label: str):
        self.bar, self.label = bar, label

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.set_postfix_str(self.label, refresh=False)
        self.bar.update(1)


# --- one run ---------------------------------------------------------------------------------------------------
# Each method's overrides of the recipe (the study's arms of the same names, configs/study/arms.yaml).
# grpo_small_lr is a control: ARMOR's mixed ratio scales on-policy gradients by about α = (G−1)/G, so plain GRPO
# at α × the learning rate separates "smaller steps" from what the anchor and the mixture do.
def method_overrides(kl_beta: float) -> dict[str, dict]:
    return {
        "grpo": {"method": "grpo", "beta": 0.0},
        "grpo_kl": {"method": "grpo", "beta": kl_beta},
        "grpo_small_lr": {"method": "grpo", "beta": 0.0, "lr_scale": "alpha"},
        "armor": {"method": "armor"},
    }


LABELS = {"grpo": "GRPO (β=0)", "grpo_kl": "GRPO + KL", "grpo_small_lr": "GRPO, lr × (G−1)/G", "armor": "ARMOR"}


def summarize_run(run: dict) -> dict:
    """Peak / final validation, drop from peak, final training reward, anchors found, wall time of one run."""
    val_key = next(k for k in run["validation"][0] if k.startswith(VAL_KEY_PREFIX))
    steps = [(r["step"], r[val_key]) for r in run["validation"]]
    peak_step, peak = max(steps, key=lambda s: s[1])
    reward_key = "armor/policy_reward_mean" if run["method"] == "armor" else "reward"
    rewards = [e[reward_key] for e in run["history"] if e.get(reward_key) is not None]
    tail = rewards[-max(1, len(rewards) // 10):]
    anchors = [e["armor/anchor_found_frac"] for e in run["history"] if e.get("armor/anchor_found_frac") is not None]
    return {
        "start_val": steps[0][1],
        "peak_val": peak,
        "peak_step": peak_step,
        "final_val": steps[-1][1],
        "drop_from_peak": peak - steps[-1][1],
        "final_train_reward": sum(tail) / len(tail) if tail else float("nan"),
        "anchors_found": sum(anchors) / len(anchors) if anchors else None,
        "wall_time_s": run["wall_time"],
    }


# --- report ----------------------------------------------------------------------------------------------------
COLUMNS = [("start_val", "start val"), ("peak_val", "peak val"), ("peak_step", "peak step"),
           ("final_val", "final val"), ("drop_from_peak", "drop from peak"),
           ("final_train_reward", "final train reward"), ("anchors_found", "anchors found"),
           ("wall_time_s", "wall time (s)")]


def aggregate(summaries: list[dict]) -> dict:
    """Mean and (with several seeds) sample std of each summary value; None where a method has no value."""
    out = {}
    for key, _ in COLUMNS:
        values = [s[key] for s in summaries if s[key] is not None]
        if not values:
            out[key] = None
            continue
        out[key] = {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}
    return out


def format_table(table: dict, seeds: int) -> str:
    def cell(value, key):
        if value is None:
            return "-"
        digits = 0 if key in ("peak_step", "wall_time_s") else 3
        text = f"{value['mean']:.{digits}f}"
        return text + (f" ± {value['std']:.{digits}f}" if seeds > 1 else "")

    header = "| method | " + " | ".join(label for _, label in COLUMNS) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 1)]
    for method, values in table.items():
        lines.append(f"| {LABELS[method]} | " + " | ".join(cell(values[k], k) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path, title: str, smooth: int = 5) -> None:
    """Training reward (trailing mean over ``smooth`` logged points) and validation accuracy vs step, one colour
    per method (mean ± std band over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4.2))
    for color, method in zip(("tab:red", "tab:orange", "tab:gray", "tab:blue"), LABELS):
        method_runs = [r for r in runs if r["method"] == method]
        if not method_runs:
            continue
        reward_key = "armor/policy_reward_mean" if method == "armor" else "reward"
        val_key = next(k for k in method_runs[0]["validation"][0] if k.startswith(VAL_KEY_PREFIX))
        for ax, series in (
            (ax_train, [[(e["step"], e[reward_key]) for e in r["history"] if e.get(reward_key) is not None]
                        for r in method_runs]),
            (ax_val, [[(v["step"], v[val_key]) for v in r["validation"]] for r in method_runs]),
        ):
            length = min(len(s) for s in series)
            steps = np.array([step for step, _ in series[0][:length]])
            values = np.array([[v for _, v in s[:length]] for s in series])
            if ax is ax_train:  # per-step rewards are noisy (a few prompts per step): a trailing mean
                values = np.stack([trailing_mean(row, smooth) for row in values])
            mean, std = values.mean(axis=0), values.std(axis=0)
            ax.plot(steps, mean, color=color, label=LABELS[method])
            if len(series) > 1:
                ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2)
    ax_train.set(title=f"training reward (on-policy samples, mean of {smooth} logs)", xlabel="step", ylabel="reward")
    ax_val.set(title=f"held-out validation ({val_key.split('/')[-1]})", xlabel="step", ylabel="accuracy")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(config: str | None = None, output_dir: str = "results/demo", seeds: int = 1, smoke: bool = False) -> Path:
    """Run the demo; return the run folder holding metrics/, curves.png, summary.json and summary.md."""
    from tqdm.auto import tqdm

    go_offline()
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    config_path, recipe = read_recipe(config or DEFAULT_CONFIG, "demo")
    settings, overrides = smoke_version(recipe) if smoke else (dict(recipe["demo"]), {})
    steps = overrides.get("max_steps", recipe["max_steps"])
    seed0 = recipe.get("seed", 0)
    run_dir = fresh_run_dir(output_dir, smoke)
    start = time.time()
    runs = []
    methods = method_overrides(settings["kl_beta"])
    with quiet_single_thread():
        with tqdm(total=settings["warmup"]["steps"], desc="warm-up (supervised)", unit="step",
                  dynamic_ncols=True) as bar:
            model_path, warmup = warm_start({**recipe, **overrides}, settings, Path(output_dir) / "cache", bar)
        with tqdm(total=steps * len(methods) * seeds, desc="RL runs", unit="step", dynamic_ncols=True) as bar:
            for seed in range(seed0, seed0 + seeds):
                for method, method_args in methods.items():
                    name = f"{method}-seed{seed}"
                    run = train_run(config_path, {**resolve_overrides(method_args, recipe), **overrides}, seed,
                                    model_path, run_dir / "runs" / name, run_dir / "metrics" / f"{name}.jsonl",
                                    {"run": name, "method": method, "seed": seed}, [_Progress(bar, name)])
                    runs.append({"method": method, "seed": seed, **run})
    table = {m: aggregate([summarize_run(r) for r in runs if r["method"] == m]) for m in methods}
    title = f"tiny demo: {steps} steps, {seeds} seed(s), KL β={settings['kl_beta']}"
    plot(runs, run_dir / "curves.png", title)
    text = format_table(table, seeds) + (
        f"\n\nWarm start: {warmup['steps']} supervised steps, calibration avg@4 {warmup['calibration_avg@4']:.3f} "
        f"(target {warmup['target_accuracy']}). Validation: avg@4 on {overrides.get('arithmetic_eval_size', recipe['arithmetic_eval_size'])} "
        "held-out problems; training reward: on-policy samples (ARMOR: armor/policy_reward_mean)."
    )
    total = time.time() - start
    with open(run_dir / "summary.json", "w") as f:
        json.dump({"recipe": config_path, "warm_model": model_path, "warmup": warmup, "seeds": seeds, "smoke": smoke,
                   "wall_time_s": total, "methods": table,
                   "runs": [{"method": r["method"], "seed": r["seed"], **summarize_run(r)} for r in runs]}, f, indent=2)
    (run_dir / "summary.md").write_text(f"# {title}\n\n{text}\n\nTotal wall time: {total:.0f} s\n")
    print(f"\n{title}\n{text}\n\nTotal wall time {total:.0f} s. Results in {run_dir}")
    return run_dir
