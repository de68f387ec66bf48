"""The plan of ``armor-trl study``: its arms (the arms file and the recipe's ``study:`` section), the arms chosen on
tuning seeds (``select:``, with edge extensions) and the arms composed from chosen ones (``compose:``), seeds,
comparisons, the criterion, and the checks made before anything trains; :func:`select_best` chooses on the tuning
runs' results."""

from __future__ import annotations

import itertools
import json
import os
import statistics
from pathlib import Path

from armor_trl.app.experiments import stats
from armor_trl.app.experiments.runner import alpha_of, override_flags, read_curves, resolve_overrides
from armor_trl.app.recipe.loading import read_json, read_yaml

STUDY_KEYS = ("arms", "default_arms", "seeds", "warmup_seeds", "tuning_seeds", "primary", "secondary", "select",
              "compose", "criterion", "mechanism_mode")
CRITERION_KEYS = ("arm", "general_mode", "min_collapsed", "min_warm_checkpoints")  # `study: criterion:`
SELECT_METRIC = "final"  # a select: alias picks the arm with the best mean of this on the tuning seeds
COMPOSE_KEYS = ("base", "take", "lr_scale_alpha_of")
# the repository's configs/ (a clone or an editable install), else the copy a wheel ships as armor_trl/configs
CONFIGS = next((path for path in (Path(__file__).resolve().parents[3] / "configs",
                                  Path(__file__).resolve().parents[2] / "configs") if path.is_dir()),
               Path(__file__).resolve().parents[3] / "configs")
DEFAULT_CONFIG = CONFIGS / "tiny_demo.yaml"
DEFAULT_ARMS_FILE = CONFIGS / "study" / "arms.yaml"


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
    """``{alias: {"among": [arms], "metric": m, "extend": {arm: [arms]}}}`` from the study section's ``select:``
    (an alias maps to a list of arms, or to ``{among: [...], metric: m, extend: {...}}``; m is one of
    stats.COMPARED, default :data:`SELECT_METRIC`). ``extend``, a rule fixed before anything runs: when the arm on
    the left is chosen (an edge of the grid), the arms on the right join the candidates, run on the tuning seeds, and
    the choice is made again (an added arm may have an extension of its own)."""
    select = section.get("select") or {}
    if not isinstance(select, dict):
        raise ValueError(f"study.select must map alias: [arms], got {select!r}.")
    out = {}
    for alias, spec in select.items():
        spec = {"among": spec} if isinstance(spec, list) else spec
        if (not isinstance(spec, dict) or set(spec) - {"among", "metric", "extend"}
                or not isinstance(spec.get("among"), list) or not spec["among"]):
            raise ValueError(f"study.select.{alias} must be a list of arms or {{among: [arms], metric: M, extend: "
                             f"{{arm: [arms]}}}}, got {spec!r}.")
        if alias in arms:
            raise ValueError(f"study.select alias {alias!r} is also an arm's name; rename one of them.")
        unknown = [a for a in spec["among"] if a not in arms]
        if unknown:
            raise ValueError(f"study.select.{alias} names unknown arm(s) {unknown}; known arms: {', '.join(arms)}.")
        metric = spec.get("metric", SELECT_METRIC)
        if metric not in stats.COMPARED:
            raise ValueError(f"study.select.{alias}.metric must be one of {list(stats.COMPARED)}, got {metric!r}.")
        extend = spec.get("extend") or {}
        if not isinstance(extend, dict) or any(not isinstance(v, list) for v in extend.values()):
            raise ValueError(f"study.select.{alias}.extend must map an arm to the list of arms that join when it is "
                             f"chosen, got {extend!r}.")
        unknown = [a for edge, added in extend.items() for a in (edge, *added) if a not in arms]
        if unknown:
            raise ValueError(f"study.select.{alias}.extend names unknown arm(s) {unknown}; known arms: "
                             f"{', '.join(arms)}.")
        out[alias] = {"among": list(dict.fromkeys(spec["among"])), "metric": metric,
                      "extend": {edge: list(added) for edge, added in extend.items()}}
    return out


def candidates_of(spec: dict) -> list[str]:
    """Every arm a ``select:`` alias may run on the tuning seeds: its grid, then every extension."""
    return list(dict.fromkeys([*spec["among"], *(a for added in spec["extend"].values() for a in added)]))


