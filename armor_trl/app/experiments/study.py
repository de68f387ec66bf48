"""``armor-trl study``: arms × seeds of one recipe, resumable, with paired statistics and plots.

An arm is a name and overrides of the recipe (``configs/study/arms.yaml``, ``--arms_file`` or the recipe's
``study: {arms: ...}``). Every run trains from the same model (the recipe's ``model_name_or_path``, or the tiny
model warm-started from the recipe's ``demo:`` section) and writes ``metrics/<arm>-seed<s>.jsonl`` atomically when
it finishes; a rerun of the same command skips the runs whose file exists. Then :mod:`.summary` summarises them
with :mod:`.stats` into ``summary.json`` / ``summary.md``, and :mod:`.plots` draws ``curves.png`` / ``kl.png``.

Several warm checkpoints (``--warmup_seeds 0,1,2`` or ``study.warmup_seeds``): each warm-up seed builds its own
warm checkpoint, runs are keyed (arm, warm-up seed, seed) and written as ``metrics/<arm>-warm<w>-seed<s>.jsonl``,
and the statistics resample warm checkpoints, then seeds (:func:`.stats.hierarchical_ci`). The recipe's
``study:`` section may also name primary comparisons (``primary: [[armor, grpo_kl_best], ...]``) and arms chosen
on tuning seeds (``select: {grpo_kl_best: [grpo_kl_0.01, grpo_kl_0.04, grpo_kl_0.1]}`` with ``tuning_seeds:``,
disjoint from the reporting seeds): see :func:`run_study`. The folder keeps each warm checkpoint it trains from and
its weights' hash (:mod:`.warm_checkpoints`): a copied folder resumes on another machine from the same weights.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import yaml

from armor_trl.app.experiments import stats
from armor_trl.app.experiments.plan import (DEFAULT_CONFIG, candidates_of, check_arms, check_study_folder,
                                            compose_arm, every_composition, load_arms, load_compositions,
                                            load_criterion, load_primary, load_selection, metrics_path, parse_seeds,
                                            run_name, select_arms, select_best, sources_of)
from armor_trl.app.experiments.plots import plot_study
from armor_trl.app.experiments.runner import (go_offline, quiet_single_thread, read_curves, read_recipe, smoke_version,
                                              train_run, warm_start)
from armor_trl.app.experiments.summary import BASELINES, format_summary, summarize_study
from armor_trl.app.experiments.warm_checkpoints import pin_warm_checkpoints, stored_copy

DEFAULT_SEEDS = 3


# --- the runs ---------------------------------------------------------------------------------------------------
def _run_job(job: dict) -> tuple[str, float]:
    """One run, in a worker process (or in this one with one worker)."""
    go_offline()
    with quiet_single_thread():
        run = train_run(job["recipe_file"], job["overrides"], job["seed"], job["model"], Path(job["output_dir"]),
                        Path(job["metrics"]), job["tags"])
    return job["name"], run["wall_time"]


def run_jobs(jobs: list[dict], workers: int | None, desc: str) -> tuple[int, int]:
    """Run the jobs whose metrics file is missing, in ``workers`` processes; (runs executed, workers used)."""
    from tqdm.auto import tqdm

    pending = [j for j in jobs if not Path(j["metrics"]).is_file()]
    workers = min(workers or os.cpu_count() or 1, max(1, len(pending)))
    with tqdm(total=len(jobs), initial=len(jobs) - len(pending), desc=desc, unit="run", dynamic_ncols=True) as bar:
        if workers == 1:
            for job in pending:
                _run_job(job)
                bar.update(1)
        else:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = [pool.submit(_run_job, job) for job in pending]
                try:
                    for future in as_completed(futures):
                        name, _ = future.result()
                        bar.set_postfix_str(f"{name} done", refresh=False)
                        bar.update(1)
                except BaseException:
                    for future in futures:
                        future.cancel()
                    raise
    return len(pending), workers


def machine() -> dict:
    """The CPU the runs train on: results depend on it (the warm-up's float path does)."""
    model = None
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), None)
    except OSError:
        pass
    return {"cpu_model": model or platform.processor() or "unknown", "cpu_cores": os.cpu_count(),
            "platform": platform.platform()}


