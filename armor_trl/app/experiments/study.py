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
disjoint from the reporting seeds): see :func:`run_study`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import yaml

from armor_trl.app.recipe.loading import read_json, read_yaml
from armor_trl.app.experiments import stats
from armor_trl.app.experiments.plots import plot_study
from armor_trl.app.experiments.runner import (go_offline, override_flags, quiet_single_thread, read_curves, read_recipe, resolve_overrides,
                     smoke_version, train_run, warm_start)
from armor_trl.app.experiments.summary import BASELINES, format_summary, summarize_study

# the repository's configs/ (a clone or an editable install), else the copy a wheel ships as armor_trl/configs
CONFIGS = next((path for path in (Path(__file__).resolve().parents[3] / "configs",
                                  Path(__file__).resolve().parents[2] / "configs") if path.is_dir()),
               Path(__file__).resolve().parents[3] / "configs")
DEFAULT_CONFIG = CONFIGS / "tiny_demo.yaml"
DEFAULT_ARMS_FILE = CONFIGS / "study" / "arms.yaml"
STUDY_KEYS = ("arms", "default_arms", "seeds", "warmup_seeds", "tuning_seeds", "primary", "secondary", "select",
              "criterion", "mechanism_mode")
CRITERION_KEYS = ("arm", "general_mode", "min_collapsed", "min_warm_checkpoints")  # `study: criterion:`
DEFAULT_SEEDS = 3
SELECT_METRIC = "final"  # a select: alias picks the arm with the best mean of this on the tuning seeds


# --- the plan --------------------------------------------------------------------------------------------------
def load_arms(recipe: dict, arms_file: str | os.PathLike | None = None) -> tuple[dict, list[str]]:
    """({arm: overrides}, default arm names) from the arms file and the recipe's ``study:`` section."""
    path = Path(arms_file) if arms_file else DEFAULT_ARMS_FILE
    if not path.is_file():
        raise ValueError(f"Arms file {path} not found.")
    data = _read_arms_file(path)
    section = recipe.get("study") or {}
    if not isinstance(section, dict) or set(section) - set(STUDY_KEYS):
        raise ValueError(f"The recipe's study: section may hold {list(STUDY_KEYS)} only, got {section!r}.")
    arms = {**data["arms"], **(section.get("arms") or {})}
    for name, overrides in arms.items():
        if not isinstance(overrides, dict):
            raise ValueError(f"Arm {name!r} must be a mapping of recipe overrides, got {overrides!r}.")
        if "/" in str(name) or str(name).startswith("."):
            raise ValueError(f"Arm name {name!r} cannot hold '/' or start with '.' (it names files).")
    return arms, list(section.get("default_arms") or data.get("default") or [])


def _read_arms_file(path: Path, _seen: tuple = ()) -> dict:
    """An arms file as {"arms": {...}, "default": [...]}; a ``base: other.yaml`` key (relative to the file) adds that
    file's arms first, as a recipe's ``base:`` does (``default`` is the file's own, else the base's)."""
    data = read_yaml(str(path)) or {}  # syntax errors and repeated keys named with file, line and column
    if not isinstance(data, dict) or not isinstance(data.get("arms") or {}, dict):
        raise ValueError(f"Arms file {path} must be a mapping with an 'arms:' mapping of name: overrides.")
    base = data.get("base")
    if base is None:
        return {"arms": dict(data.get("arms") or {}), "default": data.get("default")}
    base_path = path.parent / str(base)
    if not isinstance(base, str) or not base_path.is_file() or base_path.resolve() in _seen:
        raise ValueError(f"Arms file {path}: base must name another arms file next to it, not itself; got {base!r}.")
    inherited = _read_arms_file(base_path, _seen + (path.resolve(),))
    return {"arms": {**inherited["arms"], **(data.get("arms") or {})},
            "default": data.get("default") or inherited["default"]}


def select_arms(arms: dict, names: list[str], aliases=()) -> dict:
    """{name: overrides} of the named arms; names in ``aliases`` (select: aliases) are allowed and left out."""
    unknown = [n for n in names if n not in arms and n not in aliases]
    if unknown:
        raise ValueError(f"Unknown arm(s) {', '.join(unknown)}; known arms: {', '.join([*arms, *aliases])}.")
    if not names:
        raise ValueError("No arms to run: pass --arms a,b,...")
    return {n: arms[n] for n in dict.fromkeys(names) if n not in aliases}


def parse_seeds(value, field: str) -> list[int]:
    """A list of distinct integer seeds, from a list or a comma-separated string."""
    if isinstance(value, str):
        try:
            value = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"{field} must be comma-separated integers, got {value!r}.") from None
    if (not isinstance(value, (list, tuple)) or not value
            or any(not isinstance(v, int) or isinstance(v, bool) for v in value)):
        raise ValueError(f"{field} must be a non-empty list of integer seeds, got {value!r}.")
    if len(set(value)) != len(value):
        raise ValueError(f"{field} repeats a seed: {list(value)}.")
    return list(value)


