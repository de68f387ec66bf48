"""ARMOR in several processes on CPU: DDP (torchrun), DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2 (accelerate launch; FSDP
through tests/scripts/fsdp_on_cpu.py, as accelerate turns FSDP off for CPU processes), gloo backend.

Each run trains the tiny model for 3 steps with 2 processes (tests/scripts/mp_train_script.py) and every process writes
what it saw; the assertions read those files:

* ARMOR trains: the policy moves, and stays identical on every process;
* every group lives whole on one process, with its anchor in its last row, chosen from candidates that this
  process itself scored (a wrong slice of the gathered candidate rewards would pick anchors by another
  process's rewards);
* logged metrics are gathered: they equal what the per-process records add up to, and every process logs the
  same values;
* resets: ``armor/ref_resets`` counts them, the reference equals the policy right after each reset (ZeRO-3
  shards gathered to compare) and differs from it in between, and the reverse KL logged at the step after a
  reset is zero;
* checkpoints carry the reference as it was at that step, and a multi-process run resumed from one continues
  exactly like the uninterrupted run (DDP, ZeRO-3, FSDP2 with full fine-tuning and with LoRA);
* with the same seed the backends draw the same samples, so their metrics and weights must agree;
  a single-process run of the same global batch must log the same metrics and reset on the same schedule;
* validation through the trainer's generation path, sharded over the processes (DDP, ZeRO-3, FSDP2; the runs pass
  ``--validate``), gives exactly one process's avg@k / pass@k and samples on the initial weights, sampled as well
  as greedy, logs its metrics on every process during training and leaves training's sampling settings and draws
  as they were (the ZeRO-2 run, which does not validate, matches the DDP run that does);
* FSDP1 (TRL's config, in one process) is refused when the trainer is built.

Run them with ``pytest -m slow tests/test_multiprocess.py`` (the DeepSpeed tests need ``pip install deepspeed``;
the script skips DeepSpeed's CPU shared-memory op, which only tensor-parallel inference uses and whose compile at
the first launch took about 60 s of the suite). The ZeRO-3 + CPU offload run is
opt-in (``ARMOR_TEST_ZERO3_OFFLOAD=1``): its first launch also compiles DeepSpeed's CPU Adam, which takes minutes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testing import ACCELERATE_CONFIGS, REPO, SCRIPTS, _env, _free_port, _launch, fsdp_command

SCRIPT = SCRIPTS / "mp_train_script.py"
GRPO_SCRIPT = SCRIPTS / "mp_grpo_script.py"  # TRL's plain GRPOTrainer: a launch harness trains it first
NUM_PROCESSES = 2
MAX_STEPS = 3
RESET_STEPS = 2
SAVE_STEPS = 2  # checkpoints at steps 2 (right after the reset) and 3
# Two reference candidates per group: some groups find no verified anchor, so the empty-slot path is exercised.
COMMON_ARGS = ["--max_steps", str(MAX_STEPS), "--ref_reset_steps", str(RESET_STEPS), "--anchor_num_samples", "2"]
SAVING = ["--save_steps", str(SAVE_STEPS)]
# A LoRA policy (π_ref: its "ref" adapter), reset by the schedule and at an explicit step as well
LORA_RESET_AT = (1,)
LORA = ["--lora", "--ref_reset_at_steps", *map(str, LORA_RESET_AT)]
TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
# Metrics that differ between a 1-process and a 2-process run of the same global batch only through sampling.
STRUCTURAL_METRICS = ("armor/ref_resets", "armor/kl_reverse_policy", "armor/ratio_policy_mean")


def _script_args(script: Path) -> list[str]:
    return COMMON_ARGS if script == SCRIPT else []


def run_torchrun(model: str, out: Path, *extra: str, script: Path = SCRIPT) -> list[dict]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(NUM_PROCESSES),
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        str(script), "--model", model, "--out", str(out), "--ddp_backend", "gloo", *_script_args(script), *extra,
    ]  # fmt: skip
    return _launch(command, out, NUM_PROCESSES)


def run_accelerate(config: str, model: str, out: Path, *extra: str) -> list[dict]:
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ACCELERATE_CONFIGS / config), "--num_processes", str(NUM_PROCESSES),
        "--mixed_precision", "no", "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
        # DeepSpeed needs use_cpu=False (with use_cpu=True accelerate silently falls back to plain DDP);
        # on a host without GPUs DeepSpeed then picks its CPU accelerator and we ask for gloo.
        str(SCRIPT), "--model", model, "--out", str(out), "--ddp_backend", "gloo", "--no_cpu", *COMMON_ARGS, *extra,
    ]  # fmt: skip
    return _launch(command, out, NUM_PROCESSES)


def run_fsdp(model: str, out: Path, *extra: str, script: Path = SCRIPT) -> list[dict]:
    command = fsdp_command(ACCELERATE_CONFIGS / "fsdp2.yaml", script, "--model", model, "--out", str(out),
                           "--ddp_backend", "gloo", *_script_args(script), *extra)
    return _launch(command, out, NUM_PROCESSES)


def run_single(model: str, out: Path) -> list[dict]:
    # One process with the same global batch (2 processes x 8 rows = 16 rows = 4 groups per step).
    command = [
        sys.executable, str(SCRIPT), "--model", model, "--out", str(out),
        "--per_device_train_batch_size", "16", *COMMON_ARGS, "--validate",
    ]  # fmt: skip
    return _launch(command, out, 1)


# --- what every run must satisfy ---------------------------------------------------------------------------------
def _steps_logged(ranks: list[dict]) -> list[dict]:
    return [entry for entry in ranks[0]["log_history"] if "loss" in entry]


def _close(a, b, rel=1e-5, abs_=1e-6) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def resets_after(step: int, at_steps: tuple[int, ...] = ()) -> int:
    """Resets the schedule (every RESET_STEPS steps, and at ``at_steps``) made up to optimizer step ``step``."""
    return sum(1 for s in range(1, step + 1) if s % RESET_STEPS == 0 or s in at_steps)


def check_run(ranks: list[dict], processes: int, distributed_type: str, reset_at: tuple[int, ...] = ()) -> None:
    assert [r["rank"] for r in ranks] == list(range(processes))
    for r in ranks:
        assert r["world_size"] == processes
        assert r["distributed_type"].endswith(distributed_type), r["distributed_type"]
        assert r["reference_start_equals_initial"], "the reference did not start as the initial policy"

    # ARMOR trains, and the processes agree on the weights.
    for r in ranks:
        assert r["final"]["params_compared"] > 0
        assert r["final"]["policy_change"] > 1e-4, "the policy did not move"
    assert len({r["final"]["policy_checksum"] for r in ranks}) == 1, "processes hold different policies"
    assert len({r["final"]["reference_checksum"] for r in ranks}) == 1, "processes hold different references"

    # Every group lives whole on one process, with its anchor (chosen by this process's own rewards) in its last row.
    for r in ranks:
        assert [round_["step"] for round_ in r["rounds"]] == list(range(1, MAX_STEPS + 1))
        for round_ in r["rounds"]:
            where = f"rank {r['rank']}, step {round_['step']}"
            assert round_["rows"] % round_["groups"] == 0 and round_["groups"] > 0
            assert round_["candidate_prompts_match"], f"{where}: candidates scored for other prompts than the groups'"
            assert all(round_["prompts_whole"]), f"{where}: a group's rows hold different prompts"
            assert all(round_["anchor_in_last_row"]), f"{where}: a group's last row is not its anchor"
            assert all(round_["is_anchor_matches_found"]), f"{where}: armor_is_anchor disagrees with the anchors found"
            assert round_["found"] == round_["locally_verified"], (
                f"{where}: anchors found {round_['found']} but this process's own rewards verified "
                f"{round_['locally_verified']} (wrong slice of the gathered candidate rewards?)"
            )
            assert round_["rollout_reward_calls"] == 1
    for step in range(MAX_STEPS):
        prompts = [p for r in ranks for p in r["rounds"][step]["group_prompts"]]
        assert len(prompts) == len(set(prompts)), f"step {step + 1}: a group was split over processes: {prompts}"

    # Logged metrics are gathered over processes: they equal the sums of the per-process records ...
    logged = _steps_logged(ranks)
    assert [entry["step"] for entry in logged] == list(range(1, MAX_STEPS + 1))
    for entry in logged:
        rounds = [r["rounds"][entry["step"] - 1] for r in ranks]
        found = [f for round_ in rounds for f in round_["found"]]
        assert _close(entry["armor/anchor_found_frac"], sum(found) / len(found)), (entry["step"], found)
        assert _close(entry["armor/groups_dropped_frac"], 1 - sum(found) / len(found))
        scored = []  # rewards of the group members: on-policy rows scored in the rollout, anchors verified (1.0)
        for round_ in rounds:  # (an anchor keeps the score it was verified with; an empty slot is no member)
            assert len(round_["rollout_rewards"]) == round_["rows"] - round_["groups"]  # anchors not scored again
            scored += round_["rollout_rewards"] + [1.0] * sum(round_["found"])
        assert _close(entry["rewards/has_digit/mean"], sum(scored) / len(scored)), (entry["step"], scored)
    # ... and every process logs the same values.
    for r in ranks[1:]:
        for mine, theirs in zip(ranks[0]["log_history"], r["log_history"], strict=True):
            for key, value in mine.items():
                if key not in TIMING_KEYS:
                    assert theirs.get(key) == value, f"rank {r['rank']} logged {key}={theirs.get(key)}, rank 0 {value}"

    # Resets: counted, the reference equals the policy right after each one and differs in between.
    for r in ranks:
        for record in r["steps"]:
            due = record["step"] % RESET_STEPS == 0 or record["step"] in reset_at
            assert record["reset_now"] == due, record
            assert record["resets"] == resets_after(record["step"], reset_at), record
            if due:
                assert record["ref_policy_max_diff"] == 0.0, f"rank {r['rank']}: reference != policy after a reset"
                assert record["reference_checksum"] == record["policy_checksum"]
            else:
                assert record["ref_policy_max_diff"] > 0.0, f"rank {r['rank']}: reference followed the policy"
        assert r["final"]["resets"] == resets_after(MAX_STEPS, reset_at)
    for r in ranks:  # checkpoints carry the reference as it was at that step (ZeRO-3: gathered from the shards)
        for name, saved in r["checkpoints"].items():
            step = int(name.split("-")[1])
            record = r["steps"][step - 1]
            assert saved.get("state", {}).get("resets") == resets_after(step, reset_at), (name, saved)
            assert _close(saved.get("reference_checksum"), record["reference_checksum"], rel=1e-9), (name, saved)
    for entry in logged:
        # logged before the step's update
        assert entry["armor/ref_resets"] == resets_after(entry["step"] - 1, reset_at)
        previous = entry["step"] - 1
        if previous % RESET_STEPS == 0 or previous in reset_at:  # π_ref equals the policy that generated this round
            assert abs(entry["armor/kl_reverse_policy"]) < 1e-6, entry
            assert _close(entry["armor/ratio_policy_mean"], 1.0)


def _training_logs(rank: dict) -> list[dict]:
    return [entry for entry in rank["log_history"] if not any(key.startswith("val/") for key in entry)]


def check_same_run(ranks: list[dict], baseline: list[dict], what: str) -> None:
    """Two backends, same seed and data: same samples, so the same metrics and (up to float noise) weights."""
    for r, b in zip(ranks, baseline, strict=True):
        for mine, theirs in zip(r["rounds"], b["rounds"], strict=True):
            for key in ("group_prompts", "found", "rollout_rewards", "is_anchor"):
                assert mine[key] == theirs[key], f"{what}: rank {r['rank']} step {mine['step']} {key} differs"
        for mine, theirs in zip(_training_logs(r), _training_logs(b), strict=True):
            for key, value in theirs.items():
                if key in TIMING_KEYS or not isinstance(value, (int, float)):
                    continue
                assert _close(mine.get(key), value, rel=1e-3, abs_=1e-5), f"{what}: {key} {mine.get(key)} vs {value}"
        assert _close(r["final"]["policy_checksum"], b["final"]["policy_checksum"], rel=1e-6)
        assert _close(r["final"]["reference_checksum"], b["final"]["reference_checksum"], rel=1e-6)


def check_validation(ranks: list[dict], single: list[dict]) -> None:
    """Sharded validation equals one process's on the same (initial) weights, and is logged on every process."""
    one = single[0]["validation"]
    assert 0 < sum(one["sampled"]["correct_counts"]) < 4 * 7  # the sampled comparison is not vacuous
    for r in ranks:
        mine = r["validation"]
        assert mine["on_every_process"] and one["on_every_process"]
        for what in ("sampled", "greedy"):
            for key in ("correct_counts", "avg@4", "pass@2", "samples"):
                assert mine[what][key] == one[what][key], (r["rank"], what, key)
        assert mine["callback_history"][0] == one["callback_history"][0]  # step 0, before training
        assert mine["settings_after"] == mine["settings_before"]  # training's sampling settings restored
    # during training: the last step's validation is in log_history on every process, with the same values
    val_entries = [[e for e in r["log_history"] if any(k.startswith("val/") for k in e)] for r in ranks]
    assert [e["step"] for e in val_entries[0]] == [MAX_STEPS] and all(v == val_entries[0] for v in val_entries)
    assert val_entries[0][0]["val/avg@4"] == ranks[0]["validation"]["callback_history"][-1]["val/avg@4"]
    # padded shards (7 problems -> 4 per process): every process made the same generation calls
    calls = [r["validation"]["generation_calls"] for r in ranks]
    assert all(c == calls[0] for c in calls)
    assert ranks[0]["validation"]["generation_calls_in_training"] == 2 * 4  # steps 0 and 3, a call per problem


