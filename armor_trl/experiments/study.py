"""``armor-trl study``: arms × seeds of one recipe, resumable, with paired statistics and plots.

An arm is a name and overrides of the recipe (``configs/study/arms.yaml``, ``--arms_file`` or the recipe's
``study: {arms: ...}``). Every run trains from the same model (the recipe's ``model_name_or_path``, or the tiny
model warm-started from the recipe's ``demo:`` section) and writes ``metrics/<arm>-seed<s>.jsonl`` atomically when
it finishes; a rerun of the same command skips the runs whose file exists. Then :mod:`.stats` summarises them into
``summary.json`` / ``summary.md``, and ``curves.png`` / ``kl.png`` plot them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import yaml

from ..recipe import read_json, read_yaml
from . import stats
from .runner import (go_offline, override_flags, quiet_single_thread, read_curves, read_recipe, resolve_overrides,
                     smoke_version, train_run, warm_start)

# the repository's configs/ (a clone or an editable install), else the copy a wheel ships as armor_trl/configs
CONFIGS = next((path for path in (Path(__file__).resolve().parents[2] / "configs",
                                  Path(__file__).resolve().parents[1] / "configs") if path.is_dir()),
               Path(__file__).resolve().parents[2] / "configs")
DEFAULT_CONFIG = CONFIGS / "tiny_demo.yaml"
DEFAULT_ARMS_FILE = CONFIGS / "study" / "arms.yaml"
BASELINES = ("grpo", "grpo_small_lr")  # default: every other arm is compared with these, where they ran
STUDY_KEYS = ("arms", "default_arms", "seeds")  # the recipe's `study:` section
DEFAULT_SEEDS = 3


# --- the plan --------------------------------------------------------------------------------------------------
def load_arms(recipe: dict, arms_file: str | os.PathLike | None = None) -> tuple[dict, list[str]]:
    """({arm: overrides}, default arm names) from the arms file and the recipe's ``study:`` section."""
    path = Path(arms_file) if arms_file else DEFAULT_ARMS_FILE
    if not path.is_file():
        raise ValueError(f"Arms file {path} not found.")
    data = read_yaml(str(path)) or {}  # syntax errors and repeated keys named with file, line and column
    if not isinstance(data, dict) or not isinstance(data.get("arms") or {}, dict):
        raise ValueError(f"Arms file {path} must be a mapping with an 'arms:' mapping of name: overrides.")
    section = recipe.get("study") or {}
    if not isinstance(section, dict) or set(section) - set(STUDY_KEYS):
        raise ValueError(f"The recipe's study: section may hold {list(STUDY_KEYS)} only, got {section!r}.")
    arms = {**(data.get("arms") or {}), **(section.get("arms") or {})}
    for name, overrides in arms.items():
        if not isinstance(overrides, dict):
            raise ValueError(f"Arm {name!r} must be a mapping of recipe overrides, got {overrides!r}.")
        if "/" in str(name) or str(name).startswith("."):
            raise ValueError(f"Arm name {name!r} cannot hold '/' or start with '.' (it names files).")
    return arms, list(section.get("default_arms") or data.get("default") or [])


def select_arms(arms: dict, names: list[str]) -> dict:
    unknown = [n for n in names if n not in arms]
    if unknown:
        raise ValueError(f"Unknown arm(s) {', '.join(unknown)}; known arms: {', '.join(arms)}.")
    if not names:
        raise ValueError("No arms to run: pass --arms a,b,...")
    return {n: arms[n] for n in dict.fromkeys(names)}


def check_arms(arms: dict, recipe: dict, recipe_file: str, model_path: str) -> dict:
    """Each arm's resolved training overrides, parsed as `armor-trl train` would (no weights loaded); a
    ValueError naming the arm whose overrides are invalid."""
    from ..recipe import parse_train_args

    resolved = {}
    for name, overrides in arms.items():
        try:
            resolved[name] = resolve_overrides(overrides, recipe)
            parse_train_args(["--config", recipe_file, "--model_name_or_path", model_path,
                              *override_flags(resolved[name])])
        except (ValueError, KeyError) as error:
            raise ValueError(f"arm {name!r}: {error}") from error
    return resolved


