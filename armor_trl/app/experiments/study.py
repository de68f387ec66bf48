"""``armor-trl study``: arms × seeds of one recipe, resumable, with paired statistics and plots.

An arm is a name and overrides of the recipe (``configs/study/arms.yaml``, ``--arms_file`` or the recipe's
``study: {arms: ...}``). Every run trains from the same model (the recipe's ``model_name_or_path``, or the tiny
model warm-started from the recipe's ``demo:`` section) and writes ``metrics/<arm>-seed<s>.jsonl`` atomically when
it finishes; a rerun of the same command skips the runs whose file exists. Then :mod:`.stats` summarises them into
``summary.json`` / ``summary.md``, and ``curves.png`` / ``kl.png`` plot them.

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
from armor_trl.app.experiments.runner import (go_offline, override_flags, quiet_single_thread, read_curves, read_recipe, resolve_overrides,
                     smoke_version, train_run, warm_start)

# the repository's configs/ (a clone or an editable install), else the copy a wheel ships as armor_trl/configs
CONFIGS = next((path for path in (Path(__file__).resolve().parents[3] / "configs",
                                  Path(__file__).resolve().parents[2] / "configs") if path.is_dir()),
               Path(__file__).resolve().parents[3] / "configs")
DEFAULT_CONFIG = CONFIGS / "tiny_demo.yaml"
DEFAULT_ARMS_FILE = CONFIGS / "study" / "arms.yaml"
BASELINES = ("grpo", "grpo_small_lr")  # default: every other arm is compared with these, where they ran
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


# --- the summary -------------------------------------------------------------------------------------------------
def summarize_study(curves: dict, resamples: int = 10_000, baselines=BASELINES, primary=(), secondary=(),
                    mechanism_mode: str | None = None) -> dict:
    """``curves``: warm checkpoint → arm → seed → curves. One warm checkpoint: :func:`summarize` (today's numbers);
    several: :func:`summarize_warms`. ``primary`` and ``secondary``: [[arm, baseline], ...], each compared on
    :data:`.stats.PRIMARY` the same way, listed under their names; with ``mechanism_mode`` each of them also compares
    that mode's final share on every validation set (``mechanism``). ``anchor_diagnostic``: per arm that logged it
    (``anchor_mode_classifier``), :func:`.stats.anchor_diagnostic` over all its runs."""
    warms = list(curves)
    if len(warms) == 1:
        summary = summarize(curves[warms[0]], resamples, baselines)
        compare = lambda a, b: stats.paired_comparison(curves[warms[0]][a], curves[warms[0]][b], resamples)  # noqa: E731
    else:
        summary = summarize_warms(curves, resamples, baselines)
        compare = lambda a, b: stats.hierarchical_comparison(  # noqa: E731
            {w: curves[w][a] for w in warms}, {w: curves[w][b] for w in warms}, resamples)
    for name, pairs in (("primary", primary), ("secondary", secondary)):
        summary[name] = []
        for arm, base in pairs:
            result = compare(arm, base)
            summary[name].append({"arm": arm, "baseline": base,
                                  "metrics": {m: result["metrics"][m] for m in stats.PRIMARY}})
    summary["mechanism"] = [
        {"arm": arm, "baseline": base, "mode": mechanism_mode, "sets": stats.mode_share_comparison(
            {w: curves[w][arm] for w in warms}, {w: curves[w][base] for w in warms}, mechanism_mode, resamples)}
        for arm, base in (*primary, *secondary)] if mechanism_mode else []
    diagnostic = {arm: stats.anchor_diagnostic([c for w in warms for c in curves[w][arm].values()])
                  for arm in curves[warms[0]]}
    summary["anchor_diagnostic"] = {arm: d for arm, d in diagnostic.items() if d is not None}
    return summary


def summarize_warms(curves: dict, resamples: int = 10_000, baselines=BASELINES) -> dict:
    """:func:`summarize` over several warm checkpoints (``curves``: warm checkpoint → arm → seed → curves).
    ``table``: mean ± std over all runs; ``means``: per arm and metric of :data:`.stats.MEANS`, the mean of the
    warm checkpoints' means with its hierarchical CI, each warm checkpoint's mean and their std; ``comparisons``:
    :func:`.stats.hierarchical_comparison` (pairs share warm checkpoint and seed); ``per_warm``: each warm
    checkpoint's own table, paired comparisons and evaluation."""
    warms = list(curves)
    per_warm = {w: summarize(curves[w], resamples, baselines) for w in warms}
    arms = list(curves[warms[0]])
    pooled = summarize({arm: {(w, s): c for w in warms for s, c in curves[w][arm].items()} for arm in arms},
                       resamples, ())
    means = {arm: {m: stats.hierarchical_summary(
        {w: [r[m] for r in per_warm[w]["per_run"][arm].values() if r[m] is not None] for w in warms}, resamples)
        for m in stats.MEANS} for arm in arms}
    comparisons = {base: {arm: stats.hierarchical_comparison({w: curves[w][arm] for w in warms},
                                                             {w: curves[w][base] for w in warms}, resamples)
                          for arm in arms if arm != base} for base in baselines if base in arms}
    evaluation = {k: v for k, v in pooled["evaluation"].items() if k != "start_std_over_seeds"}
    within = [per_warm[w]["evaluation"].get("start_std_over_seeds") for w in warms]
    if None not in within:  # the same model with each seed's sampling, within each warm checkpoint: evaluation noise
        evaluation["start_std_over_seeds"] = statistics.fmean(within)
    evaluation["start_std_over_warms"] = stats.mean_std([per_warm[w]["evaluation"]["mean_start"] for w in warms])["std"]
    times = [per_warm[w]["run_time_s"] for w in warms]
    return {"per_run": {arm: {w: per_warm[w]["per_run"][arm] for w in warms} for arm in arms},
            "table": pooled["table"], "means": means, "comparisons": comparisons, "evaluation": evaluation,
            "at_points": pooled["at_points"],
            "resamples": resamples, "run_time_s": None if None in times else sum(times),
            "per_warm": {w: {k: per_warm[w][k] for k in ("table", "comparisons", "evaluation")} for w in warms}}


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
            "resamples": resamples, "run_time_s": run_time, "at_points": at_points(curves)}