def load_selection(section: dict, arms: dict) -> dict:
    """``{alias: {"among": [arms], "metric": m}}`` from the study section's ``select:`` (an alias maps to a list
    of arms, or to ``{among: [...], metric: m}``; m is one of stats.COMPARED, default :data:`SELECT_METRIC`)."""
    select = section.get("select") or {}
    if not isinstance(select, dict):
        raise ValueError(f"study.select must map alias: [arms], got {select!r}.")
    out = {}
    for alias, spec in select.items():
        spec = {"among": spec} if isinstance(spec, list) else spec
        if (not isinstance(spec, dict) or set(spec) - {"among", "metric"} or not isinstance(spec.get("among"), list)
                or not spec["among"]):
            raise ValueError(f"study.select.{alias} must be a list of arms or {{among: [arms], metric: M}}, got "
                             f"{spec!r}.")
        if alias in arms:
            raise ValueError(f"study.select alias {alias!r} is also an arm's name; rename one of them.")
        unknown = [a for a in spec["among"] if a not in arms]
        if unknown:
            raise ValueError(f"study.select.{alias} names unknown arm(s) {unknown}; known arms: {', '.join(arms)}.")
        metric = spec.get("metric", SELECT_METRIC)
        if metric not in stats.COMPARED:
            raise ValueError(f"study.select.{alias}.metric must be one of {list(stats.COMPARED)}, got {metric!r}.")
        out[alias] = {"among": list(dict.fromkeys(spec["among"])), "metric": metric}
    return out


def load_criterion(section: dict) -> dict | None:
    """The study section's ``criterion:`` ({arm, general_mode, min_collapsed, min_warm_checkpoints}; see
    :func:`.stats.mode_criterion`), checked; None without one."""
    criterion = section.get("criterion")
    if criterion is None:
        return None
    if not isinstance(criterion, dict) or set(criterion) != set(CRITERION_KEYS):
        raise ValueError(f"study.criterion must be a mapping of exactly {list(CRITERION_KEYS)}, got {criterion!r}.")
    for key in ("min_collapsed", "min_warm_checkpoints"):
        if isinstance(criterion[key], bool) or not isinstance(criterion[key], int) or criterion[key] < 1:
            raise ValueError(f"study.criterion.{key} must be an integer >= 1, got {criterion[key]!r}.")
    return criterion


def load_primary(value, names: list[str]) -> list[list[str]]:
    """Primary comparisons ``[[arm, baseline], ...]`` (from the recipe, or ``arm:baseline,...`` on the command
    line); both must be arms (or aliases) of the study."""
    if isinstance(value, str):
        value = [pair.split(":") for pair in value.split(",") if pair.strip()]
    pairs = []
    for pair in value or []:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or pair[0] == pair[1]:
            raise ValueError(f"A primary comparison is two different arms [arm, baseline] (--primary arm:baseline), "
                             f"got {pair!r}.")
        missing = [a for a in pair if a not in names]
        if missing:
            raise ValueError(f"Primary comparison {list(pair)} names {missing}, not among this study's arms "
                             f"{names}; add them to --arms.")
        pairs.append([str(pair[0]), str(pair[1])])
    return pairs


def check_arms(arms: dict, recipe: dict, recipe_file: str, model_path: str) -> dict:
    """Each arm's resolved training overrides, parsed as `armor-trl train` would (no weights loaded); a
    ValueError naming the arm whose overrides are invalid."""
    from armor_trl.app.recipe.parsing import parse_train_args

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
    models = plan["model"]
    if isinstance(earlier.get("model"), dict) and isinstance(models, dict):  # warm checkpoints by warm-up seed:
        # more warm-up seeds may join a folder; those it has must name the same checkpoints
        same = {"model": all(earlier["model"].get(w, path) == path for w, path in models.items())}
        models = {**earlier["model"], **models}
    else:
        same = {"model": earlier.get("model") == models}
    # the recipe's study: section says which runs to make and how to report them, not how a run trains (its arms
    # are compared one by one below), so a study may gain comparisons or a criterion and keep its runs
    runs_recipe = lambda recipe: {k: v for k, v in (recipe or {}).items() if k != "study"}  # noqa: E731
    same["recipe"] = runs_recipe(earlier.get("recipe")) == runs_recipe(plan["recipe"])
    same["smoke_overrides"] = earlier.get("smoke_overrides") == plan["smoke_overrides"]
    for key in ("recipe", "smoke_overrides", "model"):
        if not same[key]:
            raise ValueError(f"{out} holds a study with a different {key}; use another study folder (--out; the "
                             "demo's --output_dir).")
    for name, overrides in plan["arms"].items():
        if name in earlier["arms"] and earlier["arms"][name] != overrides:
            raise ValueError(f"{out} ran arm {name!r} with overrides {earlier['arms'][name]}, now {overrides}; "
                             "rename the arm or use another study folder (--out; the demo's --output_dir).")
    earlier["arms"].update(plan["arms"])
    earlier["model"] = models
    record.write_text(json.dumps(earlier, indent=2))