def check_resumed(resumed: list[dict], full: list[dict], from_step: int, what: str) -> None:
    """A run resumed from checkpoint-``from_step`` continues exactly like the uninterrupted run."""
    for r, f in zip(resumed, full, strict=True):
        assert [round_["step"] for round_ in r["rounds"]] == list(range(from_step + 1, MAX_STEPS + 1))
        for mine, theirs in zip(r["rounds"], f["rounds"][from_step:], strict=True):
            for key in ("group_prompts", "found", "rollout_rewards", "is_anchor"):
                assert mine[key] == theirs[key], f"{what}: rank {r['rank']} step {mine['step']} {key} differs"
        for mine, theirs in zip(r["steps"], f["steps"][from_step:], strict=True):
            assert mine["resets"] == theirs["resets"], f"{what}: the resumed run lost the reset count"
            for key in ("reference_checksum", "policy_checksum"):
                assert _close(mine[key], theirs[key], rel=1e-9), f"{what}: step {mine['step']} {key} differs"
        assert r["final"]["resets"] == f["final"]["resets"]
        assert _close(r["final"]["policy_checksum"], f["final"]["policy_checksum"], rel=1e-9)
        assert _close(r["final"]["reference_checksum"], f["final"]["reference_checksum"], rel=1e-9)
        logged = {e["step"]: e for e in r["log_history"] if "loss" in e}
        for entry in f["log_history"]:
            if "loss" in entry and entry["step"] > from_step:
                for key, value in entry.items():
                    if key not in TIMING_KEYS and isinstance(value, (int, float)):
                        assert _close(logged[entry["step"]].get(key), value, rel=1e-5), f"{what}: {key}"


