"""What the demo and the study share: reading an experiment recipe, the warm-started tiny model, and one training
run of a recipe with overrides, whose metrics are written as JSONL (atomically: the file exists only once the run
has finished) and read back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import time
import warnings
from pathlib import Path

from armor_trl.app.recipe.build import build_trainer
from armor_trl.app.recipe.loading import load_recipe, read_json, read_jsonl
from armor_trl.app.recipe.parsing import parse_train_args

VAL_KEY_PREFIX = "val/avg@"
OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY")
LR_SCALE_KEY = "lr_scale"  # not a training field: learning_rate × this (a number, or "alpha")


def go_offline() -> None:
    for name in OFFLINE_ENV:
        os.environ.setdefault(name, "1")


def read_recipe(config: str | os.PathLike, section: str | None = None) -> tuple[str, dict]:
    """(path, recipe) with ``base:`` resolved; a ValueError when the file is missing or lacks ``section``."""
    path = Path(config)
    if not path.is_file():
        raise ValueError(f"Recipe {path} not found: pass --config path/to/recipe.yaml.")
    recipe = load_recipe(str(path))
    if section is not None and section not in recipe:
        raise ValueError(f"{path} has no '{section}:' section, so it is not a {section} recipe.")
    return str(path), recipe


def smoke_version(recipe: dict) -> tuple[dict, dict]:
    """(demo settings, recipe overrides) of the recipe's ``demo.smoke`` section: a version that runs in seconds."""
    settings = dict(recipe.get("demo", {}))
    smoke = settings.pop("smoke", {}) or {}
    settings.update({k: v for k, v in smoke.items() if k != "overrides"})
    return settings, dict(smoke.get("overrides", {}))


def resolve_overrides(overrides: dict, recipe: dict) -> dict:
    """Training overrides of one arm; ``lr_scale`` becomes ``learning_rate`` (``"alpha"``: ARMOR's α, which is
    ``armor_alpha`` or (G − anchors_per_group)/G, since the mixture scales on-policy steps by about α)."""
    overrides = dict(overrides)
    scale = overrides.pop(LR_SCALE_KEY, None)
    if scale is None:
        return overrides
    if scale == "alpha":
        scale = alpha_of({**recipe, **overrides})
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        raise ValueError(f"{LR_SCALE_KEY} must be a positive number or 'alpha', got {scale!r}.")
    overrides["learning_rate"] = {**recipe, **overrides}["learning_rate"] * scale
    return overrides


def alpha_of(settings: dict) -> float:
    """ARMOR's α under ``settings`` (a recipe with an arm's overrides): ``armor_alpha``, else (G − anchors)/G."""
    g = settings["num_generations"]
    return settings.get("armor_alpha") or (g - settings.get("anchors_per_group", 1)) / g


def override_flags(overrides: dict) -> list[str]:
    flags = []
    for key, value in overrides.items():
        flags += [f"--{key}", json.dumps(value) if isinstance(value, (list, dict)) else str(value)]
    return flags


# --- the warm-started tiny model ----------------------------------------------------------------------------------
def cached_warm_checkpoint(cache_dir: Path, model: dict, warm: dict, task: dict,
                           progress=None, stored: Path | None = None) -> tuple[Path, dict | None]:
    """(the cache folder of the warm checkpoint that ``model``, ``warm`` and ``task`` shape, its warm-up record or None
    when it is not built yet). ``stored``: a copy of that checkpoint (a study folder's ``warm/``), restored into an
    empty cache instead of building it again: another CPU would build other weights."""
    key = json.dumps({"model": model, "warmup": warm, "task": task}, sort_keys=True)
    path = cache_dir / f"warm-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if not (path / "warmup.json").is_file() and stored is not None and (stored / "warmup.json").is_file():
        from armor_trl.app.experiments.warm_checkpoints import copy_folder

        copy_folder(stored, path)
    if not (path / "warmup.json").is_file():
        return path, None
    if progress is not None:
        progress.set_description_str("warm-up: cached")
    return path, read_json(str(path / "warmup.json"))