def load_compositions(section: dict, arms: dict, selection: dict) -> dict:
    """``{name: {"base": a, "take": {field: a}, "lr_scale_alpha_of": a}}`` from the study section's ``compose:``:
    an arm built from other arms or ``select:`` aliases once they are chosen. ``base``: the arm whose overrides it
    starts from; ``take``: fields copied from another arm (e.g. the tuned KL's ``beta`` onto tuned ARMOR);
    ``lr_scale_alpha_of``: learning rate × that arm's α (GRPO at lr × the tuned ARMOR's α)."""
    compose = section.get("compose") or {}
    if not isinstance(compose, dict):
        raise ValueError(f"study.compose must map name: {{base: arm, take: {{field: arm}}}}, got {compose!r}.")
    known = [*arms, *selection]
    out = {}
    for name, spec in compose.items():
        if not isinstance(spec, dict) or "base" not in spec or set(spec) - set(COMPOSE_KEYS):
            raise ValueError(f"study.compose.{name} must be a mapping with base: and optionally take: / "
                             f"lr_scale_alpha_of:, got {spec!r}.")
        if name in known:
            raise ValueError(f"study.compose name {name!r} is also an arm's or a select: alias's name; rename it.")
        take = spec.get("take") or {}
        if not isinstance(take, dict):
            raise ValueError(f"study.compose.{name}.take must map field: arm, got {take!r}.")
        unknown = [a for a in sources_of({"take": take, "lr_scale_alpha_of": None, **spec}) if a not in known]
        if unknown:
            raise ValueError(f"study.compose.{name} names unknown arm(s) {unknown}; known: {', '.join(known)}.")
        out[name] = {"base": spec["base"], "take": dict(take), "lr_scale_alpha_of": spec.get("lr_scale_alpha_of")}
    return out


def compose_arm(spec: dict, arm_of, arms: dict, recipe: dict) -> dict:
    """The overrides of a composed arm, with ``arm_of`` naming the arm each source stands for (a chosen arm for a
    ``select:`` alias)."""
    overrides = dict(arms[arm_of(spec["base"])])
    for field, source in spec["take"].items():
        merged = {**recipe, **arms[arm_of(source)]}
        if field in merged:
            overrides[field] = merged[field]
        else:
            overrides.pop(field, None)
    if spec["lr_scale_alpha_of"] is not None:
        overrides["lr_scale"] = alpha_of({**recipe, **arms[arm_of(spec["lr_scale_alpha_of"])]})
    return overrides


def sources_of(spec: dict) -> list[str]:
    """The arms and aliases a composed arm is built from."""
    return list(dict.fromkeys([spec["base"], *spec["take"].values(),
                               *([spec["lr_scale_alpha_of"]] if spec["lr_scale_alpha_of"] else [])]))


def every_composition(spec: dict, selection: dict, arms: dict, recipe: dict) -> list[dict]:
    """The composed arm's overrides for every choice its ``select:`` sources could make (checked before anything
    trains, so that no choice leads to an arm that cannot run)."""
    sources = sources_of(spec)
    options = [candidates_of(selection[s]) if s in selection else [s] for s in sources]
    return [compose_arm(spec, dict(zip(sources, pick)).__getitem__, arms, recipe) for pick in itertools.product(*options)]


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


DEMO_ONLY_KEYS = ("arms", "seeds", "overrides", "smoke")  # demo: keys that shape `armor-trl demo` and its smoke version


def runs_recipe(recipe: dict | None) -> dict:
    """What of a study's recipe shapes its runs: all but the ``study:`` section, :data:`DEMO_ONLY_KEYS` and an unset
    ``model_name_or_path`` (the warm start fills it in; the plan's ``model`` is compared on its own)."""
    recipe = {k: v for k, v in (recipe or {}).items()
              if k != "study" and not (k == "model_name_or_path" and v is None)}
    if isinstance(recipe.get("demo"), dict):
        recipe["demo"] = {k: v for k, v in recipe["demo"].items() if k not in DEMO_ONLY_KEYS}
    return recipe


def _model_key(model):
    """What names a model across machines: a warm checkpoint by its cache key (``warm-<hash of its settings>``), not
    by the cache folder it sits in (a study folder copied elsewhere has its cache elsewhere); any other by its path."""
    return Path(model).name if isinstance(model, str) and Path(model).name.startswith("warm-") else model


def check_study_folder(out: Path, plan: dict) -> None:
    """A study folder is reused only for the same recipe and the same definition of every arm it already ran."""
    record = out / "study.json"
    plan = json.loads(json.dumps(plan))  # as study.json holds it: a YAML mapping's int keys become strings
    if not record.is_file():
        record.write_text(json.dumps(plan, indent=2))
        return
    earlier = read_json(str(record))
    models = plan["model"]
    if isinstance(earlier.get("model"), dict) and isinstance(models, dict):  # warm checkpoints by warm-up seed:
        # more warm-up seeds may join a folder; those it has must name the same checkpoints
        same = {"model": all(_model_key(earlier["model"].get(w, path)) == _model_key(path)
                             for w, path in models.items())}
        models = {**earlier["model"], **models}
    else:
        same = {"model": _model_key(earlier.get("model")) == _model_key(models)}
    # the recipe's study: section says which runs to make and how to report them, not how a run trains (its arms
    # are compared one by one below), so a study may gain comparisons or a criterion and keep its runs; so do the
    # demo section's settings for `armor-trl demo` alone (DEMO_ONLY_KEYS; its warm-up and model stay compared)
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


def run_name(arm: str, seed: int, warm: int | None = None) -> str:
    """``<arm>-seed<s>``, or ``<arm>-warm<w>-seed<s>`` in a study of several warm checkpoints."""
    return f"{arm}-seed{seed}" if warm is None else f"{arm}-warm{warm}-seed{seed}"


def metrics_path(out: Path, arm: str, seed: int, warm: int | None = None) -> Path:
    return out / "metrics" / f"{run_name(arm, seed, warm)}.jsonl"