# --- fixtures: one run per backend, shared by the tests of this module --------------------------------------------
@pytest.fixture(scope="module")
def ddp_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ddp")


@pytest.fixture(scope="module")
def ddp_run(tiny_model_path, ddp_dir):
    return run_torchrun(tiny_model_path, ddp_dir, *SAVING, "--validate")


@pytest.fixture(scope="module")
def zero3_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zero3")


@pytest.fixture(scope="module")
def zero3_run(tiny_model_path, zero3_dir):
    pytest.importorskip("deepspeed")
    return run_accelerate("zero3.yaml", tiny_model_path, zero3_dir, *SAVING, "--validate")


@pytest.fixture(scope="module")
def fsdp2_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp2")


@pytest.fixture(scope="module")
def fsdp2_run(tiny_model_path, fsdp2_dir):
    return run_fsdp(tiny_model_path, fsdp2_dir, *SAVING, "--validate")


@pytest.fixture(scope="module")
def fsdp2_lora_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp2_lora")


@pytest.fixture(scope="module")
def fsdp2_lora_run(tiny_model_path, fsdp2_lora_dir):
    return run_fsdp(tiny_model_path, fsdp2_lora_dir, *SAVING, *LORA)


@pytest.fixture(scope="module")
def single_run(tiny_model_path, tmp_path_factory):
    return run_single(tiny_model_path, tmp_path_factory.mktemp("single"))