def check_study_folder(out: Path, plan: dict) -> None:
    """A study folder is reused only for the same recipe and the same definition of every arm it already ran."""
    record = out / "study.json"
    if not record.is_file():
        record.write_text(json.dumps(plan, indent=2))
        return
    earlier = read_json(str(record))
    for key in ("recipe", "smoke_overrides", "model"):
        if earlier.get(key) != plan[key]:
            raise ValueError(f"{out} holds a study with a different {key}; use another study folder (--out; the "
                             "demo's --output_dir).")
    for name, overrides in plan["arms"].items():
        if name in earlier["arms"] and earlier["arms"][name] != overrides:
            raise ValueError(f"{out} ran arm {name!r} with overrides {earlier['arms'][name]}, now {overrides}; "
                             "rename the arm or use another study folder (--out; the demo's --output_dir).")
    earlier["arms"].update(plan["arms"])
    record.write_text(json.dumps(earlier, indent=2))


def metrics_path(out: Path, arm: str, seed: int) -> Path:
    return out / "metrics" / f"{arm}-seed{seed}.jsonl"


def _run_job(job: dict) -> tuple[str, int, float]:
    """One run, in a worker process (or in this one with one worker)."""
    go_offline()
    with quiet_single_thread():
        run = train_run(job["recipe_file"], job["overrides"], job["seed"], job["model"], Path(job["output_dir"]),
                        Path(job["metrics"]), {"run": job["name"], "arm": job["arm"], "seed": job["seed"]})
    return job["arm"], job["seed"], run["wall_time"]


