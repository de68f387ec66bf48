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

import contextlib
import hashlib
import json
import os
import random
import shutil
import statistics
import time
import warnings
from pathlib import Path

import yaml
from transformers import TrainerCallback

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_demo.yaml"
VAL_KEY_PREFIX = "val/avg@"


# --- set-up ----------------------------------------------------------------------------------------------------
def load_recipe(config: str | os.PathLike | None) -> tuple[str, dict]:
    path = Path(config) if config else DEFAULT_CONFIG
    if not path.is_file():
        raise ValueError(f"Demo recipe {path} not found: pass --config path/to/tiny_demo.yaml.")
    with open(path) as f:
        recipe = yaml.safe_load(f)
    if not isinstance(recipe, dict) or "demo" not in recipe:
        raise ValueError(f"{path} has no 'demo:' section, so it is not a demo recipe.")
    return str(path), recipe


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


def warm_start(recipe: dict, settings: dict, cache_dir: Path, progress=None) -> tuple[str, dict]:
    """The warm-started tiny model and a record of its warm-up, built once and cached under ``cache_dir`` by a hash
    of everything that shapes it.

    Supervised training on addition problems disjoint from the recipe's RL and held-out problems, stopped as soon
    as the sampled accuracy on a separate calibration set reaches ``warmup.target_accuracy`` (checked every
    ``warmup.check_every`` steps; at most ``warmup.steps``). Stopping on accuracy rather than after a fixed
    number of steps keeps the start point of RL comparable: this task is learnt in a sudden jump whose timing
    varies with every detail.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .datasets import arithmetic_problems, arithmetic_splits
    from .evaluation import evaluate
    from .rewards import exact_integer_reward
    from .tiny import build_tiny_model

    warm = settings["warmup"]
    task = {k: recipe[k] for k in ("arithmetic_train_size", "arithmetic_eval_size", "arithmetic_digits",
                                   "arithmetic_seed")}
    key = json.dumps({"model": settings["tiny_model"], "warmup": warm, "task": task}, sort_keys=True)
    path = cache_dir / f"warm-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if (path / "warmup.json").is_file():
        if progress is not None:
            progress.set_description_str("warm-up: cached")
        return str(path), json.loads((path / "warmup.json").read_text())

    rl_train, held_out = arithmetic_splits(task["arithmetic_train_size"], task["arithmetic_eval_size"],
                                           task["arithmetic_seed"], task["arithmetic_digits"])
    reserved = set(rl_train["prompt"]) | set(held_out["prompt"])
    problems = arithmetic_problems(warm["num_problems"] + warm["calibration_size"], warm["seed"],
                                   task["arithmetic_digits"], exclude=reserved)
    problems, calibration = problems[: warm["num_problems"]], problems[warm["num_problems"]:]
    calibration = Dataset.from_dict({"prompt": [p for p, _ in calibration], "answer": [a for _, a in calibration]})

    tmp = cache_dir / f"{path.name}.tmp-{os.getpid()}"
    build_tiny_model(tmp, **settings["tiny_model"])
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp)
    torch.manual_seed(warm["seed"])
    rng = random.Random(warm["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=warm["learning_rate"], weight_decay=0.0)
    encoded = []
    for prompt, answer in problems:  # loss on the answer and end-of-sequence tokens only
        prompt_ids = tokenizer(prompt)["input_ids"]
        answer_ids = tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))
    accuracy, step = 0.0, 0
    while step < warm["steps"] and accuracy < warm["target_accuracy"]:
        model.train()
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(warm["batch_size"])]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if progress is not None:
            progress.update(1)
        if step % warm["check_every"] == 0:
            accuracy = evaluate(model, tokenizer, calibration, exact_integer_reward, k=4, max_new_tokens=5,
                                batch_size=1024, seed=warm["seed"])["avg@4"]
    if progress is not None:  # stopped at the target accuracy
        progress.total = step
        progress.refresh()
    record = {"steps": step, "calibration_avg@4": accuracy, "target_accuracy": warm["target_accuracy"]}
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "warmup.json").write_text(json.dumps(record))
    if path.exists():  # another process cached the same checkpoint meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, path)
    return str(path), record


class _Progress(TrainerCallback):
    """Advances the demo's tqdm bar by one per optimizer step."""

    def __init__(self, bar, label: str):
        self.bar, self.label = bar, label

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.set_postfix_str(self.label, refresh=False)
        self.bar.update(1)