# --- tests ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ddp_two_processes(ddp_run):
    check_run(ddp_run, NUM_PROCESSES, "MULTI_CPU")
    for r in ddp_run:
        assert r["reference_type"] == "LlamaForCausalLM" and not r["reference_sharded"]


@pytest.mark.slow
def test_single_process_matches_ddp_structure(single_run, ddp_run):
    check_run(single_run, 1, "NO")
    single, multi = _steps_logged(single_run), _steps_logged(ddp_run)
    assert [sorted(entry) for entry in single] == [sorted(entry) for entry in multi], "logged metric names differ"
    for one, two in zip(single, multi, strict=True):
        assert one["armor/ref_resets"] == two["armor/ref_resets"]
        # one process scores the whole global batch: same number of groups and rows as the two together
        assert one["num_tokens"] > 0 and two["num_tokens"] > 0
    assert sum(r["groups"] for r in single_run[0]["rounds"]) == sum(
        round_["groups"] for r in ddp_run for round_ in r["rounds"]
    )
    assert single_run[0]["final"]["resets"] == ddp_run[0]["final"]["resets"]


@pytest.mark.slow
def test_ddp_validation_equals_one_process(ddp_run, single_run):
    assert all(r["validation"]["policy_sharded"] is False for r in ddp_run)
    check_validation(ddp_run, single_run)


