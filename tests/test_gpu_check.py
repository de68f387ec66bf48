"""scripts/gpu_check.sh, as far as it runs without a GPU: its plan and budgets (the default parts fit nine minutes at
the step times of the first GPU run), a part stopped at its budget while the next still runs, the result files, and
the parts themselves on the tiny model on the CPU: the M = 16 pair, the CLI part's command (without the launcher),
and (slow) the DeepSpeed part under `accelerate launch` with gloo."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testing import REPO, _env, _free_port, load_gpu_check

SCRIPTS = REPO / "scripts"


def load_parts():
    spec = importlib.util.spec_from_file_location("gpu_check_parts", SCRIPTS / "gpu_check_parts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


parts = load_parts()


def test_the_default_plan_fits_nine_minutes_at_the_first_gpu_runs_step_times():
    plan = parts.plan("out", "wheelhouse", full=False)
    names = [p.name for p in plan]
    assert names == ["install", "models", "grpo_beta0.04", "armor", "grpo_beta0.04_lora", "armor_lora", "zero2",
                     "zero3", "zero3_lora", "fsdp2_lora", "cli_zero2_lora", "pair_m16"]
    assert all(p.budget_s is not None and p.budget_s > 0 for p in plan)  # every part stops at its own budget
    assert parts.total_budget(plan) <= parts.TOTAL_LIMIT_S == 540
    for name, seconds in parts.STEP_S.items():  # a run's budget covers its steps at the measured step time
        run = next(p for p in plan if p.name == name)
        assert run.budget_s >= parts.START_S + parts.STEPS * seconds
        assert run.command[run.command.index("--steps") + 1] == "4"
    assert parts.STEP_S == {"grpo_beta0.04": 5.61, "armor": 6.67, "grpo_beta0.04_lora": 6.73, "armor_lora": 7.72}
    full = parts.plan("out", "wheelhouse", full=True)
    bench = next(p for p in full if p.name == "bench")
    assert bench.budget_s is None and "--preset" in bench.command  # only --full runs the whole bench
    assert "bench" not in names


def test_dry_run_prints_the_plan_with_its_budgets_and_runs_nothing(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--dry_run"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    total = next(line for line in done.stdout.splitlines() if line.startswith("| total |"))
    assert int(total.split("|")[2]) <= 540
    assert "| zero3_lora | 45 |" in done.stdout and "| fsdp2_lora | 35 |" in done.stdout and "| pair_m16 | 60 |" in done.stdout
    assert not (tmp_path / "out").exists()


def test_a_part_over_its_budget_is_stopped_and_the_next_one_runs(tmp_path):
    slow = parts.Part("slow", "sleeps", 1, [sys.executable, "-c", "import time; time.sleep(60)"], "test")
    quick = parts.Part("quick", "writes", 30, [sys.executable, "-c",
                       f"import json; json.dump({{'median_step_s': 1.5}}, open({str(tmp_path / 'q.json')!r}, 'w'))"],
                       "test", result_file="q.json")
    entries = [parts.run_part(p, tmp_path, tmp_path) for p in (slow, quick)]
    assert entries[0]["status"] == "over budget (stopped at 1 s)" and entries[0]["seconds"] < 15
    assert entries[1]["status"] == "ok" and entries[1]["result"] == {"median_step_s": 1.5}
    table = parts.table(entries)
    assert "| slow | over budget (stopped at 1 s) |" in table and "median_step_s 1.5" in table


def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(parts.shutil, "which", lambda name: None)
    assert parts.main(["--output_dir", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_the_m16_pair_on_the_cpu(tiny_model_path, tmp_path):
    result = load_gpu_check().pair_m16(tiny_model_path, str(tmp_path), completion=8)
    assert result["grpo_beta0.04_per_step_s"] > 0 and result["armor_per_step_s"] > 0
    assert result["ratio_step"] == pytest.approx(result["armor_per_step_s"] / result["grpo_beta0.04_per_step_s"])
    assert json.loads((tmp_path / "pair_m16.json").read_text()) == result


def test_the_cli_parts_recipe_and_reward_train_on_a_random_weight_model(tiny_model_path, tmp_path):
    # the CLI part's command without the launcher: configs/tiny_demo.yaml (no use_cpu, no bf16 in it), LoRA, and a
    # reward a random-weight model satisfies, so that anchors are found
    command = next(p for p in parts.plan(str(tmp_path), None, full=False) if p.name == "cli_zero2_lora").command
    train = command[command.index("armor_trl") - 1:]  # `-m armor_trl train ...`, after the launcher's own words
    assert train[:3] == ["-m", "armor_trl", "train"]
    train[train.index("--model_name_or_path") + 1] = tiny_model_path
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO)])}
    done = subprocess.run([sys.executable, *train, "--per_device_train_batch_size", "16", "--report_to", "none"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Training completed" in done.stdout
    assert (tmp_path / "cli_zero2_lora" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_the_deepspeed_part_resets_saves_and_resumes_under_accelerate_launch(tiny_model_path, tmp_path):
    pytest.importorskip("deepspeed")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "configs" / "accelerate" / "zero2.yaml"), "--num_processes", "1", "--mixed_precision", "no",
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
               str(SCRIPTS / "gpu_check.py"), "--launcher_part", "zero2", "--model", tiny_model_path,
               "--output_dir", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads((tmp_path / "zero2.json").read_text())
    assert result["engine"] == "DeepSpeed" and result["resumed_to_step"] == 4 and result["losses_finite"]
    assert result["reference_resets"] >= 1 and result["anchor_found_frac"] > 0
    assert result["checkpoints"] == ["checkpoint-2", "checkpoint-4"]


@pytest.mark.slow
def test_the_fsdp2_part_resets_saves_and_resumes_under_accelerate_launch(tiny_model_path, tmp_path):
    """The GPU check's FSDP2 + LoRA part in one CPU process (tests/scripts/fsdp_on_cpu.py keeps accelerate's FSDP)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "configs" / "accelerate" / "fsdp2.yaml"), "--num_processes", "1", "--mixed_precision", "no",
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
               str(REPO / "tests" / "scripts" / "fsdp_on_cpu.py"), str(SCRIPTS / "gpu_check.py"), "--launcher_part",
               "fsdp2_lora", "--model", tiny_model_path, "--output_dir", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads((tmp_path / "fsdp2_lora.json").read_text())
    assert result["engine"] == "FSDP2" and result["resumed_to_step"] == 4 and result["losses_finite"]
    assert result["reference_resets"] >= 1 and result["anchor_found_frac"] > 0
    assert result["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