POINTS = ("start", "peak", "end")  # where at_points reads a run's curves: step 0, its validation peak, its last step


def at_points(curves: dict) -> dict:
    """Per arm, the mean over runs of each pass@j and mode share of the held-out set at each run's start, validation
    peak (the step of its first maximum) and end: {arm: {"pass@j" | "mode/<m>": {point: mean}}}; {} where the runs
    logged neither (val_k 1, no val_mode_classifier)."""
    out = {}
    for arm, runs in curves.items():
        rows: dict[str, dict[str, list]] = {}
        for c in runs.values():
            values = [v for _, v in c["val"]]
            steps = {"start": c["val"][0][0], "peak": c["val"][values.index(max(values))][0], "end": c["val"][-1][0]}
            named = {**{f"pass@{j}": s for j, s in sorted(c.get("pass", {}).items())},
                     **{f"mode/{m}": s for m, s in c.get("modes", {}).items()},
                     **{f"{name}/mode/{m}": s for name, modes in (c.get("set_modes") or {}).items()
                        for m, s in modes.items()}}
            for name, curve in named.items():
                by_step = dict(curve)
                for point, step in steps.items():
                    if step in by_step:
                        rows.setdefault(name, {}).setdefault(point, []).append(by_step[step])
        if rows:
            out[arm] = {name: {point: statistics.fmean(v) for point, v in by_point.items()}
                        for name, by_point in rows.items()}
    return out