@pytest.mark.slow
def test_ddp_resume_matches_uninterrupted(tiny_model_path, tmp_path, ddp_dir, ddp_run):
    checkpoint = ddp_dir / "trainer" / f"checkpoint-{SAVE_STEPS}"
    resumed = run_torchrun(tiny_model_path, tmp_path, "--resume_from", str(checkpoint))
    check_resumed(resumed, ddp_run, SAVE_STEPS, "DDP resume")


@pytest.mark.slow
def test_deepspeed_zero2(tiny_model_path, tmp_path, ddp_run):
    pytest.importorskip("deepspeed")
    ranks = run_accelerate("zero2.yaml", tiny_model_path, tmp_path, *SAVING)
    check_run(ranks, NUM_PROCESSES, "DEEPSPEED")
    assert all(r["deepspeed_stage"] == 2 and not r["reference_sharded"] for r in ranks)
    check_same_run(ranks, ddp_run, "ZeRO-2 vs DDP")


@pytest.mark.slow
def test_deepspeed_zero3(zero3_run, ddp_run):
    check_run(zero3_run, NUM_PROCESSES, "DEEPSPEED")
    assert all(r["deepspeed_stage"] == 3 and r["reference_sharded"] for r in zero3_run), "ZeRO-3 should shard π_ref"
    check_same_run(zero3_run, ddp_run, "ZeRO-3 vs DDP")


@pytest.mark.slow
def test_zero3_validation_equals_one_process(zero3_run, single_run):
    assert all(r["validation"]["policy_sharded"] for r in zero3_run)  # really sharded, not a DDP fallback
    check_validation(zero3_run, single_run)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("ARMOR_TEST_ZERO3_OFFLOAD"),
    reason="opt-in (ARMOR_TEST_ZERO3_OFFLOAD=1): the first run on a machine compiles DeepSpeed's CPU Adam (minutes)",
)
def test_deepspeed_zero3_offload(tiny_model_path, tmp_path, ddp_run):
    pytest.importorskip("deepspeed")
    ranks = run_accelerate("zero3_offload.yaml", tiny_model_path, tmp_path, *SAVING)
    check_run(ranks, NUM_PROCESSES, "DEEPSPEED")
    assert all(r["deepspeed_stage"] == 3 and r["reference_sharded"] for r in ranks)
    check_same_run(ranks, ddp_run, "ZeRO-3 offload vs DDP")


@pytest.mark.slow
def test_deepspeed_zero3_resume_matches_uninterrupted(tiny_model_path, tmp_path, zero3_dir, zero3_run):
    checkpoint = zero3_dir / "trainer" / f"checkpoint-{SAVE_STEPS}"
    resumed = run_accelerate("zero3.yaml", tiny_model_path, tmp_path, "--resume_from", str(checkpoint))
    check_resumed(resumed, zero3_run, SAVE_STEPS, "ZeRO-3 resume")


