"""The GPU study: `armor-trl study`'s comparison (grpo, grpo_small_lr, grpo_kl_0.04, armor by default, with paired
statistics) on a real small instruct model and GSM8K, on one GPU, offline (docs/gpu_study.md).

    scripts/gpu_study.sh --model DIR --train FILE --test FILE [--wheelhouse DIR] [--output_dir DIR] [--seeds N] [--dry_run]

Model and data come from local paths only (no network: the hub is switched off). With --wheelhouse the project and
what the machine lacks are installed from that folder (`make wheelhouse`) with pip --no-index first. The study
itself is armor_trl.app.experiments.study.run_study on the recipe (configs/gpu_study_gsm8k.yaml by default) with the
paths filled in, written to <output_dir>/gpu_study_recipe.yaml; it writes what `armor-trl study` writes (summary.md,
summary.json, curves.png, kl.png, metrics/<arm>-seed<s>.jsonl) plus environment.jsonl (GPU, versions; a line per
start). A rerun of
the same command skips finished runs. --dry_run checks everything (arguments, paths, CUDA aside, the data's
schema, the recipe, every arm parsed as `armor-trl train` would) without loading weights, prints the plan and
writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's armor_trl (the configs below are this checkout's too)
sys.path.insert(1, str(REPO / "scripts"))

from wheelhouse import WheelhouseError, ensure_dependencies  # noqa: E402  (standard library only)

DEFAULT_CONFIG = REPO / "configs" / "gpu_study_gsm8k.yaml"
ARMS_FILE = REPO / "configs" / "study" / "arms.yaml"  # explicit: this checkout's arms, whichever wheel is installed
DEFAULT_OUT = "results/gpu_study"
MAX_WORKERS = 8  # runs at once on the one GPU: ~10-12 GB each by the recipe's estimate, ~100 GB of 141
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


class InputError(Exception):
    """Bad input: the message names the flag and what is allowed."""


class EnvironmentProblem(Exception):
    """The machine cannot run the study (no CUDA, missing packages)."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


class DeprecatedOut(argparse.Action):
    """--out, the earlier name of --output_dir (the armor-trl commands' name): still accepted, with a warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not getattr(namespace, "_warned_out", False):
            print(f"{parser.prog}: warning: {option_string} is deprecated and will be removed; use --output_dir.",
                  file=sys.stderr)
            namespace._warned_out = True
        setattr(namespace, self.dest, values)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="gpu_study.sh", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local folder of a Hugging Face model (config.json, "
                        "tokenizer, weights), e.g. a copy of Qwen2.5-0.5B-Instruct")
    parser.add_argument("--train", required=True, help="local GSM8K training file (.jsonl/.json/.parquet/.csv, "
                        "question + answer ending in '#### N'; MATH-style problem/answer files work too)")
    parser.add_argument("--test", required=True, help="local held-out file, same format (GSM8K's test split)")
    parser.add_argument("--wheelhouse", default=None, help="folder built by `make wheelhouse`: install the project "
                        "from it (pip --no-index) first")
    parser.add_argument("--output_dir", default=DEFAULT_OUT, help=f"study folder (default {DEFAULT_OUT}); rerunning "
                        "the same command there skips finished runs")
    parser.add_argument("--out", dest="output_dir", action=DeprecatedOut, help=argparse.SUPPRESS)
    parser.add_argument("--seeds", type=_positive_int, default=None, help="seeds per arm (default: the recipe's "
                        "study.seeds, 2)")
    parser.add_argument("--arms", default=None, help="comma-separated arms of configs/study/arms.yaml (default: the "
                        "recipe's study.default_arms)")
    parser.add_argument("--workers", type=_positive_int, default=None, help=f"runs at once on the GPU (default: "
                        f"all of them, at most {MAX_WORKERS})")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the recipe (default "
                        "configs/gpu_study_gsm8k.yaml; a variant may say `base: gpu_study_gsm8k.yaml`)")
    parser.add_argument("--dry_run", action="store_true", help="check and print the plan; no weights, no training")
    return parser.parse_args(argv)


# --- checks that need nothing installed ---------------------------------------------------------------------------
def check_paths(args) -> None:
    model = Path(args.model)
    if not model.is_dir():
        raise InputError(f"--model {args.model}: no such folder; pass the local folder of a Hugging Face model "
                         "(config.json, tokenizer files, *.safetensors), e.g. a copy of Qwen2.5-0.5B-Instruct.")
    if not (model / "config.json").is_file():
        raise InputError(f"--model {args.model}: no config.json there, so it is not a Hugging Face model folder "
                         "(expected config.json, tokenizer files and *.safetensors).")
    if not any(next(model.glob(p), None) for p in WEIGHT_PATTERNS):
        raise InputError(f"--model {args.model}: no weights there (*.safetensors or *.bin).")
    if not ((model / "tokenizer.json").is_file() or (model / "tokenizer_config.json").is_file()):
        raise InputError(f"--model {args.model}: no tokenizer there (tokenizer.json or tokenizer_config.json).")
    for flag, value in (("--train", args.train), ("--test", args.test)):
        path = Path(value)
        if not path.exists():
            raise InputError(f"{flag} {value}: no such file; pass a local .jsonl/.json/.parquet/.csv file.")
        if not path.is_file():
            raise InputError(f"{flag} {value}: a folder, not a file; pass one .jsonl/.json/.parquet/.csv file.")
        if not os.access(path, os.R_OK):
            raise InputError(f"{flag} {value}: not readable.")
        if path.stat().st_size == 0:
            raise InputError(f"{flag} {value}: empty file.")
    config = Path(args.config)
    if not config.is_file():
        raise InputError(f"--config {args.config}: no such recipe file.")


def go_offline() -> None:
    """Before transformers or datasets are imported: never reach for the hub (these machines have no network)."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
        os.environ[name] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # tokenizers + worker processes: no fork warnings
    # math_verify's worker processes per run (default 4): with 8 runs at once 2 each leave the CPUs to generation
    os.environ.setdefault("ARMOR_VERIFIER_WORKERS", "2")