# --- the study -------------------------------------------------------------------------------------------------
def run_study(config: str | None = None, arms: list[str] | None = None, seeds: int | None = None,
              workers: int | None = None, out: str | None = None, smoke: bool = False,
              arms_file: str | None = None, resamples: int = 10_000, verbose: bool = True,
              baselines: list[str] | None = None) -> Path:
    """Run the missing runs of arms × seeds, then summarise every finished one (printed with ``verbose``), each arm
    paired with each of ``baselines`` (default :data:`BASELINES`) that ran; return the study folder."""
    from tqdm.auto import tqdm

    go_offline()
    config_path, recipe = read_recipe(config or DEFAULT_CONFIG)
    all_arms, default_arms = load_arms(recipe, arms_file)
    chosen = select_arms(all_arms, arms or default_arms)
    if baselines is not None and set(baselines) - set(all_arms):
        raise ValueError(f"Unknown baseline arm(s) {sorted(set(baselines) - set(all_arms))}; known arms: "
                         f"{', '.join(all_arms)}.")
    seeds = seeds if seeds is not None else (recipe.get("study") or {}).get("seeds", DEFAULT_SEEDS)
    if not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"--seeds must be an integer >= 1, got {seeds!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    out = Path(out) if out else Path("results/study") / Path(config_path).stem
    out.mkdir(parents=True, exist_ok=True)
    settings, smoke_overrides = smoke_version(recipe) if smoke else (dict(recipe.get("demo", {})), {})

    with quiet_single_thread():
        if recipe.get("model_name_or_path"):
            model_path, warmup = recipe["model_name_or_path"], None
        elif "demo" in recipe:
            model_path, warmup = warm_start({**recipe, **smoke_overrides}, settings, out.parent / "cache")
        else:
            raise ValueError(f"{config_path} has no model_name_or_path and no demo: section to warm-start one from.")
        recipe_file = out / "recipe.yaml"  # the merged recipe (base: resolved) every run parses
        recipe_file.write_text(yaml.safe_dump(recipe, sort_keys=False))
        resolved = check_arms(chosen, recipe, str(recipe_file), model_path)
    check_study_folder(out, {"recipe": recipe, "smoke_overrides": smoke_overrides, "model": model_path,
                        "arms": chosen})

    seed0 = recipe.get("seed", 0)
    seed_list = list(range(seed0, seed0 + seeds))
    jobs = []
    for seed in seed_list:
        for arm, overrides in resolved.items():
            name = f"{arm}-seed{seed}"
            run_overrides = {**overrides, **smoke_overrides}
            if smoke and run_overrides.get("method", recipe.get("method")) == "armor":
                run_overrides["anchor_fail_after_rounds"] = 0  # a seconds-long warm-up may give no anchor in 4 steps
            jobs.append({"arm": arm, "seed": seed, "name": name, "recipe_file": str(recipe_file),
                         "overrides": run_overrides, "model": model_path,
                         "output_dir": str(out / "runs" / name), "metrics": str(metrics_path(out, arm, seed))})
    pending = [j for j in jobs if not Path(j["metrics"]).is_file()]
    workers = min(workers or os.cpu_count() or 1, max(1, len(pending)))
    start = time.time()
    with tqdm(total=len(jobs), initial=len(jobs) - len(pending), desc="study runs", unit="run",
              dynamic_ncols=True) as bar:
        if workers == 1:
            for job in pending:
                _run_job(job)
                bar.update(1)
        else:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = [pool.submit(_run_job, job) for job in pending]
                try:
                    for future in as_completed(futures):
                        arm, seed, _ = future.result()
                        bar.set_postfix_str(f"{arm}-seed{seed} done", refresh=False)
                        bar.update(1)
                except BaseException:
                    for future in futures:
                        future.cancel()
                    raise
    curves = {arm: {seed: read_curves(metrics_path(out, arm, seed)) for seed in seed_list} for arm in chosen}
    summary = summarize(curves, resamples, BASELINES if baselines is None else baselines)
    summary.update({"recipe": config_path, "out": str(out), "model": model_path, "warmup": warmup, "smoke": smoke,
                    "arms": chosen, "seeds": seed_list, "runs_executed": len(pending),
                    "wall_time_s": time.time() - start, "workers": workers})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(format_summary(summary))
    plot_study(curves, out)
    if verbose:
        print(f"\n{format_summary(summary)}\nResults in {out}")
    return out


# --- the summary -------------------------------------------------------------------------------------------------
def summarize(curves: dict, resamples: int = 10_000, baselines=BASELINES) -> dict:
    """Per-run metrics, per-arm mean ± std, paired comparisons with the baselines and one evaluation's noise."""
    per_run = {arm: {seed: stats.run_metrics(c["val"], c["train"]) for seed, c in runs.items()}
               for arm, runs in curves.items()}
    table = {}
    for arm, runs in per_run.items():
        table[arm] = {m: stats.mean_std([r[m] for r in runs.values()]) for m in stats.METRICS}
        found = [sum(c["anchors_found"]) / len(c["anchors_found"]) for c in curves[arm].values() if c["anchors_found"]]
        table[arm]["anchors_found"] = stats.mean_std(found)
        judged = [r["collapsed"] for r in runs.values() if r["collapsed"] is not None]
        table[arm]["collapsed"] = {"count": sum(judged), "n": len(judged)} if judged else None
        references = [stats.reference_accuracy(c["val"], c["ref_weights_step"]) for c in curves[arm].values()]
        table[arm]["ref_val_end"] = stats.mean_std([r["curve"][-1][1] for r in references if r["curve"]])
        unmeasured = sorted({s for r in references for s in r["unmeasured"]})
        if unmeasured:
            table[arm]["ref_unmeasured_steps"] = unmeasured
    comparisons = {}
    for base in baselines:
        if base not in curves:
            continue
        comparisons[base] = {arm: stats.paired_comparison(curves[arm], curves[base], resamples)
                             for arm in curves if arm != base}
    first = next(c for runs in curves.values() for c in runs.values())
    starts = [c["val"][0][1] for runs in curves.values() for c in runs.values()]
    start_seeds = {seed: c["val"][0][1] for runs in curves.values() for seed, c in runs.items()}
    evaluation = {"metric": first["val_key"], "problems": first["val_problems"], "samples": first["val_samples"],
                  "mean_start": sum(starts) / len(starts)}
    if first["val_problems"]:
        evaluation["se_binomial"] = stats.evaluation_se(evaluation["mean_start"], first["val_problems"],
                                                        first["val_samples"])
    if len(start_seeds) > 1:  # step 0 = the same model evaluated with each seed's sampling: pure evaluation noise
        evaluation["start_std_over_seeds"] = stats.mean_std(list(start_seeds.values()))["std"]
    times = [c.get("wall_time_s") for runs in curves.values() for c in runs.values()]
    run_time = sum(times) if times and None not in times else None
    return {"per_run": per_run, "table": table, "comparisons": comparisons, "evaluation": evaluation,
            "resamples": resamples, "run_time_s": run_time}