@pytest.mark.slow
def test_plain_grpo_trainer_trains_under_fsdp2_on_cpu(tiny_model_path, tmp_path):
    """The FSDP harness is honest (testing.allow_fsdp_on_cpu): TRL's own GRPOTrainer, no ARMOR, trains with its
    parameters sharded, and on the same seed ends where DDP ends."""
    fsdp = run_fsdp(tiny_model_path, tmp_path / "fsdp2", script=GRPO_SCRIPT)
    ddp = run_torchrun(tiny_model_path, tmp_path / "ddp", script=GRPO_SCRIPT)
    assert all(r["distributed_type"].endswith("FSDP") and r["policy_sharded"] for r in fsdp)
    assert all(r["distributed_type"].endswith("MULTI_CPU") and not r["policy_sharded"] for r in ddp)
    assert len({r["final_checksum"] for r in fsdp}) == 1 and fsdp[0]["final_checksum"] != fsdp[0]["initial_checksum"]
    assert _close(fsdp[0]["final_checksum"], ddp[0]["final_checksum"], rel=1e-6)
    losses = [[entry["loss"] for entry in _steps_logged(run)] for run in (fsdp, ddp)]
    assert len(losses[0]) == MAX_STEPS and losses[0] == pytest.approx(losses[1], rel=1e-3, abs=1e-6)


@pytest.mark.slow
def test_fsdp2(fsdp2_run, ddp_run):
    check_run(fsdp2_run, NUM_PROCESSES, "FSDP")
    assert all(r["reference_sharded"] for r in fsdp2_run), "FSDP2 should shard π_ref"
    check_same_run(fsdp2_run, ddp_run, "FSDP2 vs DDP")


@pytest.mark.slow
def test_fsdp2_validation_equals_one_process(fsdp2_run, single_run):
    assert all(r["validation"]["policy_sharded"] for r in fsdp2_run)  # really sharded, not a DDP fallback
    check_validation(fsdp2_run, single_run)


@pytest.mark.slow
def test_fsdp2_resume_matches_uninterrupted(tiny_model_path, tmp_path, fsdp2_dir, fsdp2_run):
    checkpoint = fsdp2_dir / "trainer" / f"checkpoint-{SAVE_STEPS}"
    resumed = run_fsdp(tiny_model_path, tmp_path, "--resume_from", str(checkpoint))
    check_resumed(resumed, fsdp2_run, SAVE_STEPS, "FSDP2 resume")


@pytest.mark.slow
def test_fsdp2_lora(tiny_model_path, tmp_path, fsdp2_lora_run):
    """A LoRA policy under FSDP2: its reference adapter sharded with it, reset on the schedule and at an explicit
    step, and on the same seed the run ends where DDP's ends."""
    check_run(fsdp2_lora_run, NUM_PROCESSES, "FSDP", reset_at=LORA_RESET_AT)
    assert all(r["reference_type"] == "lora" and r["reference_sharded"] for r in fsdp2_lora_run)
    ddp = run_torchrun(tiny_model_path, tmp_path, *SAVING, *LORA)
    check_run(ddp, NUM_PROCESSES, "MULTI_CPU", reset_at=LORA_RESET_AT)
    check_same_run(fsdp2_lora_run, ddp, "FSDP2 LoRA vs DDP LoRA")


@pytest.mark.slow
def test_fsdp2_lora_resume_matches_uninterrupted(tiny_model_path, tmp_path, fsdp2_lora_dir, fsdp2_lora_run):
    checkpoint = fsdp2_lora_dir / "trainer" / f"checkpoint-{SAVE_STEPS}"
    resumed = run_fsdp(tiny_model_path, tmp_path, *LORA, "--resume_from", str(checkpoint))
    check_resumed(resumed, fsdp2_lora_run, SAVE_STEPS, "FSDP2 LoRA resume")