def run_name(arm: str, seed: int, warm: int | None = None) -> str:
    """``<arm>-seed<s>``, or ``<arm>-warm<w>-seed<s>`` in a study of several warm checkpoints."""
    return f"{arm}-seed{seed}" if warm is None else f"{arm}-warm{warm}-seed{seed}"


def metrics_path(out: Path, arm: str, seed: int, warm: int | None = None) -> Path:
    return out / "metrics" / f"{run_name(arm, seed, warm)}.jsonl"


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


def select_best(out: Path, spec: dict, tuning: list[int], warms: list, tag) -> dict:
    """The arm of ``spec["among"]`` with the best mean ``spec["metric"]`` on the tuning seeds (the mean of the warm
    checkpoints' means; the first listed wins a tie), with every candidate's score."""
    scores = {}
    for arm in spec["among"]:
        groups = {}
        for w in warms:
            values = [stats.run_metrics(c["val"], c["train"])[spec["metric"]]
                      for c in (read_curves(metrics_path(out, arm, t, tag(w))) for t in tuning)]
            groups[w] = [v for v in values if v is not None]
        kept = [g for g in groups.values() if g]
        scores[arm] = {"mean": stats.grand_mean(kept) if kept else None}
        if len(warms) > 1:
            scores[arm]["per_warm"] = {w: statistics.fmean(g) if g else None for w, g in groups.items()}
    ranked = [arm for arm in spec["among"] if scores[arm]["mean"] is not None]
    if not ranked:
        raise ValueError(f"No arm of {spec['among']} has a {spec['metric']} on the tuning seeds {tuning}.")
    best = max(ranked, key=lambda arm: scores[arm]["mean"])
    return {**spec, "tuning_seeds": tuning, "scores": scores, "chosen": best}


# --- the study -------------------------------------------------------------------------------------------------
def run_study(config: str | None = None, arms: list[str] | None = None, seeds: int | None = None,
              workers: int | None = None, out: str | None = None, smoke: bool = False,
              arms_file: str | None = None, resamples: int = 10_000, verbose: bool = True,
              baselines: list[str] | None = None, *, warmup_seeds=None, tuning_seeds=None, primary=None,
              preregister: str | None = None) -> Path:
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
    criterion = load_criterion(section)  # checked before anything trains
    names = list(dict.fromkeys(arms or default_arms))
    chosen = select_arms(all_arms, names, selection)
    aliases = [n for n in names if n in selection]
    if baselines is not None and set(baselines) - set(all_arms) - set(selection):
        raise ValueError(f"Unknown baseline arm(s) {sorted(set(baselines) - set(all_arms) - set(selection))}; known "
                         f"arms: {', '.join(all_arms)}.")
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
    settings, smoke_overrides = smoke_version(recipe) if smoke else (dict(recipe.get("demo", {})), {})
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
                                                       out.parent / "cache", progress=bar)
        else:
            raise ValueError(f"{config_path} has no model_name_or_path and no demo: section to warm-start one from.")
        recipe_file = out / "recipe.yaml"  # the merged recipe (base: resolved) every run parses
        recipe_file.write_text(yaml.safe_dump(recipe, sort_keys=False))
        candidates = {c: all_arms[c] for alias in aliases for c in selection[alias]["among"]}
        resolved = check_arms({**chosen, **candidates}, recipe, str(recipe_file), next(iter(models.values())))
    multi = len(models) > 1
    tag = lambda w: w if multi else None  # noqa: E731 (one warm checkpoint keeps the file names it always had)
    check_study_folder(out, {"recipe": recipe, "smoke_overrides": smoke_overrides,
                             "model": {f"warm{w}": p for w, p in models.items()} if multi else models[next(iter(models))],
                             "arms": {**chosen, **candidates}})

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
    if aliases:  # first the candidates on the tuning seeds, then the chosen arm on the reporting seeds
        jobs = [job(arm, t, w) for w in models for t in tuning for arm in candidates]
        executed, used = run_jobs(jobs, workers, "tuning runs")
        choice = {alias: select_best(out, selection[alias], tuning, list(models), tag) for alias in aliases}
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
                    "smoke": smoke, "arms": {name: all_arms[arm] for name, arm in ran.items()}, "seeds": seed_list,
                    "runs_executed": executed + count, "wall_time_s": time.time() - start,
                    "workers": max(used, workers),
                    "warmup_seeds": [w for w in models if w is not None],
                    "warmups": [{"seed": w, "model": models[w], **warmups[w]} for w in models if warmups[w]],
                    "tuning_seeds": tuning, "selection": choice,
                    "machine": {**machine(), "torch_threads_per_run": threads}, "runs": runs, "git": record})
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(format_summary(summary))
    plot_study({name: {(w, s): c for w in curves for s, c in curves[w][name].items()} for name in names}, out)
    if verbose:
        print(f"\n{format_summary(summary)}\nResults in {out}")
    return out