def _git(folder: Path, *args: str) -> str | None:
    try:
        result = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def provenance(preregister: str | os.PathLike | None = None) -> dict:
    """The commit of the code that ran (None outside a git checkout) and, with ``preregister``, the last commit of
    that file (``git log -1 --format=%H -- file``): what a report cites as the pre-registration."""
    commit = _git(Path(__file__).resolve().parent, "rev-parse", "HEAD")
    record = {"commit": commit, "uncommitted_changes": None if commit is None else
              bool(_git(Path(__file__).resolve().parent, "status", "--porcelain", "--untracked-files=no"))}
    if preregister is not None:
        path = Path(preregister).resolve()
        if not path.is_file():
            raise ValueError(f"--preregister {preregister}: no such file.")
        record["preregistration"] = {
            "file": str(preregister), "commit": _git(path.parent, "log", "-1", "--format=%H", "--", path.name) or None,
            "uncommitted_changes": bool(_git(path.parent, "status", "--porcelain", "--", path.name))}
    return record


# --- the study -------------------------------------------------------------------------------------------------
def run_study(config: str | None = None, arms: list[str] | None = None, seeds: int | None = None,
              workers: int | None = None, out: str | None = None, smoke: bool = False,
              arms_file: str | None = None, resamples: int = 10_000, verbose: bool = True,
              baselines: list[str] | None = None, *, warmup_seeds=None, tuning_seeds=None, primary=None,
              preregister: str | None = None, overrides: dict | None = None) -> Path:
    """Run the missing runs of arms × warm checkpoints × seeds, then summarise every finished one (printed with
    ``verbose``), each arm paired with each of ``baselines`` (default :data:`BASELINES`) that ran; return the
    study folder.

    ``warmup_seeds`` (list or "0,1,2"; default ``study.warmup_seeds``, else the recipe's ``demo.warmup.seed``
    alone): one warm checkpoint each, cached. ``primary`` (``[[arm, baseline], ...]`` or "arm:baseline,...";
    default ``study.primary``): comparisons of :data:`.stats.PRIMARY` reported first. An arm name may be an alias
    of ``study.select``: its candidate arms run first on the ``tuning_seeds`` (default ``study.tuning_seeds``;
    refused if they overlap the reporting seeds) from every warm checkpoint; the best by the alias's metric is
    written to summary.json's ``selection`` and runs on the reporting seeds, reported under the alias.
    ``preregister``: a file whose last commit summary.json records, with the repository's commit."""
    import torch

    go_offline()
    config_path, recipe = read_recipe(config or DEFAULT_CONFIG)
    all_arms, default_arms = load_arms(recipe, arms_file)
    section = recipe.get("study") or {}
    selection = load_selection(section, all_arms)
    compositions = load_compositions(section, all_arms, selection)
    criterion = load_criterion(section)  # checked before anything trains
    names = list(dict.fromkeys(arms or default_arms))
    chosen = select_arms(all_arms, names, [*selection, *compositions])
    composed_names = [n for n in names if n in compositions]
    # the aliases to choose: those the study reports, and those a composed arm it reports is built from
    aliases = list(dict.fromkeys([*(n for n in names if n in selection),
                                  *(s for n in composed_names for s in sources_of(compositions[n]) if s in selection)]))
    unknown_baselines = set(baselines or ()) - set(all_arms) - set(selection) - set(compositions)
    if unknown_baselines:
        raise ValueError(f"Unknown baseline arm(s) {sorted(unknown_baselines)}; known arms: {', '.join(all_arms)}.")
    if primary is None:  # the recipe's primary comparisons: those whose arms both run (a study of some arms only)
        primary = [pair for pair in section.get("primary") or []
                   if not isinstance(pair, (list, tuple)) or all(arm in names for arm in pair)]
    primary = load_primary(primary, names)
    # secondary comparisons (reported like the primary ones, after them) and the mode whose final share every
    # comparison also reports (study.mechanism_mode: the general method's mode); those whose arms all run
    secondary = load_primary([pair for pair in section.get("secondary") or []
                              if not isinstance(pair, (list, tuple)) or all(arm in names for arm in pair)], names)
    mechanism_mode = section.get("mechanism_mode")
    if mechanism_mode is not None and not isinstance(mechanism_mode, str):
        raise ValueError(f"study.mechanism_mode must be a mode name (a string), got {mechanism_mode!r}.")
    seeds = seeds if seeds is not None else section.get("seeds", DEFAULT_SEEDS)
    if not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"--seeds must be an integer >= 1, got {seeds!r}")
    seed0 = recipe.get("seed", 0)
    seed_list = list(range(seed0, seed0 + seeds))
    tuning = tuning_seeds if tuning_seeds is not None else section.get("tuning_seeds")
    tuning = parse_seeds(tuning, "--tuning_seeds (study.tuning_seeds)") if tuning is not None else []
    if set(tuning) & set(seed_list):
        raise ValueError(f"Tuning seeds {sorted(set(tuning) & set(seed_list))} are also reporting seeds {seed_list} "
                         f"(--seeds counts from the recipe's seed {seed0}): an arm chosen on a seed must not be "
                         "judged on it. Use disjoint seeds (--tuning_seeds / study.tuning_seeds).")
    if aliases and not tuning:
        raise ValueError(f"{aliases} are chosen among arms on tuning seeds (study.select): give --tuning_seeds or "
                         "study.tuning_seeds, disjoint from the reporting seeds.")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    record = provenance(preregister)
    registered = record.get("preregistration")
    if registered and (registered["commit"] is None or registered["uncommitted_changes"]):
        print(f"armor-trl study: warning: the pre-registration {registered['file']} has "
              f"{'no commit' if registered['commit'] is None else 'uncommitted changes'}; summary.json says so.",
              file=sys.stderr)
    out = Path(out) if out else Path("results/study") / Path(config_path).stem
    out.mkdir(parents=True, exist_ok=True)
    # every run's (and the warm start's) training overrides: the smoke version's, else ``overrides`` (the demo's)
    settings, smoke_overrides = smoke_version(recipe) if smoke else (dict(recipe.get("demo", {})), dict(overrides or {}))
    warm = warmup_seeds if warmup_seeds is not None else section.get("warmup_seeds")

    with quiet_single_thread():
        threads = torch.get_num_threads()  # what every run trains with
        if recipe.get("model_name_or_path"):
            if warm is not None:
                raise ValueError(f"--warmup_seeds (study.warmup_seeds) warm-start the tiny model of a demo: section; "
                                 f"{config_path} trains model_name_or_path {recipe['model_name_or_path']}.")
            models, warmups = {None: recipe["model_name_or_path"]}, {None: None}
        elif "demo" in recipe:
            warm = parse_seeds(warm, "--warmup_seeds (study.warmup_seeds)") if warm is not None else [
                settings["warmup"]["seed"]]
            models, warmups = {}, {}
            from tqdm.auto import tqdm

            for w in warm:  # the seed is part of warm_start's cache key: one checkpoint per warm-up seed
                # minutes on a CPU the first time (supervised steps until the calibration accuracy is reached)
                with tqdm(total=settings["warmup"]["steps"], desc=f"warm-up (seed {w})", unit="step",
                          dynamic_ncols=True) as bar:
                    models[w], warmups[w] = warm_start({**recipe, **smoke_overrides},
                                                       {**settings, "warmup": {**settings["warmup"], "seed": w}},
                                                       out.parent / "cache", progress=bar, stored=stored_copy(out, w))
        else:
            raise ValueError(f"{config_path} has no model_name_or_path and no demo: section to warm-start one from.")
        recipe_file = out / "recipe.yaml"  # the merged recipe (base: resolved) every run parses
        recipe_file.write_text(yaml.safe_dump(recipe, sort_keys=False))
        candidates = {c: all_arms[c] for alias in aliases for c in candidates_of(selection[alias])}
        resolved = check_arms({**chosen, **candidates}, recipe, str(recipe_file), next(iter(models.values())))
        for name in composed_names:  # whatever the tuning chooses, the composed arm can run
            check_arms({f"{name}[{i}]": o for i, o in enumerate(every_composition(compositions[name], selection,
                                                                                   all_arms, recipe))},
                       recipe, str(recipe_file), next(iter(models.values())))
    multi = len(models) > 1
    tag = lambda w: w if multi else None  # noqa: E731 (one warm checkpoint keeps the file names it always had)
    plan = {"recipe": recipe, "smoke_overrides": smoke_overrides,
            "model": {f"warm{w}": p for w, p in models.items()} if multi else models[next(iter(models))]}
    check_study_folder(out, {**plan, "arms": {**chosen, **candidates}})
    # the same starting weights on every machine: checked against the folder's record, stored in it
    weights = pin_warm_checkpoints(out, {w: p for w, p in models.items() if warmups[w] is not None})

    def job(arm: str, seed: int, w) -> dict:
        name = run_name(arm, seed, tag(w))
        run_overrides = {**resolved[arm], **smoke_overrides}
        if smoke and run_overrides.get("method", recipe.get("method")) == "armor":
            run_overrides["anchor_fail_after_rounds"] = 0  # a seconds-long warm-up may give no anchor in 4 steps
        tags = {"run": name, "arm": arm, "seed": seed, **({} if tag(w) is None else {"warmup_seed": w})}
        return {"arm": arm, "seed": seed, "name": name, "tags": tags, "recipe_file": str(recipe_file),
                "overrides": run_overrides, "model": models[w], "output_dir": str(out / "runs" / name),
                "metrics": str(metrics_path(out, arm, seed, tag(w)))}

    start = time.time()
    executed, used, choice, jobs = 0, 1, {}, []
    pool = {alias: list(selection[alias]["among"]) for alias in aliases}
    while aliases:  # first the candidates on the tuning seeds, then the chosen arms on the reporting seeds
        new = [job(arm, t, w) for w in models for t in tuning for arm in dict.fromkeys(a for p in pool.values() for a in p)
               if job(arm, t, w)["name"] not in {j["name"] for j in jobs}]
        done, workers_used = run_jobs(new, workers, "tuning runs")
        executed, used, jobs = executed + done, max(used, workers_used), jobs + new
        choice = {alias: select_best(out, {**selection[alias], "among": pool[alias]}, tuning, list(models), tag)
                  for alias in aliases}
        grown = {alias: [a for a in selection[alias]["extend"].get(choice[alias]["chosen"], []) if a not in pool[alias]]
                 for alias in aliases}  # the chosen arm sits at an edge the pre-registered rule extends
        if not any(grown.values()):
            break
        for alias, added in grown.items():
            pool[alias] += added
    composed = {name: compose_arm(compositions[name], lambda a: choice[a]["chosen"] if a in choice else a, all_arms,
                                  recipe) for name in composed_names}
    if composed:
        check_study_folder(out, {**plan, "arms": composed})  # a folder keeps one composition per name
        resolved.update(check_arms(composed, recipe, str(recipe_file), next(iter(models.values()))))
    ran = {name: choice[name]["chosen"] if name in choice else name for name in names}  # reported name → arm run
    report_jobs = [job(arm, seed, w) for w in models for seed in seed_list for arm in dict.fromkeys(ran.values())]
    count, workers = run_jobs(report_jobs, workers, "study runs")
    curves = {w: {name: {seed: read_curves(metrics_path(out, arm, seed, tag(w))) for seed in seed_list}
                  for name, arm in ran.items()} for w in models}
    summary = summarize_study(curves, resamples, BASELINES if baselines is None else baselines, primary, secondary,
                              mechanism_mode)
    if criterion and criterion["arm"] in ran:
        summary["criterion"] = {"arm": criterion["arm"], **stats.mode_criterion(
            {w: curves[w][criterion["arm"]] for w in curves}, criterion["general_mode"], criterion["min_collapsed"],
            criterion["min_warm_checkpoints"])}
    runs = [{"name": j["name"], "arm": j["arm"], "warmup_seed": j["tags"].get("warmup_seed"), "seed": j["seed"],
             "tuning": tuning_run, "wall_time_s": read_curves(Path(j["metrics"]))["wall_time_s"]}
            for tuning_run, group in ((True, jobs), (False, report_jobs)) for j in group]
    first = next(iter(models))
    summary.update({"recipe": config_path, "out": str(out), "model": models[first] if not multi else
                    {w: p for w, p in models.items()}, "warmup": warmups[first] if not multi else None,
                    "smoke": smoke, "arms": {name: {**all_arms, **composed}[arm] for name, arm in ran.items()}, "seeds": seed_list,
                    "runs_executed": executed + count, "wall_time_s": time.time() - start,
                    "workers": max(used, workers),
                    "warmup_seeds": [w for w in models if w is not None],
                    "warmups": [{"seed": w, "model": models[w], **warmups[w], "weights_sha256": weights[w]}
                                for w in models if warmups[w]],
                    "tuning_seeds": tuning, "selection": choice, "compositions": composed,
                    "machine": {**machine(), "torch_threads_per_run": threads}, "runs": runs, "git": record})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(format_summary(summary))
    plot_study({name: {(w, s): c for w in curves for s, c in curves[w][name].items()} for name in names}, out)
    if verbose:
        print(f"\n{format_summary(summary)}\nResults in {out}")
    return out