def check_cuda() -> dict:
    try:
        import torch
    except ImportError as error:
        raise EnvironmentProblem(f"torch is not importable ({error}); the GPU image provides it.") from error
    if not torch.cuda.is_available():
        raise EnvironmentProblem(f"no CUDA device visible (torch {torch.__version__}, CUDA build "
                                 f"{torch.version.cuda}): run on a GPU machine, or pass --dry_run to check the "
                                 "inputs only.")
    return {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}


# --- the plan (armor_trl importable from here on) -------------------------------------------------------------------
def _rows(flag: str, path: str, recipe: dict, limit: int | None) -> dict:
    """Load a data file as `armor-trl train` will (schema detected, prompts written); errors name the flag."""
    import datasets
    from datasets import load_dataset

    from armor_trl.data.datasets import _LOCAL_BUILDERS, load_rlvr_dataset

    datasets.disable_progress_bars()  # the plan, not a progress bar per file

    builder = _LOCAL_BUILDERS.get(Path(path).suffix.lower())
    if builder is None:
        raise InputError(f"{flag} {path}: unsupported file type; use one of {sorted(_LOCAL_BUILDERS)}.")
    try:
        total = len(load_dataset(builder, data_files=path, split="train"))
        data = load_rlvr_dataset(path, schema=recipe.get("dataset_schema"), chat=recipe.get("chat", False),
                                 system_prompt=recipe.get("system_prompt"), instruction=recipe.get("instruction"),
                                 limit=limit)
    except Exception as error:  # the loader's own message says what is wrong with the rows
        raise InputError(f"{flag} {path}: cannot be read as a math dataset: {error}") from error
    if len(data) == 0:
        raise InputError(f"{flag} {path}: holds no rows.")
    return {"path": path, "rows": total, "used": len(data), "wanted": limit,
            "answer_format": data[0]["answer_format"]}


def make_plan(args) -> dict:
    from armor_trl.app.experiments import study
    from armor_trl.app.experiments.plan import load_arms, metrics_path, select_arms
    from armor_trl.app.experiments.runner import read_recipe

    try:
        config_path, recipe = read_recipe(args.config)
    except ValueError as error:
        raise InputError(f"--config {args.config}: {error}") from error
    paths = {"model_name_or_path": str(Path(args.model).resolve()), "dataset_name": str(Path(args.train).resolve()),
             "eval_dataset_name": str(Path(args.test).resolve())}
    recipe = {**recipe, **paths}
    try:
        all_arms, default_arms = load_arms(recipe, ARMS_FILE)
        chosen = select_arms(all_arms, args.arms.split(",") if args.arms else default_arms)
    except ValueError as error:
        raise InputError(f"--arms: {error}" if args.arms else f"--config {args.config}: {error}") from error
    seeds = args.seeds or (recipe.get("study") or {}).get("seeds", study.DEFAULT_SEEDS)
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise InputError(f"--config {args.config}: study.seeds must be an integer >= 1, got {seeds!r}.")
    seed0 = recipe.get("seed", 0)
    train = _rows("--train", paths["dataset_name"], recipe, recipe.get("max_train_samples"))
    test = _rows("--test", paths["eval_dataset_name"], recipe, recipe.get("max_eval_samples"))
    runs = len(chosen) * seeds
    out = Path(args.output_dir)
    _check_same_study(out, recipe)
    done = [f"{a}-seed{s}" for s in range(seed0, seed0 + seeds) for a in chosen
            if metrics_path(out, a, s).is_file()]
    return {"config": config_path, "recipe": recipe, "arms": chosen, "seeds": list(range(seed0, seed0 + seeds)),
            "train": train, "test": test, "runs": runs, "done": done, "out": str(out),
            "workers": args.workers or min(MAX_WORKERS, max(1, runs - len(done))), "study": study}