def _cell(value: dict | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if "count" in value:
        return f"{value['count']}/{value['n']}"
    text = f"{value['mean']:.{digits}f}"
    return text + (f" ± {value['std']:.{digits}f}" if value["n"] > 1 else "")


def _ci_text(result: dict, digits: int = 3, sign: str = "+") -> str:
    ci = result["ci"]
    return "–" if ci is None else f"[{ci[0]:{sign}.{digits}f}, {ci[1]:{sign}.{digits}f}]"


def _comparison_rows(arm: str, comparison: dict, metrics, multi: bool) -> list[str]:
    rows = []
    for metric in metrics:
        result = comparison["metrics"][metric]
        mean = "–" if result["mean"] is None else f"{result['mean']:+.3f}"
        cells = [arm, metric, mean, _ci_text(result), str(result["n"])]
        if multi:
            agree = result["sign_holds_on_every_warm"]
            cells += [" / ".join(f"{v:+.3f}" for v in result["per_warm"].values()) or "–",
                      "–" if agree is None else ("yes" if agree else "no")]
        rows.append("| " + " | ".join(cells + [result["verdict"]]) + " |")
    return rows


def format_summary(summary: dict) -> str:
    multi = "per_warm" in summary
    ev = summary["evaluation"]
    columns = [*stats.METRICS, "anchors_found", "ref_val_end", "collapsed"]
    over = "all runs (warm checkpoints × seeds)" if multi else "seeds"
    lines = [f"# Study: {', '.join(summary['arms'])} × "
             + (f"warm-up seeds {summary['warmup_seeds']} × " if multi else "") + f"seeds {summary['seeds']}", "",
             f"Recipe `{summary['recipe']}`{' (smoke)' if summary['smoke'] else ''}, "
             + (f"models (warm-up seed: warm checkpoint) {', '.join(f'{w}: `{p}`' for w, p in summary['model'].items())}. "
                if multi else f"model `{summary['model']}`. ") +
             f"Validation: {ev['metric']} on {ev['problems']} held-out problems × {ev['samples']} samples. "
             f"Mean ± sample std over {over}; `auc` = area under the validation curve / step span (trapezoid rule); "
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
    if multi:
        lines += ["", f"Warm checkpoints: the mean step-0 evaluation differs across them by a std of "
                  f"{ev['start_std_over_warms']:.4f}.", "",
                  "## Means with hierarchical 95% CIs (the mean of the warm checkpoints' means)", "",
                  "| arm | " + " | ".join(stats.MEANS) + " |", "|" + "---|" * (len(stats.MEANS) + 1)]
        for arm, row in summary["means"].items():
            lines.append(f"| {arm} | " + " | ".join(
                "–" if row[m]["mean"] is None else f"{row[m]['mean']:.3f} {_ci_text(row[m], sign='')}"
                for m in stats.MEANS) + " |")
        records = {r["seed"]: r for r in summary.get("warmups", [])}
        per_warm_columns = ("start", "peak", "final", "min_after_peak", "auc", "collapsed")
        for w, part in summary["per_warm"].items():
            record = records.get(w)
            lines += ["", f"## Warm checkpoint {w} (warm-up seed {w})" + (
                f": {record['steps']} warm-up steps, calibration avg@4 {record['calibration_avg@4']:.3f}"
                if record else ""), "",
                "| arm | " + " | ".join(per_warm_columns) + " |", "|" + "---|" * (len(per_warm_columns) + 1)]
            for arm, row in part["table"].items():
                lines.append(f"| {arm} | " + " | ".join(_cell(row[c]) for c in per_warm_columns) + " |")
    header = ["| arm | metric | mean diff | 95% CI | " + ("runs | per warm | sign on every warm | " if multi else
                                                        "seeds | ") + "verdict |",
              "|---|---|---|---|---|" + ("---|---|" if multi else "") + "---|"]
    pairing = "same warm checkpoint and seed" if multi else "same seed"
    for name in ("primary", "secondary"):
        if summary.get(name):
            lines += ["", f"## {name.capitalize()} comparisons ({pairing}, shared validation steps)", "", *header]
            for entry in summary[name]:
                lines += _comparison_rows(f"{entry['arm']} − {entry['baseline']}", entry, stats.PRIMARY, multi)
    if summary.get("mechanism"):
        mode = summary["mechanism"][0]["mode"]
        lines += ["", f"## The general mode's final share: `{mode}` at the last validation, per validation set "
                  f"({pairing})", "", "| arm | validation set | mean diff | 95% CI | runs | " + (
                      "per warm | sign on every warm | " if multi else "") + "verdict |",
                  "|---|---|---|---|---|" + ("---|---|" if multi else "") + "---|"]
        for entry in summary["mechanism"]:
            for set_name, result in sorted(entry["sets"].items()):
                cells = [f"{entry['arm']} − {entry['baseline']}", set_name, f"{result['mean']:+.3f}",
                         _ci_text(result), str(result["n"])]
                if multi:
                    agree = result["sign_holds_on_every_warm"]
                    cells += [" / ".join(f"{v:+.3f}" for v in result["per_warm"].values()) or "–",
                              "–" if agree is None else ("yes" if agree else "no")]
                lines.append("| " + " | ".join(cells + [result["verdict"]]) + " |")
    if summary.get("anchor_diagnostic"):
        modes = list(dict.fromkeys(m for d in summary["anchor_diagnostic"].values() for m in d["anchor_modes"]))
        lines += ["", "## Anchor mode diagnostic (anchor_mode_classifier): each mode's share among the anchors / among "
                  "the on-policy rows of the groups the gate kept (mean over rounds, then runs); kept anchors per "
                  "logged step and their mean advantage", "",
                  "| arm | runs | " + " | ".join(f"{m}: anchors / on-policy" for m in modes)
                  + " | kept anchors per log | kept anchors' advantage |", "|" + "---|" * (len(modes) + 4)]
        for arm, d in summary["anchor_diagnostic"].items():
            cells = [f"{d['anchor_modes'].get(m) or 0:.3f} / {d['policy_modes'].get(m) or 0:.3f}" for m in modes]
            adv = d["kept_anchor_advantage"]
            lines.append(f"| {arm} | {d['runs']} | " + " | ".join(cells) + f" | {d['anchors_kept']:.1f} | "
                         + ("–" if adv is None else f"{adv:+.3f}") + " |")
    for base, by_arm in summary["comparisons"].items():
        lines += ["", f"## Paired differences: arm − {base} ({pairing}, shared validation steps)", "", *header]
        for arm, comparison in by_arm.items():
            lines += _comparison_rows(arm, comparison, comparison["metrics"], multi)
    if multi:
        lines += ["", f"Confidence intervals: hierarchical percentile bootstrap ({summary['resamples']} resamples, "
                  "seeded): warm checkpoints drawn with replacement, then seeds within each drawn one; the estimate "
                  "is the mean of the warm checkpoints' means. `per warm`: the mean difference on each warm "
                  "checkpoint; `sign on every warm`: every one of them has the overall mean's (non-zero) sign. With "
                  f"{len(summary['per_warm'])} warm checkpoints the interval knows the warm-up's variance only "
                  "from those few: a finding that holds on every warm checkpoint is the stronger statement."]
    else:
        lines += ["", f"Confidence intervals: percentile bootstrap of the mean paired difference over seeds "
                  f"({summary['resamples']} resamples, seeded). With few seeds it is narrow and optimistic: it never "
                  "extends beyond the smallest and largest per-seed difference (with 3 seeds it is exactly that "
                  "range), so 'higher'/'lower' then means only that every seed agreed."]
    if summary.get("at_points"):
        names = list(dict.fromkeys(n for rows in summary["at_points"].values() for n in rows))
        lines += ["", "## pass@j and mode shares at each run's start / validation peak / end (held-out unless a set is named; mean over "
                  "runs)", "", "| arm | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
        for arm, rows in summary["at_points"].items():
            lines.append(f"| {arm} | " + " | ".join(
                " / ".join(f"{rows[n][p]:.3f}" if p in rows.get(n, {}) else "–" for p in POINTS) for n in names) + " |")
    if summary.get("criterion"):
        c = summary["criterion"]
        lines += ["", f"## The plain-GRPO criterion ({c['arm']}): at least {c['min_collapsed']} runs collapse and the "
                  f"held-out share of `{c['general_mode']}` falls, on at least {c['min_warm_checkpoints']} warm "
                  f"checkpoints: " + ({True: "met", False: "NOT met"}.get(c["met"], "not judged here (fewer runs or "
                                              "warm checkpoints than it counts)"))
                  + f" ({c['warm_checkpoints_met']} of {len(c['per_warm'])})", "", f"| warm checkpoint | collapsed | {c['general_mode']} share start → "
                  "end | met |", "|---|---|---|---|"]
        for w, row in c["per_warm"].items():
            lines.append(f"| {w} | {row['collapsed']}/{row['runs']} | {row['share_start']:.3f} → "
                         f"{row['share_end']:.3f} | {'yes' if row['met'] else 'no'} |")
    for alias, choice in (summary.get("selection") or {}).items():
        scores = ", ".join(f"{arm} {score['mean']:.3f}" for arm, score in choice["scores"].items()
                           if score["mean"] is not None)
        lines += ["", f"`{alias}` = `{choice['chosen']}`: the best mean {choice['metric']} among {choice['among']} "
                  f"on tuning seeds {choice['tuning_seeds']} (never reporting seeds): {scores}."]
    lines += ["", f"{summary['runs_executed']} run(s) executed now ({summary['workers']} worker(s)), "
              f"{summary['wall_time_s']:.0f} s."]
    if summary.get("run_time_s") is not None:
        runs = sum(len(s) for s in summary["per_run"].values()) if not multi else sum(
            len(seeds) for by_warm in summary["per_run"].values() for seeds in by_warm.values())
        lines[-1] += (f" All {runs} runs took {summary['run_time_s']:.0f} "
                      "s of run time in all (each run's own wall time, summed; parallel runs overlap).")
    if summary.get("warmups") and not multi:
        record = summary["warmups"][0]
        lines[-1] += (f" Warm checkpoint: warm-up seed {record['seed']}, {record['steps']} steps, calibration avg@4 "
                      f"{record['calibration_avg@4']:.3f} (target {record['target_accuracy']}).")
    if summary.get("machine"):
        m, times = summary["machine"], [r["wall_time_s"] for r in summary.get("runs", []) if r["wall_time_s"]]
        lines += ["", f"Machine: {m['cpu_model']}, {m['cpu_cores']} cores, {m['torch_threads_per_run']} torch "
                  f"thread(s) per run" + (f"; run wall time {statistics.fmean(times):.0f} s on average "
                                          f"({min(times):.0f}–{max(times):.0f} s, {len(times)} runs)." if times else ".")]
    git = summary.get("git") or {}
    if git.get("commit"):
        lines[-1] += f" Code: commit {git['commit'][:12]}{' (with uncommitted changes)' if git['uncommitted_changes'] else ''}."
    if git.get("preregistration"):
        reg = git["preregistration"]
        lines[-1] += (f" Pre-registration: `{reg['file']}` at commit {reg['commit'] or '(none: not committed)'}"
                      f"{' (with uncommitted changes)' if reg['uncommitted_changes'] else ''}.")
    return "\n".join(lines) + "\n"


# --- plots -------------------------------------------------------------------------------------------------------
def _zero_filled(series_by_mode: dict, mode: str) -> list[tuple[int, float]]:
    """``mode``'s share at every step where any mode was logged (a round with rows of that kind), 0 where ``mode``
    had none: a share not logged in a round is a share of 0, not a missing value."""
    values = dict(series_by_mode.get(mode, []))
    return [(step, values.get(step, 0.0)) for step in sorted({s for curve in series_by_mode.values() for s, _ in curve})]


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
            "armor-trl[experiments] (in a clone: pip install '.[experiments]'; for a wheel, [experiments] after its "
            "path)."
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
        ("start_kl.png", [("kl_reverse_start", "reverse KL(π_θ‖π_0), policy samples, held-out prompts", 1),
                          ("kl_forward_start", "forward KL(π_0‖π_θ), samples of the start model", 1)]),
    ):
        if filename == "start_kl.png" and not any(c.get("kl_reverse_start") for runs in curves.values()
                                                  for c in runs.values()):
            continue  # val_kl_prompts was off
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
    modes = list(dict.fromkeys(m for runs in curves.values() for c in runs.values() for m in c.get("modes", {})))
    if modes:  # modes.png: each mode's share of the held-out samples (val_mode_classifier)
        fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.8), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            for i, (arm, runs) in enumerate(curves.items()):
                band = _band([c["modes"][mode] for c in runs.values() if c.get("modes", {}).get(mode)], 1)
                if band is not None:
                    steps, mean, std = band
                    ax.plot(steps, mean, color=colors(i), label=arm)
                    ax.fill_between(steps, mean - std, mean + std, color=colors(i), alpha=0.2)
            ax.set(title=f"held-out share: {mode}", xlabel="step", ylim=(0, 1))
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "modes.png", dpi=110)
        plt.close(fig)
    anchor_modes = list(dict.fromkeys(m for runs in curves.values() for c in runs.values()
                                      for m in (*c.get("anchor_modes", {}), *c.get("policy_modes", {}))))
    if anchor_modes:  # anchor_modes.png: the anchor mode diagnostic (anchor_mode_classifier), ARMOR arms only
        fig, axes = plt.subplots(1, len(anchor_modes), figsize=(4.2 * len(anchor_modes), 3.8), squeeze=False)
        for ax, mode in zip(axes[0], anchor_modes):
            for i, (arm, runs) in enumerate(curves.items()):
                for key, style, label in (("anchor_modes", "-", "anchors"), ("policy_modes", "--", "on-policy")):
                    band = _band([_zero_filled(c[key], mode) for c in runs.values() if c.get(key)], smooth)
                    if band is not None:
                        steps, mean, _ = band
                        ax.plot(steps, mean, style, color=colors(i), label=f"{arm}: {label}")
            ax.set(title=f"kept groups' share: {mode}", xlabel="step", ylim=(0, 1))
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "anchor_modes.png", dpi=110)
        plt.close(fig)
