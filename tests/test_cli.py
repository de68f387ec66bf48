"""The armor-trl command: recipe parsing (TRL's parser), dry runs, 2-step training for both methods, eval."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trl import GRPOConfig

from armor_trl import ArmorConfig
from armor_trl.app.cli import main
from armor_trl.app.cli.eval import EVAL_RESULTS_FILE
from armor_trl.app.cli.train import best_checkpoint, describe_resets, reset_schedule
from armor_trl.app.recipe.parsing import parse_train_args, resolve_resume_from_checkpoint

REPO = Path(__file__).resolve().parent.parent
DEMO_RECIPE = REPO / "configs" / "tiny_demo.yaml"


@pytest.fixture
def recipe(tmp_path, tiny_model_path):
    """A small recipe: the tiny model, a local JSONL dataset, a built-in and a dotted-path reward."""
    rows = [{"prompt": f"{i}+{i + 1}=", "answer": str(2 * i + 1)} for i in range(16)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "cli_test_rewards.py").write_text(
        "def has_digit(completions, **kwargs):\n"
        "    texts = [c if isinstance(c, str) else c[0]['content'] for c in completions]\n"
        "    return [float(any(ch.isdigit() for ch in t)) for t in texts]\n"
    )
    config = {
        "model_name_or_path": tiny_model_path,
        "dataset_name": str(tmp_path / "train.jsonl"),
        "eval_dataset_name": str(tmp_path / "train.jsonl"),
        "max_eval_samples": 4,
        "reward_funcs": ["cli_test_rewards:has_digit", "exact_integer"],
        "reward_weights": [1.0, 0.0],
        "val_every_steps": 1,
        "val_k": 2,
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "max_completion_length": 6,
        "max_steps": 2,
        "learning_rate": 1e-2,
        "use_cpu": True,
        "bf16": False,
        "activation_checkpointing": False,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 42,
        "anchor_num_samples": 2,
        "anchor_filter": "keep",
        "ref_reset_steps": 1,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # dotted-path rewards next to the recipe are importable, as with `trl grpo`
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_parse_both_methods_from_one_recipe(recipe):
    script, config, model, notes = parse_train_args(["--config", str(recipe)])
    assert isinstance(config, ArmorConfig) and script.method == "armor" and notes == []
    assert (config.anchor_num_samples, config.anchor_filter, config.ref_reset_steps) == (2, "keep", 1)
    assert model.model_name_or_path and script.reward_funcs == ["cli_test_rewards:has_digit", "exact_integer"]

    script, config, _, notes = parse_train_args(["--config", str(recipe), "--method", "grpo", "--beta", "0.04",
                                                 "--learning_rate", "0.5"])
    assert type(config) is GRPOConfig and script.method == "grpo"
    assert config.beta == 0.04 and config.learning_rate == 0.5  # flags override the recipe
    assert len(notes) == 1 and "anchor_num_samples" in notes[0] and "ref_reset_steps" in notes[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "grpo", "--armor_alpha", "0.9"], "ArmorConfig-only"),
        (["--method=grpo", "--ref-reset-steps", "4"], "ArmorConfig-only"),
        (["--armor_alpha", "1.5"], "armor_alpha must lie in"),
        (["--beta", "-0.1"], "beta must be >= 0.0"),
        (["--per_device_train_batch_size", "6"], "must be divisible by num_generations"),
        (["--no_such_flag", "1"], "Unknown arguments"),
        (["--method", "ppo"], "method must be one of"),
    ],
)
def test_bad_recipes_fail_clearly(recipe, extra, message, capsys):
    assert main(["train", "--config", str(recipe), "--dry_run", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("armor-trl train: error:") and message in err


def test_unknown_recipe_key_is_rejected(recipe, tmp_path, capsys):
    config = yaml.safe_load(recipe.read_text())
    config["learning_rte"] = 0.1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(bad), "--dry_run"]) == 2
    assert "learning_rte" in capsys.readouterr().err


def test_dry_run_summarizes_without_training(recipe, cwd, capsys):
    assert main(["train", "--config", str(recipe), "--dry_run", "--ref_reset_steps", "2",
                 "--ref_reset_every_step_until", "3", "--max_steps", "10"]) == 0
    out = capsys.readouterr().out
    assert "Recipe OK" in out and "ArmorGRPOTrainer" in out
    assert "8 per device x 1 steps per generation x 1 process(es) = 8 completions = 2 groups of 4" in out
    assert "7 resets in 10 steps (1, 2, 3, 4, 6, 8, 10)" in out
    assert not (cwd / "out").exists()  # nothing trained, nothing written


def test_dry_run_checks_rewards_and_weights(recipe, cwd, capsys):
    assert main(["train", "--config", str(recipe), "--dry_run", "--reward_funcs", "nope_reward"]) == 2
    assert "Unknown reward function 'nope_reward'" in capsys.readouterr().err
    assert main(["train", "--config", str(recipe), "--dry_run", "--reward_weights", "1.0"]) == 2
    assert "reward_weights has 1 entries but there are 2 reward functions" in capsys.readouterr().err


def test_reset_schedule():
    assert reset_schedule(10, None, None) == []
    assert reset_schedule(10, 4, None) == [4, 8]
    assert reset_schedule(10, None, 3) == [1, 2, 3]
    assert describe_resets(10, None, None) == "static reference (never reset)"
    # resets inside a rollout batch act at its end (every 4 optimizer steps here)
    assert reset_schedule(20, 5, None, rollout_end=4) == [8, 12, 16, 20]
    assert reset_schedule(12, None, 6, at_steps=[9], rollout_end=4) == [4, 8, 12]
    assert describe_resets(12, None, None, [1, 2], 4) == ("reset after steps [1, 2]: 1 resets in 12 steps (at "
                                                          "rollout-batch ends, every 4 steps) (4)")


@pytest.mark.parametrize("method", ["armor", "grpo"])
def test_train_two_steps_from_yaml(recipe, cwd, method, capsys):
    assert main(["train", "--config", str(recipe), "--method", method]) == 0
    out = cwd / "out"
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    records = [json.loads(line) for line in (out / "val_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(0.0 <= r["val/avg@2"] <= 1.0 for r in records)
    if method == "grpo":
        assert "ignores the ArmorConfig-only recipe key(s)" in capsys.readouterr().err


def test_eval_command(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "results" / EVAL_RESULTS_FILE
    assert main(["eval", "--model", tiny_model_path, "--dataset", "arithmetic", "--arithmetic_eval_size", "6",
                 "--k", "2", "--num_samples", "3", "--max_new_tokens", "4", "--output_dir", str(out.parent)]) == 0
    result = json.loads(out.read_text())
    assert result["num_problems"] == result["num_total"] == 6 and result["num_unjudged"] == 0
    assert 0.0 <= result["avg@3"] <= result["pass@2"] <= 1.0
    printed, err = capsys.readouterr()
    assert "deprecated" not in err
    assert "(6 problems, n=3)" in printed and "avg@3 =" in printed and "left out" not in printed
    assert main(["eval", "--dataset", "arithmetic"]) == 2


@pytest.mark.parametrize("model", ["missing", "empty_folder", "hub_id"])
def test_eval_with_a_model_that_cannot_be_loaded_is_a_one_line_error(model, tmp_path, capsys):
    path = {"missing": str(tmp_path / "no-such-checkpoint"), "hub_id": "no-such-org/no-such-model",
            "empty_folder": str(tmp_path)}[model]
    assert main(["eval", "--model", path, "--dataset", "arithmetic", "--arithmetic_eval_size", "2", "--k", "1"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"armor-trl eval: error: --model {path!r}")
    assert "Traceback" not in err


def test_eval_refuses_fewer_samples_than_k_before_generating(tiny_model_path, monkeypatch, capsys):
    import armor_trl.app.cli.eval
    import armor_trl.callbacks.evaluation

    def never(*args, **kwargs):
        raise AssertionError("nothing may be loaded or generated before the flags are checked")

    monkeypatch.setattr(armor_trl.app.cli.eval, "_load_model", never)
    monkeypatch.setattr(armor_trl.callbacks.evaluation, "sample_completions", never)
    assert main(["eval", "--model", tiny_model_path, "--dataset", "arithmetic", "--k", "4", "--num_samples", "2"]) == 2
    err = capsys.readouterr().err
    assert "armor-trl eval: error: --num_samples (2) must be >= --k (4)" in err


def test_eval_says_how_many_problems_it_dropped_and_why(tiny_model_path, tmp_path, capsys):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "four"},
            {"prompt": "3+2=", "answer": "5"}, {"prompt": "4+2=", "answer": "1/2"}]
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / EVAL_RESULTS_FILE
    assert main(["eval", "--model", tiny_model_path, "--dataset", str(data), "--reward", "exact_integer", "--k", "1",
                 "--num_samples", "2", "--max_new_tokens", "3", "--output_dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "(2 of 4 problems, n=2)" in printed
    assert ("2 of 4 problems left out because they could not be judged: 2 the verifier returned None for every "
            "sample") in printed
    result = json.loads(out.read_text())
    assert (result["num_problems"], result["num_total"], result["num_unjudged"]) == (2, 4, 2)
    assert result["unjudged_reasons"] == {"verifier_cannot_judge": 2}
    assert [(u["index"], u["ground_truth"]) for u in result["unjudged"]] == [(1, "four"), (3, "1/2")]


def test_train_dry_run_refuses_fewer_validation_samples_than_val_k(recipe, cwd, capsys):
    assert main(["train", "--config", str(recipe), "--dry_run", "--val_k", "4", "--val_num_samples", "2"]) == 2
    assert "val_num_samples (2) must be >= val_k (4)" in capsys.readouterr().err


def test_usage_and_module_entry_point():
    assert main([]) == 2 and main(["--help"]) == 0 and main(["frobnicate"]) == 2
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "armor_trl", "--help"], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0 and "armor-trl {train,eval,demo,study,anchors}" in result.stdout


def test_the_demo_recipe_is_a_valid_train_recipe(tiny_model_path, capsys):
    for method in ("armor", "grpo"):
        assert main(["train", "--config", str(DEMO_RECIPE), "--model_name_or_path", tiny_model_path,
                     "--method", method, "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "train dataset: arithmetic, 64 rows" in out and "static reference" in out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["armor", "grpo"])
def test_train_under_accelerate_launch_two_processes(recipe, tmp_path, method):
    """`accelerate launch -m armor_trl train` with 2 CPU processes, validating every step (sharded over both processes)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "-m", "armor_trl", "train", "--config", str(recipe), "--method", method,
               "--per_device_train_batch_size", "4"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "val_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]  # written once (by the main process), for every step
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_collapse_guard_and_named_validation_sets_from_the_command_line(recipe, cwd):
    data = str(cwd / "train.jsonl")
    assert main(["train", "--config", str(recipe), "--collapse_guard", "armor", "--max_steps", "1",
                 "--val_datasets", f"first={data}", f"again={data}"]) == 0
    records = [json.loads(line) for line in (cwd / "out" / "val_metrics.jsonl").read_text().splitlines()]
    assert {"val/avg@2", "val/first/avg@2", "val/again/avg@2"} <= set(records[-1])
    # the guard is on: ARMOR dormant, and the first validation (a new best) forced a checkpoint despite save "no"
    parts = json.loads((cwd / "out" / "checkpoint-1" / "armor_state.json").read_text())["parts"]
    assert parts["schedule"]["armor_started_at"] is None and parts["collapse_guard"]["steps"] == [1]
    assert main(["train", "--config", str(recipe), "--dry_run", "--val_datasets", "a/b=x"]) == 2