def _cell(value: dict | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if "count" in value:
        return f"{value['count']}/{value['n']}"
    text = f"{value['mean']:.{digits}f}"
    return text + (f" ± {value['std']:.{digits}f}" if value["n"] > 1 else "")


def format_summary(summary: dict) -> str:
    ev = summary["evaluation"]
    columns = [*stats.METRICS, "anchors_found", "ref_val_end", "collapsed"]
    lines = [f"# Study: {', '.join(summary['arms'])} × seeds {summary['seeds']}", "",
             f"Recipe `{summary['recipe']}`{' (smoke)' if summary['smoke'] else ''}, model `{summary['model']}`. "
             f"Validation: {ev['metric']} on {ev['problems']} held-out problems × {ev['samples']} samples. "
             "Mean ± sample std over seeds; `auc` = area under the validation curve / step span (trapezoid rule); "
             "`final_train_reward` = mean of the last 10% of logged on-policy rewards; `collapsed` = seeds whose final "
             f"validation is ≥ {stats.COLLAPSE_DROP} below its peak and below its start while training reward rose; "
             "`ref_val_end` = held-out accuracy of the π_ref in use at the end (the run's validation at the step "
             "whose weights π_ref holds; reference.png plots it over the run).",
             "",
             "| arm | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for arm, row in summary["table"].items():
        lines.append(f"| {arm} | " + " | ".join(_cell(row[c], 0 if c == "peak_step" else 3) for c in columns) + " |")
    for arm, row in summary["table"].items():
        if row.get("ref_unmeasured_steps"):
            steps = row["ref_unmeasured_steps"]
            lines += ["", f"{arm}: π_ref held the weights of step(s) {steps[:8]}{' …' if len(steps) > 8 else ''}, "
                      "which were not validated, so its accuracy there is not in `ref_val_end` or reference.png "
                      "(validate at the reset steps: val_every_steps dividing ref_reset_steps)."]
    noise = []
    if "se_binomial" in ev:
        noise.append(f"sampling standard error of one evaluation ≤ {ev['se_binomial']:.4f} (sqrt(p(1−p)/(N·k)) at "
                     f"p = {ev['mean_start']:.3f})")
    if "start_std_over_seeds" in ev:
        noise.append(f"measured: std of the step-0 evaluation of the same model over seeds = "
                     f"{ev['start_std_over_seeds']:.4f}")
    if noise:
        lines += ["", "Evaluation noise: " + "; ".join(noise) + "."]
    for base, by_arm in summary["comparisons"].items():
        lines += ["", f"## Paired differences: arm − {base} (same seed, shared validation steps)", "",
                  "| arm | metric | mean diff | 95% CI | seeds | verdict |", "|---|---|---|---|---|---|"]
        for arm, comparison in by_arm.items():
            for metric, result in comparison["metrics"].items():
                ci = result["ci"]
                mean = "–" if result["mean"] is None else f"{result['mean']:+.3f}"
                ci_text = "–" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"
                lines.append(f"| {arm} | {metric} | {mean} | {ci_text} | {result['n']} | {result['verdict']} |")
    lines += ["", f"Confidence intervals: percentile bootstrap of the mean paired difference over seeds "
              f"({summary['resamples']} resamples, seeded). With few seeds it is narrow and optimistic: it never "
              "extends beyond the smallest and largest per-seed difference (with 3 seeds it is exactly that range), "
              "so 'higher'/'lower' then means only that every seed agreed.",
              "", f"{summary['runs_executed']} run(s) executed now ({summary['workers']} worker(s)), "
              f"{summary['wall_time_s']:.0f} s."]
    if summary.get("run_time_s") is not None:
        lines[-1] += (f" All {sum(len(s) for s in summary['per_run'].values())} runs took {summary['run_time_s']:.0f} "
                      "s of run time in all (each run's own wall time, summed; parallel runs overlap).")
    return "\n".join(lines) + "\n"


# --- plots -------------------------------------------------------------------------------------------------------
def _band(runs: list[list[tuple[int, float]]], smooth: int = 1):
    """Steps every run has, and the mean and std over runs there (a trailing mean over ``smooth`` points first)."""
    import numpy as np

    common = sorted(set.intersection(*[{s for s, _ in r} for r in runs])) if runs else []
    if not common:
        return None
    keep = set(common)
    values = np.array([[v for s, v in r if s in keep] for r in runs])
    if smooth > 1:
        values = np.stack([stats.trailing_mean(row, smooth) for row in values])
    return np.array(common), values.mean(axis=0), values.std(axis=0)


def pyplot():
    """matplotlib.pyplot on the Agg backend, imported only when a plot is drawn: matplotlib is not a dependency of the
    training library, it comes with the ``experiments`` extra."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "The study and demo plots need matplotlib, which armor-trl installs only with its experiments extra: "
            "pip install 'armor-trl[experiments]' (or, in a clone, pip install -e '.[experiments]')."
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_study(curves: dict, out: Path, smooth: int = 5) -> None:
    """curves.png: validation accuracy and training reward per arm; kl.png: reverse KL(π_θ‖π_ref) on on-policy
    samples and forward KL(π_ref‖π_θ) on anchors; reference.png: the policy's validation accuracy next to that of
    the π_ref in use (:func:`stats.reference_accuracy`). Mean over seeds with a ±1 std band."""
    plt = pyplot()
    colors = plt.get_cmap("tab10" if len(curves) <= 10 else "tab20")
    curves = {arm: {seed: {**c, "ref_val": stats.reference_accuracy(c["val"], c["ref_weights_step"])["curve"]}
                    for seed, c in runs.items()} for arm, runs in curves.items()}
    for filename, panels in (
        ("curves.png", [("val", "held-out validation accuracy", 1), ("train", f"training reward (on-policy, "
                                                                             f"mean of {smooth} logs)", smooth)]),
        ("kl.png", [("kl_reverse", "reverse KL(π_θ‖π_ref), on-policy samples", smooth),
                    ("kl_forward", "forward KL(π_ref‖π_θ), anchors", smooth)]),
        ("reference.png", [("val", "policy π_θ: held-out validation accuracy", 1),
                           ("ref_val", "reference π_ref in use: its held-out accuracy", 1)]),
    ):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
        for ax, (key, title, window) in zip(axes, panels):
            for i, (arm, runs) in enumerate(curves.items()):
                band = _band([c[key] for c in runs.values() if c[key]], window)
                if band is None:
                    continue
                steps, mean, std = band
                ax.plot(steps, mean, color=colors(i), label=arm)
                ax.fill_between(steps, mean - std, mean + std, color=colors(i), alpha=0.2)
            ax.set(title=title, xlabel="step")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "not logged by these arms", ha="center", transform=ax.transAxes)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