# --- one run ---------------------------------------------------------------------------------------------------
# Each method's command-line flags on top of the recipe, from the demo settings and the recipe.
# grpo_small_lr is a control: ARMOR's mixed ratio scales on-policy gradients by about α = (G−1)/G, so plain GRPO
# at α × the learning rate separates "smaller steps" from what the anchor and the mixture do.
METHOD_ARGS = {
    "grpo": lambda kl, recipe: ["--method", "grpo", "--beta", "0.0"],
    "grpo_kl": lambda kl, recipe: ["--method", "grpo", "--beta", str(kl)],
    "grpo_small_lr": lambda kl, recipe: [
        "--method", "grpo", "--beta", "0.0",
        "--learning_rate", str(recipe["learning_rate"] * (recipe["num_generations"] - 1) / recipe["num_generations"]),
    ],
    "armor": lambda kl, recipe: ["--method", "armor"],
}
LABELS = {"grpo": "GRPO (β=0)", "grpo_kl": "GRPO + KL", "grpo_small_lr": "GRPO, lr × (G−1)/G", "armor": "ARMOR"}


def _override_args(overrides: dict) -> list[str]:
    args = []
    for key, value in overrides.items():
        args += [f"--{key}", json.dumps(value) if isinstance(value, (list, dict)) else str(value)]
    return args


def train_run(config_path: str, method: str, seed: int, model_path: str, run_dir: Path, overrides: dict,
              kl_beta: float, bar, recipe: dict) -> dict:
    """Train one method from the recipe; return its logged history, validation records and wall time."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from .cli import build_trainer, parse_train_args

    name = f"{method}-seed{seed}"
    argv = ["--config", config_path, *METHOD_ARGS[method](kl_beta, recipe), "--model_name_or_path", model_path,
            "--seed", str(seed), "--output_dir", str(run_dir / "runs" / name), *_override_args(overrides)]
    script_args, training_args, model_args, _ = parse_train_args(argv)
    start = time.time()
    trainer = build_trainer(script_args, training_args, model_args, callbacks=[_Progress(bar, name)], run_name=name)
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    trainer.train()
    wall = time.time() - start
    validation = next(cb for cb in trainer.callback_handler.callbacks if hasattr(cb, "history")).history
    history = [entry for entry in trainer.state.log_history if "train_runtime" not in entry]
    metrics_file = run_dir / "metrics" / f"{name}.jsonl"
    metrics_file.parent.mkdir(parents=True, exist_ok=True)
    with open(metrics_file, "w") as f:
        for record in [validation[0]] + history:  # step 0: the warm checkpoint's validation
            f.write(json.dumps({"run": name, "method": method, "seed": seed, **record}) + "\n")
    return {"method": method, "seed": seed, "history": history, "validation": validation, "wall_time": wall}


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


def _trailing_mean(values, window: int):
    import numpy as np

    sums = np.cumsum(np.insert(np.asarray(values, dtype=float), 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(values) + 1) - counts]) / counts


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
                values = np.stack([_trailing_mean(row, smooth) for row in values])
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


@contextlib.contextmanager
def _quiet_single_thread():
    """One torch thread (the tiny model gains nothing from more, and results stay reproducible) and quiet logs."""
    import torch
    import transformers

    threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.simplefilter("ignore", category=UserWarning)
            yield
    finally:
        torch.set_num_threads(threads)
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()


def run_demo(config: str | None = None, output_dir: str = "results/demo", seeds: int = 1, smoke: bool = False) -> Path:
    """Run the demo; return the run folder holding metrics/, curves.png, summary.json and summary.md."""
    from tqdm.auto import tqdm

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
        os.environ.setdefault(name, "1")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    config_path, recipe = load_recipe(config)
    settings = dict(recipe["demo"])
    overrides = {}
    if smoke:
        smoke_settings = settings.get("smoke", {})
        overrides = dict(smoke_settings.get("overrides", {}))
        settings.update({k: v for k, v in smoke_settings.items() if k != "overrides"})
    steps = overrides.get("max_steps", recipe["max_steps"])
    seed0 = recipe.get("seed", 0)
    run_dir = fresh_run_dir(output_dir, smoke)
    start = time.time()
    runs = []
    with _quiet_single_thread():
        with tqdm(total=settings["warmup"]["steps"], desc="warm-up (supervised)", unit="step",
                  dynamic_ncols=True) as bar:
            model_path, warmup = warm_start({**recipe, **overrides}, settings, Path(output_dir) / "cache", bar)
        with tqdm(total=steps * len(METHOD_ARGS) * seeds, desc="RL runs", unit="step", dynamic_ncols=True) as bar:
            for seed in range(seed0, seed0 + seeds):
                for method in METHOD_ARGS:
                    runs.append(train_run(config_path, method, seed, model_path, run_dir, overrides,
                                          settings["kl_beta"], bar, recipe))
    table = {m: aggregate([summarize_run(r) for r in runs if r["method"] == m]) for m in METHOD_ARGS}
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