def test_resume_best_as_reference_starts_armor_from_the_best_checkpoint(recipe, cwd, capsys):
    from safetensors.torch import load_file

    first = cwd / "first"
    assert main(["train", "--config", str(recipe), "--output_dir", str(first), "--save_strategy", "steps",
                 "--save_steps", "1", "--method", "grpo"]) == 0
    # script the recorded validation: step 1 is the best
    (first / "val_metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "val/avg@2": score}) + "\n" for step, score in [(0, 0.9), (1, 0.6), (2, 0.3)]))
    assert best_checkpoint(str(first)) == (str(first / "checkpoint-1"),
                                           f"highest val/avg@2 = 0.6000 in {first / 'val_metrics.jsonl'} (step 1)")
    second = cwd / "second"
    assert main(["train", "--config", str(recipe), "--output_dir", str(second), "--resume_best_as_reference",
                 str(first), "--save_strategy", "steps", "--save_steps", "1", "--max_steps", "1",
                 "--ref_reset_steps", "100"]) == 0
    assert f"ARMOR starts from {first / 'checkpoint-1'}" in capsys.readouterr().err
    best = load_file(str(first / "checkpoint-1" / "model.safetensors"))
    import torch

    reference = load_file(str(second / "checkpoint-1" / "armor_reference.safetensors"))
    assert all(torch.equal(reference[name], best[name]) for name in best)  # π_ref = the best checkpoint's weights
    with pytest.raises(ValueError, match="no trainer_state.json best_model_checkpoint"):
        best_checkpoint(str(second), metric="val/missing")


# --- one output flag: --output_dir everywhere; the old spellings still work, hidden, with one warning --------------
def deprecation_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "deprecated" in line]


