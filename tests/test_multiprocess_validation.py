"""Validation through the trainer's generation path, sharded over 2 processes on CPU (gloo): DDP via torchrun and
DeepSpeed ZeRO-3 via accelerate launch give exactly the avg@k / pass@k of one process.

tests/scripts/mp_validation_script.py validates 7 problems (so one shard is padded) with n = 4 samples, one problem per
generation call: each call is seeded from its problem, so a problem's samples do not depend on which process
draws them or on the other problems, and the counts must agree exactly, sampled (temperature 1, top-p 0.9) as well
as greedy. Training runs at learning rate 0 so the validated weights are the initial ones in every run.

Run with ``pytest -m slow tests/test_multiprocess_validation.py`` (ZeRO-3 needs ``pip install deepspeed``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testing import ACCELERATE_CONFIGS, REPO, SCRIPTS, _env, _free_port, _launch

SCRIPT = SCRIPTS / "mp_validation_script.py"
PROCESSES = 2

pytestmark = pytest.mark.slow


def _torchrun(model, out):
    return _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(PROCESSES),
                    "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
                    str(SCRIPT), "--model", model, "--out", str(out), "--ddp_backend", "gloo"], out, PROCESSES)


def _accelerate(config, model, out):
    return _launch([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / config),
                    "--num_processes", str(PROCESSES), "--mixed_precision", "no", "--main_process_ip", "127.0.0.1",
                    "--main_process_port", str(_free_port()), str(SCRIPT), "--model", model, "--out", str(out),
                    "--ddp_backend", "gloo", "--no_cpu"], out, PROCESSES)


@pytest.fixture(scope="module")
def single(tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("validation-single")
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", tiny_model_path, "--out", str(out)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "rank0.json").read_text())


def _val_entries(result):
    return [{k: v for k, v in e.items() if k.startswith("val/") or k == "step"}
            for e in result["log_history"] if any(k.startswith("val/") for k in e)]


def _check_against_single(ranks, single):
    assert single["world_size"] == 1 and all(r["world_size"] == PROCESSES for r in ranks)
    assert all(r["on_every_process"] for r in ranks + [single])
    assert 0 < sum(single["sampled"]["correct_counts"]) < 4 * 7  # the sampled comparison is not vacuous
    for what in ("sampled", "greedy"):
        for r in ranks:
            assert r[what]["correct_counts"] == single[what]["correct_counts"], what
            assert r[what]["avg@4"] == single[what]["avg@4"] and r[what]["pass@2"] == single[what]["pass@2"], what
            assert r[what]["samples"] == single[what]["samples"], what
    expected = _val_entries(single)
    assert [e["step"] for e in expected] == [1]
    for r in ranks:  # the metric is in log_history on every process, equal to the single-process one
        assert _val_entries(r) == expected
        assert r["callback_history"][0] == single["callback_history"][0]  # step 0, before training
    # padded shards: every process made the same generation calls (7 problems -> 4 per process)
    assert ranks[0]["generation_calls"] == ranks[1]["generation_calls"]
    assert ranks[0]["generation_calls_in_training"] == 2 * 4  # steps 0 and 1, one call per problem of the shard
    for r in ranks + [single]:
        assert r["settings_after"] == r["settings_before"]  # training's sampling settings restored


def test_ddp_validation_equals_one_process(tiny_model_path, tmp_path, single):
    ranks = _torchrun(tiny_model_path, tmp_path)
    assert all(r["deepspeed_stage"] is None for r in ranks)
    _check_against_single(ranks, single)


def test_zero3_validation_equals_one_process(tiny_model_path, tmp_path, single):
    pytest.importorskip("deepspeed")
    ranks = _accelerate("zero3.yaml", tiny_model_path, tmp_path)
    assert all(r["deepspeed_stage"] == 3 and r["sharded"] for r in ranks)  # really sharded, not a DDP fallback
    _check_against_single(ranks, single)