@pytest.mark.slow
def test_fsdp1_is_refused_by_the_trainer_under_accelerate_launch(tiny_model_path, tmp_path):
    """TRL's FSDP1 config (trl/accelerate_configs/fsdp1.yaml) on CPU, less the two settings accelerate refuses there
    (``fsdp_sync_module_states``, and ``fsdp_cpu_ram_efficient_loading``, which needs it): ArmorGRPOTrainer is built
    under FSDP1 and refuses at construction, naming fsdp_version 2."""
    yaml = pytest.importorskip("yaml")
    import trl

    config = yaml.safe_load((Path(trl.__file__).parent / "accelerate_configs" / "fsdp1.yaml").read_text())
    assert config["fsdp_config"]["fsdp_version"] == 1
    config["fsdp_config"].update(fsdp_sync_module_states=False, fsdp_cpu_ram_efficient_loading=False)
    (tmp_path / "fsdp1.yaml").write_text(yaml.safe_dump(config))
    command = fsdp_command(tmp_path / "fsdp1.yaml", SCRIPT, "--model", tiny_model_path, "--out", str(tmp_path / "out"),
                           "--ddp_backend", "gloo", processes=1)
    done = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and not (tmp_path / "out" / "rank0.json").exists()
    assert "ValueError: ArmorGRPOTrainer under FSDP needs fsdp_version 2, got 1" in done.stdout + done.stderr, (
        done.stdout + done.stderr)[-4000:]


# One CPU process through accelerate's distributed set-up (LOCAL_RANK set: MULTI_CPU, gloo), handed an FSDP2 plugin.
FSDP_STATE = """
import json, sys, torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor
if sys.argv[1] == "harness":
    from testing import allow_fsdp_on_cpu
    allow_fsdp_on_cpu()
accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
model = accelerator.prepare(torch.nn.Linear(4, 4))
print(json.dumps([accelerator.distributed_type.value, any(isinstance(p, DTensor) for p in model.parameters())]))
"""


@pytest.mark.parametrize("harness", [False, True])
def test_accelerate_drops_fsdp_in_cpu_processes_and_the_harness_keeps_it(harness):
    """What testing.allow_fsdp_on_cpu relies on, against the installed accelerate: without it an FSDP plugin in CPU
    processes is dropped silently (plain DDP: when this fails, accelerate runs FSDP on CPU itself and the patch can
    go); with it the state is FSDP and the prepared model's parameters are sharded DTensors."""
    env = {**_env(), "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    done = subprocess.run([sys.executable, "-c", FSDP_STATE, "harness" if harness else "plain"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    distributed_type, sharded = json.loads(done.stdout.strip().splitlines()[-1])
    assert (distributed_type, sharded) == (("FSDP", True) if harness else ("MULTI_CPU", False))


def test_accelerate_configs_are_valid():
    """The shipped configs load as accelerate launch configs, with the documented settings."""
    yaml = pytest.importorskip("yaml")
    expected = {
        "ddp.yaml": ("MULTI_GPU", None, None),
        "zero2.yaml": ("DEEPSPEED", 2, "none"),
        "zero3.yaml": ("DEEPSPEED", 3, "none"),
        "zero3_offload.yaml": ("DEEPSPEED", 3, "cpu"),
        "fsdp2.yaml": ("FSDP", None, None),
    }
    import trl
    from accelerate.commands.config.config_args import ClusterConfig

    for name, (distributed_type, stage, offload) in expected.items():
        config = yaml.safe_load((ACCELERATE_CONFIGS / name).read_text())
        assert config["compute_environment"] == "LOCAL_MACHINE"
        assert config["distributed_type"] == distributed_type
        assert config["num_processes"] == 8
        ClusterConfig.from_yaml_file(str(ACCELERATE_CONFIGS / name))  # accelerate's own parser accepts it
        if distributed_type == "FSDP":  # TRL's own FSDP2 settings
            trl_config = Path(trl.__file__).parent / "accelerate_configs" / "fsdp2.yaml"
            assert config["fsdp_config"] == yaml.safe_load(trl_config.read_text())["fsdp_config"]
            assert config["fsdp_config"]["fsdp_version"] == 2
        if stage is not None:
            ds = config["deepspeed_config"]
            assert ds["zero_stage"] == stage
            assert ds["offload_param_device"] == offload and ds["offload_optimizer_device"] == offload