def test_eval_output_is_a_deprecated_alias_that_still_writes_the_file(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "old" / "eval.json"
    assert main(["eval", "--model", tiny_model_path, "--dataset", "arithmetic", "--arithmetic_eval_size", "2",
                 "--k", "1", "--max_new_tokens", "2", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["num_total"] == 2  # the old form writes the named file, as it did
    (line,) = deprecation_lines(capsys.readouterr().err)
    assert line.startswith("armor-trl eval: warning: --output is deprecated") and "use --output_dir" in line
    assert main(["eval", "--model", tiny_model_path, "--dataset", "arithmetic", "--output", str(out),
                 "--output_dir", str(tmp_path)]) == 2
    assert "give --output_dir only" in capsys.readouterr().err


@pytest.mark.parametrize("old", [None, "--out"])
def test_study_output_dir_and_its_deprecated_alias(old, tmp_path, monkeypatch, capsys):
    from armor_trl.app.experiments import study

    seen = []
    monkeypatch.setattr(study, "run_study", lambda *args, **kwargs: seen.append(args[4]))
    assert main(["study", "--smoke", old or "--output_dir", str(tmp_path / "s")]) == 0
    assert seen == [str(tmp_path / "s")]
    lines = deprecation_lines(capsys.readouterr().err)
    assert lines == ([] if old is None else
                     ["armor-trl study: warning: --out is deprecated and will be removed; use --output_dir."])


@pytest.mark.parametrize("old", [None, "--output"])
def test_anchors_output_dir_and_its_deprecated_alias(old, recipe, cwd, monkeypatch, capsys):
    from armor_trl.data import pregenerate

    def stop(output, settings, is_main):
        raise ValueError(f"would write to {output}")

    monkeypatch.setattr(pregenerate, "prepare_output", stop)
    assert main(["anchors", "--config", str(recipe), old or "--output_dir", str(cwd / "anchors")]) == 2
    err = capsys.readouterr().err
    assert f"armor-trl anchors: error: would write to {cwd / 'anchors'}" in err
    assert len(deprecation_lines(err)) == (0 if old is None else 1)
    with pytest.raises(SystemExit):
        main(["anchors", "--config", str(recipe)])
    assert "--output_dir is required" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["study", "anchors", "demo"])
def test_help_shows_only_output_dir(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert "--output_dir" in text and "--out " not in text and "--output " not in text


# --- resume_from_checkpoint as TRL's scripts take it ---------------------------------------------------------------
def test_resume_from_checkpoint_strings(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    for text in ("True", "true", "TRUE", True):
        assert resolve_resume_from_checkpoint(text, str(tmp_path)) is True
    for text in ("False", "false", "", None, False):
        assert resolve_resume_from_checkpoint(text, str(tmp_path)) is None
    assert resolve_resume_from_checkpoint(str(tmp_path / "checkpoint-2"), "elsewhere") == str(tmp_path / "checkpoint-2")
    with pytest.raises(ValueError, match="no checkpoint-N folder in output_dir"):
        resolve_resume_from_checkpoint("True", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="no such checkpoint folder"):
        resolve_resume_from_checkpoint(str(tmp_path / "checkpoint-9"), str(tmp_path))


@pytest.mark.parametrize("value, expected", [("True", True), ("false", None), ("checkpoint-1", "checkpoint-1")])
def test_train_passes_resume_from_checkpoint_to_the_trainer(value, expected, recipe, cwd, monkeypatch, capsys):
    import armor_trl.app.cli.train

    (cwd / "out" / "checkpoint-1").mkdir(parents=True)
    monkeypatch.chdir(cwd / "out")  # a relative checkpoint path
    calls = []

    class Trainer:
        accelerator = type("Accelerator", (), {"is_main_process": True})

        def train(self, resume_from_checkpoint=None):
            calls.append(resume_from_checkpoint)

        def save_model(self, path):
            pass

    monkeypatch.setattr(armor_trl.app.cli.train, "build_trainer", lambda *args, **kwargs: Trainer())
    assert main(["train", "--config", str(recipe), "--resume_from_checkpoint", value]) == 0
    assert calls == [expected]


def test_train_refuses_resume_without_a_checkpoint(recipe, cwd, capsys):
    assert main(["train", "--config", str(recipe), "--dry_run", "--resume_from_checkpoint", "TRUE"]) == 2
    assert "resume_from_checkpoint true: no checkpoint-N folder in output_dir" in capsys.readouterr().err
    (cwd / "out" / "checkpoint-4").mkdir(parents=True)
    assert main(["train", "--config", str(recipe), "--dry_run", "--resume_from_checkpoint", "TRUE"]) == 0
    assert f"resume: the newest checkpoint in {cwd / 'out'}" in capsys.readouterr().out


# --- run folders: --resume_best_as_reference stays inside the run folder; corrupt files are named -------------------
def fake_run(root: Path, steps=(1, 2, 3), best=None, val=None) -> Path:
    """A run folder with checkpoint-N folders; the newest holds trainer_state.json naming ``best``."""
    for step in steps:
        (root / f"checkpoint-{step}").mkdir(parents=True)
    if best is not None:
        (root / f"checkpoint-{max(steps)}" / "trainer_state.json").write_text(json.dumps(
            {"best_model_checkpoint": best, "global_step": max(steps)}))
    if val is not None:
        (root / "val_metrics.jsonl").write_text(val)
    return root


def test_best_model_checkpoint_is_resolved_inside_the_run_folder(tmp_path):
    run = fake_run(tmp_path / "run", best="/elsewhere/old-name/checkpoint-2/")  # the run moved; a trailing slash
    assert best_checkpoint(str(run))[0] == str(run / "checkpoint-2")
    for escape in ("/x/..", str(run) + "/..", "../", "checkpoint-2/..", "/"):
        run = fake_run(tmp_path / f"escape{len(escape)}-{escape.count('/')}", best=escape)
        with pytest.raises(ValueError, match=r"trainer_state.json: best_model_checkpoint .* does not end in a "
                           r"checkpoint-N folder, so it names no checkpoint of .*; refusing to follow it"):
            best_checkpoint(str(run))
    run = fake_run(tmp_path / "number", best=5)
    with pytest.raises(ValueError, match="best_model_checkpoint must be a path"):
        best_checkpoint(str(run))


@pytest.mark.parametrize("content", ["{\"best_model_checkpoint\": \"che", "", "[1, 2]", "\xff\xfe"])
def test_a_corrupt_trainer_state_names_the_file(content, tmp_path):
    run = fake_run(tmp_path / "run")
    state = run / "checkpoint-3" / "trainer_state.json"
    state.write_bytes(content.encode("latin-1"))
    with pytest.raises(ValueError) as error:
        best_checkpoint(str(run))
    assert str(error.value).startswith(f"{state}: ")


def test_a_truncated_or_null_scored_validation_file(tmp_path):
    records = fake_run(tmp_path / "run") / "val_metrics.jsonl"
    records.write_text('{"step": 1, "val/avg@4": 0.5}\n{"step": 2, "val/avg@4": 0.7}\n{"step": 3, "val/av')
    with pytest.raises(ValueError, match=f"{records}: line 3 is not valid JSON .* repair or delete that line"):
        best_checkpoint(str(records.parent))
    records.write_text('{"step": 1, "val/avg@4": 0.5}\n[2, 0.7]\n')
    with pytest.raises(ValueError, match=f"{records}: line 2 is not a JSON object"):
        best_checkpoint(str(records.parent))
    # a step validated without a score (null, NaN) is no candidate; the scored steps still decide
    records.write_text('{"step": 1, "val/avg@4": 0.5}\n{"step": 2, "val/avg@4": null}\n{"step": 3, "val/avg@4": NaN}\n'
                       '{"step": [3], "val/avg@4": 0.9}\n')
    assert best_checkpoint(str(records.parent))[0] == str(records.parent / "checkpoint-1")
    records.write_text('{"step": 2, "val/avg@4": null}\n')
    with pytest.raises(ValueError, match="no trainer_state.json best_model_checkpoint and no val_metrics.jsonl score"):
        best_checkpoint(str(records.parent))


def test_a_corrupt_run_folder_is_one_line_from_the_command(recipe, cwd, capsys):
    run = fake_run(cwd / "first")
    (run / "checkpoint-3" / "trainer_state.json").write_text("{")
    assert main(["train", "--config", str(recipe), "--dry_run", "--resume_best_as_reference", str(run)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"armor-trl train: error: {run / 'checkpoint-3' / 'trainer_state.json'}: not valid JSON (line 1, "
                     "column 2: Expecting property name enclosed in double quotes); the file is corrupt or was cut "
                     "short."]


def test_eval_config_errors_are_one_line(tmp_path, capsys):
    config = tmp_path / "eval.yaml"
    for text, message in [("k: 2\nk: 3\n", f"{config}:2:1: invalid YAML: duplicate key 'k' (first at line 1)"),
                          ("k: [2\n", f"{config}:2:1: invalid YAML"),
                          ("k: {a: 1}\n", f"{config}: k must be an integer, got a mapping ({{'a': 1}})")]:
        config.write_text(text)
        assert main(["eval", "--config", str(config), "--model", "m", "--dataset", "arithmetic"]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"armor-trl eval: error: {message}"), lines


# --- TRL's habits (issue 18, item 4) -------------------------------------------------------------------------------
def test_a_trl_grpo_recipe_with_a_datasets_mixture_trains(recipe, cwd, capsys):
    """`datasets:` as `trl grpo` recipes write it (TRL's DatasetMixtureConfig), on local files, instead of dataset_name."""
    config = yaml.safe_load(recipe.read_text())
    del config["dataset_name"]
    extra = [{"prompt": f"{i}*2=", "answer": str(2 * i)} for i in range(20, 30)]
    (cwd / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in extra))
    config["datasets"] = [{"path": "json", "data_files": str(cwd / "train.jsonl"), "split": "train"},
                          {"path": "json", "data_files": str(cwd / "more.jsonl"), "columns": ["prompt", "answer"]}]
    path = cwd / "mixture.yaml"
    path.write_text(yaml.safe_dump(config))
    from armor_trl.app.recipe.build import train_datasets

    script, _, _, notes = parse_train_args(["--config", str(path)])
    train, _ = train_datasets(script)
    assert len(train) == 16 + 10 and train["prompt"][-1] == "29*2=" and train["answer"][0] == "1" and notes == []
    assert main(["train", "--config", str(path), "--dry_run"]) == 0
    assert "train dataset: datasets mixture of json, json, 26 rows" in capsys.readouterr().out
    assert main(["train", "--config", str(path), "--max_steps", "1"]) == 0
    assert (cwd / "out" / "model.safetensors").is_file()
    del config["eval_dataset_name"]  # validation then needs a held-out share of the mixture
    path.write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(path), "--dry_run"]) == 2
    assert "with a datasets mixture needs a held-out set: test_split_size" in capsys.readouterr().err
    assert main(["train", "--config", str(path), "--dry_run", "--test_split_size", "0.25"]) == 0
    assert "train dataset: datasets mixture of json, json, 19 rows" in capsys.readouterr().out  # 26 - 7 held out
    config["datasets"][1]["colums"] = ["prompt"]  # a misspelt DatasetConfig key: named, with what is allowed
    path.write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(path), "--dry_run"]) == 2
    assert "datasets[1]: unknown key(s) colums (did you mean columns?); allowed: path, name" in capsys.readouterr().err


