"""Small frictions a newcomer met (issue 30, item 9): a typo gets the close name, an output_dir that is a file and a
model that cannot be reached get one line, `trl grpo`'s --reward_model_name_or_path is refused with the reason,
DeepSpeed's import notice is silenced, verifier workers stay quiet on an interrupt."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from armor_trl import ArmorConfig
from armor_trl.app.cli import main

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def recipe(tmp_path, tiny_model_path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": tiny_model_path, "dataset_name": "arithmetic",
                                    "output_dir": str(tmp_path / "out"), "use_cpu": True, "bf16": False,
                                    "report_to": "none"}))
    return path


def one_error_line(err: str, prefix: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_typo_in_an_armor_config_field_names_the_close_field(tmp_path):
    with pytest.raises(TypeError, match=r"ArmorConfig has no field armor_aplha \(did you mean armor_alpha\?\), zzz;"):
        ArmorConfig(output_dir=str(tmp_path), armor_aplha=0.5, zzz=1)


def test_a_typo_in_a_train_flag_or_recipe_key_names_the_close_field(recipe, capsys):
    assert main(["train", "--config", str(recipe), "--dry_run", "--armor_aplha", "0.5"]) == 2
    line = one_error_line(capsys.readouterr().err, "armor-trl train: error:")
    assert "Unknown arguments: --armor_aplha 0.5 (--armor_aplha: did you mean --armor_alpha?)" in line
    values = yaml.safe_load(recipe.read_text())
    recipe.write_text(yaml.safe_dump({**values, "anchor_num_sample": 4}))
    assert main(["train", "--config", str(recipe), "--dry_run"]) == 2
    line = one_error_line(capsys.readouterr().err, "armor-trl train: error:")
    assert "Unknown key(s) in the recipe: anchor_num_sample (did you mean anchor_num_samples" in line


def test_a_typo_in_eval_demo_and_study_flags_names_the_close_flag(tmp_path, capsys):
    assert main(["eval", "--model", "m", "--dataset", "arithmetic", "--tempreature", "0.5"]) == 2
    assert "unrecognized arguments: --tempreature 0.5 (--tempreature: did you mean --temperature?)" in \
        capsys.readouterr().err
    config = tmp_path / "eval.yaml"
    config.write_text("model: m\ndataset: arithmetic\nnum_sample: 4\n")
    assert main(["eval", "--config", str(config)]) == 2
    assert f"{config}: unknown key(s) num_sample (did you mean num_samples?)" in capsys.readouterr().err
    for command, typo, meant in (("demo", "--workrs", "--workers"), ("study", "--sedes", "--seeds")):
        with pytest.raises(SystemExit) as stop:
            main([command, typo, "2"])
        assert stop.value.code == 2
        assert f"unrecognized arguments: {typo} 2 ({typo}: did you mean {meant}?)" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["armor", "grpo"])
def test_an_output_dir_that_is_a_file_is_one_line_naming_it(recipe, tmp_path, capsys, method):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    assert main(["train", "--config", str(recipe), "--method", method, "--output_dir", str(taken), "--dry_run"]) == 2
    line = one_error_line(capsys.readouterr().err, "armor-trl train: error:")
    assert f"output_dir '{taken}' is an existing file, not a folder" in line
    with pytest.raises(ValueError, match="is an existing file, not a folder"):
        ArmorConfig(output_dir=str(taken), use_cpu=True, bf16=False)
    assert taken.read_text() == "a file"


def test_train_with_a_hub_model_that_cannot_be_reached_is_one_line(recipe, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = "armor-trl-tests/no-such-model"
    assert main(["train", "--config", str(recipe), "--model_name_or_path", model]) == 2
    line = one_error_line(capsys.readouterr().err, "armor-trl train: error:")
    assert f"model_name_or_path '{model}' could not be loaded: " in line
    assert not (tmp_path / "out").exists()  # nothing was started


def test_trl_grpos_reward_model_flag_is_refused_with_the_reason(recipe, capsys):
    assert main(["train", "--config", str(recipe), "--reward_model_name_or_path", "some/reward-model",
                 "--dry_run"]) == 2
    line = one_error_line(capsys.readouterr().err, "armor-trl train: error:")
    assert "reward_model_name_or_path: a `trl grpo` field that armor-trl train does not take" in line
    assert "reward_funcs" in line and "anchor_reward_funcs" in line
    values = yaml.safe_load(recipe.read_text())
    recipe.write_text(yaml.safe_dump({**values, "reward_model_name_or_path": "some/reward-model"}))
    assert main(["train", "--config", str(recipe), "--dry_run"]) == 2
    assert "a `trl grpo` field that armor-trl train does not take" in capsys.readouterr().err


def _python(code: str, preexec_fn=None, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env=environment, cwd=REPO, preexec_fn=preexec_fn)


def _as_a_background_job():
    """What a shell does to a job started with ``&`` (or nohup): SIGINT ignored, which the child inherits."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_deepspeeds_cpu_accelerator_notice_is_silenced():
    pytest.importorskip("deepspeed")
    # what a script does: our trainer, then whatever imports DeepSpeed (accelerate does when saving a model)
    run = _python("""
        from armor_trl import ArmorGRPOTrainer
        import deepspeed
        from deepspeed.utils import logger
        logger.warning("another DeepSpeed warning")
    """, CUDA_VISIBLE_DEVICES="")
    assert run.returncode == 0, run.stderr
    printed = run.stdout + run.stderr  # DeepSpeed's logger writes to stdout
    assert "Setting accelerator to CPU" not in printed
    assert "another DeepSpeed warning" in printed  # only that notice is dropped


@pytest.mark.parametrize("started", ["foreground", "background"])
def test_verifier_workers_stay_quiet_on_an_interrupt_and_the_pool_recovers(started):
    # the suite itself may run as a background job (make test &): the child must not depend on the shell it came from
    run = _python(preexec_fn=_as_a_background_job if started == "background" else None, code="""
        import os, signal, threading, time
        from armor_trl.rewards import VerifierPool

        # a process started from a background job (make test &, nohup) inherits SIGINT ignored, and Python then
        # installs no KeyboardInterrupt handler: this process is the interactive one the test plays, so it sets it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        pool = VerifierPool(workers=1, timeout=30.0)
        assert pool.run([("\\\\boxed{2}", "2", "auto")]) == [1.0]
        worker = pool.workers[0].process
        os.kill(worker.pid, signal.SIGINT)  # what Ctrl-C or a notebook kernel's interrupt sends the process group
        time.sleep(1.0)
        assert worker.poll() is None, "the worker died of SIGINT"
        assert pool.run([("\\\\boxed{3}", "3", "auto")]) == [1.0]  # and still judges
        # an interrupt in the middle of a call: the workers are ended, the next call starts fresh ones
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            pool.run([("\\\\boxed{9^{9^{9^{9}}}}", "1", "auto")])
        except KeyboardInterrupt:
            pass
        assert pool.workers == [] and worker.poll() is not None
        assert pool.run([("\\\\boxed{4}", "4", "auto")]) == [1.0]
        pool.close()
        print("ok")
    """)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
    assert "KeyboardInterrupt" not in run.stderr and "Traceback" not in run.stderr, run.stderr