def _check_same_study(out: Path, recipe: dict) -> None:
    """Before anything is written to --output_dir: a folder holding a study of another recipe (or other model or data
    paths) is not reused (run_study would refuse it too, after this script had overwritten its recipe file)."""
    import yaml

    record = out / "study.json"
    if record.is_file():
        earlier = json.loads(record.read_text()).get("recipe")
        if earlier != json.loads(json.dumps(yaml.safe_load(yaml.safe_dump(recipe)))):  # as run_study records it
            raise InputError(f"--output_dir {out}: holds a study of another recipe, model or data; use another "
                             "--output_dir.")


def check_arms(plan: dict) -> dict:
    """Every arm's resolved overrides, each parsed as `armor-trl train` would, without weights. The recipe is
    checked as a dry run, so that bf16 parses on a machine without a GPU (as `armor-trl train --dry_run` does)."""
    with tempfile.TemporaryDirectory(prefix="gpu-study-") as tmp:
        recipe_file = Path(tmp) / "recipe.yaml"
        _write_recipe({**plan["recipe"], "dry_run": True}, recipe_file)
        try:
            return plan["study"].check_arms(plan["arms"], plan["recipe"], str(recipe_file),
                                            plan["recipe"]["model_name_or_path"])
        except ValueError as error:
            raise InputError(f"--config {plan['config']}: {error}") from error


def _write_recipe(recipe: dict, path: Path) -> None:
    import yaml

    path.write_text(yaml.safe_dump(recipe, sort_keys=False))


def format_plan(plan: dict, resolved: dict, dry_run: bool) -> str:
    r, train, test = plan["recipe"], plan["train"], plan["test"]
    samples = r.get("val_num_samples") or r.get("val_k", 4)
    per_step = r.get("per_device_train_batch_size", 8) * r.get("gradient_accumulation_steps", 1)
    lines = ["GPU study plan" + (" (dry run: nothing loaded, trained or written)" if dry_run else ""),
             f"  recipe:   {plan['config']}",
             f"  model:    {r['model_name_or_path']}",
             f"  train:    {train['path']}: {train['used']} of {train['rows']} problems "
             f"(answer format {train['answer_format']})",
             f"  held-out: {test['path']}: {test['used']} of {test['rows']} problems x {samples} samples, "
             f"validated every {r.get('val_every_steps')} steps and at step 0",
             f"  steps:    {r.get('max_steps')} per run, {per_step} completions per step "
             f"({r.get('num_generations')} per prompt, <= {r.get('max_completion_length')} tokens)"]
    for name, data in (("train", train), ("held-out", test)):
        if data["wanted"] and data["used"] < data["wanted"]:
            lines.append(f"  note:     the {name} file holds {data['used']} problems, the recipe asks for "
                         f"{data['wanted']}")
    lines.append(f"  arms:     {len(plan['arms'])}")
    for arm, overrides in resolved.items():
        lines.append(f"    {arm}: {json.dumps(overrides)}")
    pending = plan["runs"] - len(plan["done"])
    lines += [f"  seeds:    {plan['seeds']}",
              f"  runs:     {plan['runs']} ({len(plan['arms'])} arms x {len(plan['seeds'])} seeds), {pending} to run"
              + (f", {len(plan['done'])} already finished" if plan["done"] else "")
              + f"; {plan['workers']} at once on the GPU",
              f"  output:   {plan['out']} (summary.md/.json, curves.png, kl.png, metrics/<arm>-seed<s>.jsonl, "
              "environment.jsonl)"]
    return "\n".join(lines)


def environment(cuda: dict) -> dict:
    from importlib.metadata import version

    import torch

    return {**cuda, "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            **{name: version(name) for name in ("transformers", "trl", "peft", "accelerate", "datasets",
                                                "math-verify")},
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_paths(args)
        go_offline()
        cuda = None if args.dry_run else check_cuda()
        try:
            ensure_dependencies(args.wheelhouse)
        except WheelhouseError as error:
            raise EnvironmentProblem(str(error)) from error
        plan = make_plan(args)
        resolved = check_arms(plan)  # before anything is written (run_study checks them again)
        print(format_plan(plan, resolved, args.dry_run), flush=True)
        if args.dry_run:
            return 0
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        recipe_file = out / "gpu_study_recipe.yaml"
        _write_recipe(plan["recipe"], recipe_file)
        with open(out / "environment.jsonl", "a") as f:  # a line per start: a resumed study keeps every record
            f.write(json.dumps(environment(cuda)) + "\n")
        start = time.time()
        plan["study"].run_study(str(recipe_file), list(plan["arms"]), len(plan["seeds"]), plan["workers"], str(out),
                                arms_file=str(ARMS_FILE))
        print(f"gpu_study: {time.time() - start:.0f} s for the study (without install and checks); results in {out}")
        return 0
    except InputError as error:
        print(f"gpu_study: error: {error}", file=sys.stderr)
        return 2
    except EnvironmentProblem as error:
        print(f"gpu_study: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