def test_eval_loads_a_lora_adapter_folder(tiny_model_path, tmp_path, capsys):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from armor_trl.app.cli.eval import _load_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    lora = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    adapter = tmp_path / "lora-run"
    lora.save_pretrained(adapter)  # adapter_config.json + adapter_model.safetensors, as a LoRA run's save_model
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(adapter)
    assert not (adapter / "config.json").exists()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = lora(input_ids=ids).logits
        _, loaded = _load_model(str(adapter))
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_path)(input_ids=ids).logits
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-4)  # the adapter is applied
    assert not torch.allclose(plain, expected, atol=1e-4)
    assert main(["eval", "--model", str(adapter), "--dataset", "arithmetic", "--arithmetic_eval_size", "2", "--k", "1",
                 "--max_new_tokens", "3"]) == 0
    assert "(2 problems, n=1)" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["tool_use_testbed.yaml", "tool_use_testbed_pilot.yaml", "mode_testbed.yaml"])
def test_a_testbed_recipe_without_its_model_says_which_commands_build_it(name, capsys):
    """A recipe whose model is its demo: section's warm start (its own or its base's) stops naming `armor-trl demo` /
    `study`, which build that model, and the flag that passes it; a recipe without one gets the plain message."""
    config = str(REPO / "configs" / name)
    assert main(["train", "--config", config]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "model_name_or_path is required" in err and "demo.warmup" in err and "bf16" not in err
    assert f"`armor-trl demo --config {config}`" in err and f"`armor-trl study --config {config}`" in err
    assert "pass that checkpoint with --model_name_or_path" in err
    assert main(["train", "--config", str(REPO / "configs" / "tool_agent_tiny.yaml")]) == 2
    err = capsys.readouterr().err
    assert "model_name_or_path is required: set it in the recipe" in err and "demo" not in err


def test_config_and_model_errors_come_before_hardware(recipe, tmp_path, capsys):
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert "give a recipe: armor-trl train --config recipe.yaml" in err and "bf16" not in err
    assert main(["train", "--output_dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "model_name_or_path is required" in err and "bf16" not in err
    assert main(["train", "--model_name_or_path", "m", "--bf16", "true"]) == 2
    assert "dataset_name (or a datasets mixture) is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["anchors", "--output_dir", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert "the following arguments are required: --config" in err and "bf16" not in err


def test_required_flags_are_marked_required(tiny_model_path, tmp_path, capsys):
    assert main(["eval", "--help"]) == 0
    usage = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    assert " --model MODEL --dataset DATASET" in usage and "[--model " not in usage and "[--dataset " not in usage
    assert main(["eval", "--model", "x"]) == 2
    assert "the following arguments are required: --dataset" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["anchors", "--help"])
    assert "--config CONFIG" in capsys.readouterr().out.split("\n\n")[0].replace("[--config", "")
    config = tmp_path / "eval.yaml"  # a --config file may give them instead
    config.write_text(yaml.safe_dump({"model": tiny_model_path, "dataset": "arithmetic", "arithmetic_eval_size": 2,
                                      "k": 1, "max_new_tokens": 2}))
    assert main(["eval", "--config", str(config)]) == 0


@pytest.mark.parametrize("engine, env", [("DeepSpeed", {"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "1"}),
                                         ("FSDP", {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "1"})])
def test_use_cpu_under_a_launchers_deepspeed_or_fsdp_on_a_gpu_machine_is_refused_at_parse_time(
        engine, env, recipe, cwd, capsys, monkeypatch):
    # `accelerate launch --config_file configs/accelerate/zero2.yaml -m armor_trl train ...` with `use_cpu: true`:
    # DeepSpeed put the model on cuda:0, TRL the inputs on the CPU, and the first forward crashed
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["train", "--config", str(recipe), "--dry_run", "--use_cpu", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"armor-trl train: error: use_cpu=True under {engine}")
    assert "--use_cpu false" in err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU: nothing to refuse
    assert main(["train", "--config", str(recipe), "--dry_run", "--use_cpu", "true"]) == 0


def test_use_cpu_under_ddp_on_a_gpu_machine_warns_that_the_gpus_idle(monkeypatch, caplog):
    import logging
    from types import SimpleNamespace

    import torch

    from armor_trl.integration.launcher import check_use_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING):
        check_use_cpu(SimpleNamespace(use_cpu=True, deepspeed=None, fsdp=None))
    assert "GPUs idle" in caplog.text and "--use_cpu false" in caplog.text
    with pytest.raises(ValueError, match="use_cpu=True under DeepSpeed.*--use_cpu false"):
        check_use_cpu(SimpleNamespace(use_cpu=True, deepspeed="ds.json", fsdp=None))
    check_use_cpu(SimpleNamespace(use_cpu=False, deepspeed="ds.json", fsdp=None))  # the fix: no error