def warm_start(recipe: dict, settings: dict, cache_dir: Path, progress=None,
               stored: Path | None = None) -> tuple[str, dict]:
    """The warm-started tiny model and a record of its warm-up, built once and cached under ``cache_dir`` by a hash
    of everything that shapes it.

    Supervised training on addition problems disjoint from the recipe's RL and held-out problems, stopped as soon
    as the sampled accuracy on a separate calibration set reaches ``warmup.target_accuracy`` (checked every
    ``warmup.check_every`` steps; at most ``warmup.steps``). Stopping on accuracy rather than after a fixed
    number of steps keeps the start point of RL comparable: this task is learnt in a sudden jump whose timing
    varies with every detail.

    With ``warmup.modes`` (e.g. ``{worked: 0.5, direct: 0.5}``, :data:`armor_trl.rewards.modes.MODES`) each training row is
    written in a mode drawn with these weights (:func:`armor_trl.rewards.modes.mode_text`), and calibration runs on
    held-out-like problems (``arithmetic_eval_filter``) with :func:`armor_trl.rewards.final_integer_reward` and room
    for the worked mode; the record adds the calibration samples' mode shares.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from armor_trl.data.datasets import ARITHMETIC_FILTERS, arithmetic_carry_mix_pools, arithmetic_problems, arithmetic_splits
    from armor_trl.callbacks.evaluation import evaluate
    from armor_trl.rewards.modes import classify, max_completion_chars, mode_text, parse_problem
    from armor_trl.rewards import exact_integer_reward, final_integer_reward
    from armor_trl.app.tiny import build_tiny_model

    warm = settings["warmup"]
    if warm.get("kind") == TOOL_AGENT:
        return warm_start_tool_agent(recipe, settings, cache_dir, progress, stored)
    mix = warmup_modes(warm.get("modes"))
    task = {k: recipe[k] for k in ("arithmetic_train_size", "arithmetic_eval_size", "arithmetic_digits",
                                   "arithmetic_seed")}
    for name in ("arithmetic_train_filter", "arithmetic_eval_filter"):
        if recipe.get(name):  # only when set, so earlier cached checkpoints keep their keys
            task[name] = recipe[name]
    if recipe.get("arithmetic_train_carry_share") is not None:
        # the carry-mix variant: the warm-up reserves both training pools, so one warm checkpoint serves every share
        task["arithmetic_train_carry_pools"] = True
    path, cached = cached_warm_checkpoint(cache_dir, settings["tiny_model"], warm, task, progress, stored)
    if cached is not None:
        return str(path), cached

    rl_train, held_out = arithmetic_splits(task["arithmetic_train_size"], task["arithmetic_eval_size"],
                                           task["arithmetic_seed"], task["arithmetic_digits"],
                                           train_filter=task.get("arithmetic_train_filter"),
                                           eval_filter=task.get("arithmetic_eval_filter"))
    reserved = set(rl_train["prompt"]) | set(held_out["prompt"])
    if task.get("arithmetic_train_carry_pools"):
        pools = arithmetic_carry_mix_pools(task["arithmetic_train_size"], task["arithmetic_seed"],
                                           task["arithmetic_digits"], [(p, None) for p in held_out["prompt"]],
                                           task.get("arithmetic_train_filter"))
        reserved |= {p for pool in pools for p, _ in pool}
    # the draw is sequential, so the first num_problems are the same with or without the calibration problems
    problems = arithmetic_problems(warm["num_problems"] + (0 if mix else warm["calibration_size"]), warm["seed"],
                                   task["arithmetic_digits"], exclude=reserved)
    if mix:  # calibrate on problems like the held-out ones, where the modes differ
        calibration = arithmetic_problems(warm["calibration_size"], f"{warm['seed']}-calibration",
                                          task["arithmetic_digits"], exclude=reserved | {p for p, _ in problems},
                                          keep=ARITHMETIC_FILTERS.get(task.get("arithmetic_eval_filter")))
    else:
        problems, calibration = problems[: warm["num_problems"]], problems[warm["num_problems"]:]
    verifier, max_new_tokens = ((final_integer_reward, max_completion_chars(task["arithmetic_digits"])) if mix
                                else (exact_integer_reward, 5))
    calibration = Dataset.from_dict({"prompt": [p for p, _ in calibration], "answer": [a for _, a in calibration]})

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f"{path.name}.tmp-{os.getpid()}"
    build_tiny_model(tmp, **settings["tiny_model"])
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp)
    torch.manual_seed(warm["seed"])
    rng = random.Random(warm["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=warm["learning_rate"], weight_decay=0.0)
    def encode(prompt, answer):  # loss on the answer and end-of-sequence tokens only
        prompt_ids = tokenizer(prompt)["input_ids"]
        answer_ids = tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id]
        return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids

    encoded = [encode(prompt, answer) for prompt, answer in problems]
    if mix:
        written = {mode: [encode(p, mode_text(mode, *parse_problem(p))) for p, _ in problems] for mode in mix}

    def row():  # the plain task draws exactly as before (cached checkpoints stay valid)
        i = rng.randrange(len(encoded))
        return written[rng.choices(list(mix), weights=list(mix.values()))[0]][i] if mix else encoded[i]

    accuracy, step, result = 0.0, 0, {}
    while step < warm["steps"] and accuracy < warm["target_accuracy"]:
        model.train()
        batch = [row() for _ in range(warm["batch_size"])]
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
            result = evaluate(model, tokenizer, calibration, verifier, k=4, max_new_tokens=max_new_tokens,
                              batch_size=1024, seed=warm["seed"], classify=classify if mix else None)
            accuracy = result["avg@4"]
            if progress is not None:
                progress.set_postfix_str(f"calibration avg@4 {accuracy:.3f} (target {warm['target_accuracy']})")
    if progress is not None:  # stopped at the target accuracy
        progress.total = step
        progress.refresh()
    record = {"steps": step, "calibration_avg@4": accuracy, "target_accuracy": warm["target_accuracy"]}
    if mix:
        record["calibration_modes"] = result.get("mode_shares")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "warmup.json").write_text(json.dumps(record))
    if path.exists():  # another process cached the same checkpoint meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, path)
    return str(path), record


TOOL_AGENT = "tool_agent"  # demo.warmup.kind of the tool-use testbed (armor_trl.app.tool_testbed.build_tool_agent)
TOOL_AGENT_KEYS = ("steps", "batch_size", "learning_rate", "digits", "wrong_name_share", "direct_share", "retry_share")


def warm_start_tool_agent(recipe: dict, settings: dict, cache_dir: Path, progress=None,
                          stored: Path | None = None) -> tuple[str, dict]:
    """The warm-started tiny tool agent (:func:`armor_trl.app.tool_testbed.build_tool_agent`) of ``demo.warmup``
    (``kind: tool_agent``, ``seed`` and :data:`TOOL_AGENT_KEYS`; ``demo.tiny_model``'s size), on problems that exclude
    the recipe's held-out ones; cached under ``cache_dir`` like :func:`warm_start`. A fixed number of steps: the
    agent's start point is measured by the runs' own validation at step 0."""
    from armor_trl.app.tool_testbed import build_tool_agent
    from armor_trl.data.datasets import arithmetic_splits

    warm = settings["warmup"]
    if unknown := sorted(set(warm) - {"kind", "seed", *TOOL_AGENT_KEYS}):
        raise ValueError(f"demo.warmup (kind {TOOL_AGENT}) takes {['seed', *TOOL_AGENT_KEYS]}, not {unknown}.")
    model = settings["tiny_model"]
    task = {k: recipe.get(k) for k in ("arithmetic_train_size", "arithmetic_eval_size", "arithmetic_digits",
                                       "arithmetic_eval_digits", "arithmetic_seed")}
    path, cached = cached_warm_checkpoint(cache_dir, model, warm, task, progress, stored)
    if cached is not None:
        return str(path), cached
    _, held_out = arithmetic_splits(task["arithmetic_train_size"], task["arithmetic_eval_size"],
                                    task["arithmetic_seed"], task["arithmetic_digits"],
                                    eval_digits=task["arithmetic_eval_digits"])
    digits = warm.get("digits", task["arithmetic_digits"])
    if isinstance(digits, dict):
        digits = {int(d): float(w) for d, w in digits.items()}
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f"{path.name}.tmp-{os.getpid()}"
    shares = {k: warm[k] for k in ("wrong_name_share", "direct_share", "retry_share", "batch_size", "learning_rate")
              if k in warm}
    start = time.time()
    build_tool_agent(tmp, steps=warm["steps"], seed=warm["seed"], hidden_size=model.get("hidden_size", 64),
                     num_layers=model.get("num_layers", 2), digits=digits, exclude=set(held_out["prompt"]),
                     threads=None, **shares)
    if progress is not None:
        progress.update(warm["steps"])
    record = {"steps": warm["steps"], "kind": TOOL_AGENT, "warmup_wall_time_s": time.time() - start}
    (tmp / "warmup.json").write_text(json.dumps(record))
    if path.exists():
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, path)
    return str(path), record


def warmup_modes(modes) -> dict[str, float] | None:
    """The mode mix of ``demo.warmup.modes`` ({mode: weight}, weights >= 0 with a positive sum), None when unset."""
    from armor_trl.rewards.modes import MODES

    if modes is None:
        return None
    if (not isinstance(modes, dict) or not modes or set(modes) - set(MODES)
            or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in modes.values())
            or sum(modes.values()) <= 0):
        raise ValueError(f"demo.warmup.modes must map modes of {list(MODES)} to weights >= 0 with a positive sum, "
                         f"e.g. {{worked: 0.5, direct: 0.5}}; got {modes!r}.")
    return {mode: float(weight) for mode, weight in modes.items() if weight > 0}


@contextlib.contextmanager
def quiet_single_thread():
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


# --- one run ---------------------------------------------------------------------------------------------------
def train_run(config_path: str, overrides: dict, seed: int, model_path: str, output_dir: Path, metrics_file: Path,
              tags: dict, callbacks=()) -> dict:
    """Train the recipe with ``overrides`` (training fields, already resolved) from ``model_path``; write every
    logged record, tagged with ``tags``, to ``metrics_file`` (the warm checkpoint's validation first, as step 0)
    and return ``{"history", "validation", "wall_time"}``. The file appears only when the run has finished."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    argv = ["--config", config_path, "--model_name_or_path", model_path, "--seed", str(seed),
            "--output_dir", str(output_dir), *override_flags(overrides)]
    script_args, training_args, model_args, _ = parse_train_args(argv)
    start = time.time()
    trainer = build_trainer(script_args, training_args, model_args, callbacks=list(callbacks),
                            run_name=tags.get("run"))
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    trainer.train()
    wall = time.time() - start
    callback = next(cb for cb in trainer.callback_handler.callbacks if hasattr(cb, "history"))
    validation = callback.history
    history = [entry for entry in trainer.state.log_history if "train_runtime" not in entry]
    held_out = callback.eval_sets.get(None)
    size = {"val_problems": len(held_out), "val_samples": callback.num_samples} if held_out is not None else {}
    metrics_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = metrics_file.with_name(f".{metrics_file.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        for record in [{**validation[0], **size, "run_wall_time_s": wall}] + history:
            f.write(json.dumps({**tags, **record}) + "\n")
    os.replace(tmp, metrics_file)
    return {"history": history, "validation": validation, "wall_time": wall}


# --- reading a run back ------------------------------------------------------------------------------------------
def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(records: list[dict], *keys: str) -> list[tuple[int, float]]:
    """(step, value) of every record holding a finite value under the first of ``keys`` it has."""
    out = []
    for record in records:
        key = next((k for k in keys if k in record), None)
        if key is not None and _finite(record[key]):
            out.append((record["step"], float(record[key])))
    return out


TOOL_CALLED = "tool_called"  # the pseudo-mode of an agent's samples that called a tool TRL ran (val/tool_call_rate)


def named_set_modes(records: list[dict], keys: list[str]) -> dict:
    """{set name: {mode: series}} of the named validation sets' mode shares (``val/<set>/mode/<mode>``; an agent's
    ``val/<set>/tool_call_rate`` as the mode :data:`TOOL_CALLED`)."""
    sets = {}
    for key in keys:
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "val" and parts[2] == "mode":
            sets.setdefault(parts[1], {})[parts[3]] = series(records, key)
        elif len(parts) == 3 and parts[0] == "val" and parts[2] == "tool_call_rate":
            sets.setdefault(parts[1], {})[TOOL_CALLED] = series(records, key)
    return sets


def read_curves(metrics_file: Path) -> dict:
    """Validation accuracy (the held-out set's avg@k), on-policy training reward and the KL metrics of one run.

    Training reward: ``armor/policy_reward_mean`` (on-policy samples only) where logged, else TRL's ``reward``.
    Reverse KL: ``armor/kl_reverse_policy``, else TRL's ``kl`` (logged with β > 0). ``ref_weights_step``: the step
    whose policy weights π_ref held at each logged step (ARMOR runs)."""
    records = read_jsonl(str(metrics_file))  # a corrupt file is named, with its line
    val_key = next((k for r in records for k in r if k.startswith(VAL_KEY_PREFIX)), None)
    keys = sorted({k for r in records for k in r})
    if val_key is None:
        raise ValueError(f"{metrics_file} holds no validation ({VAL_KEY_PREFIX}k): set val_every_steps > 0.")
    return {
        "val_key": val_key,
        "val": series(records, val_key),
        "train": series(records, "armor/policy_reward_mean", "reward"),
        "kl_reverse": series(records, "armor/kl_reverse_policy", "kl"),
        "kl_forward": series(records, "armor/kl_forward_anchor"),
        "anchors_found": [v for _, v in series(records, "armor/anchor_found_frac")],
        "ref_weights_step": series(records, "armor/ref_weights_step"),
        "val_problems": records[0].get("val_problems"),
        "val_samples": records[0].get("val_samples"),
        "wall_time_s": records[0].get("run_wall_time_s"),  # training and validation of the run (None: older file)
        # KL to the starting model (val_kl_prompts), the held-out set's mode shares (val_mode_classifier) and its
        # pass@j curve: {} / [] where not logged
        "kl_reverse_start": series(records, "val/kl_reverse_start"),
        "kl_forward_start": series(records, "val/kl_forward_start"),
        # an agent's held-out tool-call rate (val/tool_call_rate, the share of samples that called a tool TRL ran)
        # reads as the share of the mode TOOL_CALLED
        "modes": {**{k.removeprefix("val/mode/"): series(records, k) for k in keys if k.startswith("val/mode/")},
                  **({TOOL_CALLED: series(records, "val/tool_call_rate")} if "val/tool_call_rate" in keys else {})},
        # the named val_datasets' mode shares ({set: {mode: series}}, e.g. train_carry's), and the anchor mode
        # diagnostic (anchor_mode_classifier): the modes of the anchors and of the on-policy rows in the kept groups
        "set_modes": named_set_modes(records, keys),
        "set_val": {k.split("/")[1]: series(records, k) for k in keys
                    if k.count("/") == 2 and k.startswith("val/") and k.split("/")[2].startswith("avg@")},
        "anchor_modes": {k.removeprefix("armor/anchor_mode/"): series(records, k) for k in keys
                         if k.startswith("armor/anchor_mode/")},
        "policy_modes": {k.removeprefix("armor/policy_mode/"): series(records, k) for k in keys
                         if k.startswith("armor/policy_mode/")},
        "anchors_kept": series(records, "armor/anchors_kept"),
        "kept_anchor_advantage": series(records, "armor/kept_anchor_advantage_mean"),
        "pass": {int(k.removeprefix("val/pass@")): series(records, k) for k in keys
                 if k.startswith("val/pass@") and k.removeprefix("val/pass@").isdigit()},
    }
