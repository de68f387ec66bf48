"""Helpers shared by the test modules: reward functions, trainer factories, recorders and the launch helpers.

Imported as ``from testing import ...`` (pytest puts tests/ on ``sys.path``; the launch scripts in tests/scripts/
add it themselves). Fixtures stay in conftest.py; no test module imports another.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOTrainer

from armor_trl import ArmorConfig, ArmorGRPOTrainer
from armor_trl.integration import trl_generation

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"  # what the tests launch in subprocesses (torchrun, accelerate, a killed run)
ACCELERATE_CONFIGS = REPO / "configs" / "accelerate"
LAUNCH_TIMEOUT = 420  # generous for a shared 2-core machine; a healthy run takes 20-60 s


# --- reward functions ----------------------------------------------------------------------------------------------
def has_digit_reward(completions, **kwargs):
    """1.0 when the completion contains a digit: random tiny models hit it about half the time."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(any(ch.isdigit() for ch in text)) for text in texts]


def digit_share_reward(completions, **kwargs):
    """Share of digits in the completion: a graded reward, so groups almost never have zero variance."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]


def scripted(completions, prompts, **kwargs):
    rewards = []
    for position, prompt in enumerate(prompts):
        n = int(prompt.split("+")[0])
        rewards.append(1.0 if n % 3 == 0 else 0.0 if n % 3 == 1 else float(position % 2 == 0))
    return rewards


# --- trainers ------------------------------------------------------------------------------------------------------
def cpu_args(**overrides) -> dict:
    """Arguments for a fast, deterministic CPU run of a few steps."""
    args = dict(
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=1e-2,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=42,
        disable_tqdm=True,
    )
    args.update(overrides)
    return args


def make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path, reward_funcs=has_digit_reward, **overrides):
    peft_config = overrides.pop("peft_config", None)
    ref_model = overrides.pop("ref_model", None)
    args = ArmorConfig(output_dir=str(tmp_path), **cpu_args(**overrides))
    return ArmorGRPOTrainer(
        model=tiny_model_path,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tiny_tokenizer,
        peft_config=peft_config,
        ref_model=ref_model,
    )


def trainable_state(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


# --- a loss and its gradient by the policy's log-probs ---------------------------------------------------------------
def moved(trainer, scale, seed):
    """Move the policy's weights, as optimizer steps would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)


def loss_and_gradient(trainer, batch, monkeypatch, compute_loss=None):
    """The trainer's loss on ``batch`` and its gradient with respect to the policy's per-token log-probs (the model's
    own, handed to the loss as a float64 leaf)."""
    seen = {}
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def leaf_logps(self, *args, **kwargs):
        logps, entropies, aux = original(self, *args, **kwargs)
        seen["logp"] = logps.detach().double().requires_grad_(True)
        return seen["logp"], entropies, aux

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", leaf_logps)
    loss = (compute_loss or trainer._compute_loss)(trainer.model, batch)
    loss.backward()
    monkeypatch.undo()
    return loss.detach(), seen["logp"].grad, seen["logp"].detach()


# --- recorders -----------------------------------------------------------------------------------------------------
def capture_rounds(trainer):
    """Record the output of every generation round."""
    rounds = []
    original = trainer._generate_and_score_completions

    def wrapped(inputs):
        output = original(inputs)
        rounds.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in output.items()})
        return output

    trainer._generate_and_score_completions = wrapped
    return rounds


def kept_rows(batch, digits: int = 5) -> list:
    """The rows in a batch's loss: (prompt ids, completion ids, advantage rounded to ``digits``, anchor flag), in batch
    order."""
    rows = []
    for i in torch.nonzero(batch["completion_mask"].sum(dim=1) > 0).flatten().tolist():
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        completion = batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist()
        rows.append((prompt, completion, round(batch["advantages"][i].item(), digits), bool(batch["armor_is_anchor"][i])))
    return rows


def with_a_busier_process(monkeypatch, trainer, more: int = 2) -> None:
    """Make ``trainer`` one process of two whose other process has ``more`` groups to draw in every collective count
    (the counts gathered are integer tensors of one element; every other gather sees both processes alike)."""
    def gather(tensor):
        other = tensor + more if tensor.dtype in (torch.int64, torch.int32) and tensor.numel() == 1 else tensor
        return torch.cat([tensor, other])

    monkeypatch.setattr(trainer.accelerator, "gather", gather)
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))


def reference_logps_gaps(trainer) -> list[tuple[int, float]]:
    """Records, at every loss, (optimizer step, how far the π_ref log-probs the batch carries, computed at its rollout
    batch's start, are from those of the π_ref the trainer holds then): 0 unless a reset landed inside the batch."""
    gaps, original = [], trainer._compute_loss

    def compute_loss(model, inputs):
        if "armor_ref_logps" in inputs:
            reference = trainer.reference
            with torch.no_grad(), reference.active(trainer.unwrapped_policy()):
                now = trainer._completion_logps(reference.model if reference.kind == "full" else trainer.model, inputs)
            mask = inputs["completion_mask"].bool()
            gap = (inputs["armor_ref_logps"] - now)[mask].abs().max().item() if mask.any() else 0.0
            gaps.append((trainer.state.global_step + 1, gap))
        return original(model, inputs)

    trainer._compute_loss = compute_loss
    return gaps


def count_reference_rows(monkeypatch, trainer):
    rows = []
    original = trl_generation.generate

    def recording(t, prompt_ids, num_generations):
        if t.model_wrapped is trainer.reference.model:
            rows.append(len(prompt_ids))
        return original(t, prompt_ids, num_generations)

    monkeypatch.setattr(trl_generation, "generate", recording)
    return rows


# --- data ----------------------------------------------------------------------------------------------------------
def numbers_dataset(numbers):
    return Dataset.from_dict({"prompt": [f"{n}+{n + 1}=" for n in numbers], "answer": [str(2 * n + 1) for n in numbers]})


GSM8K_ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24.\nIn total 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A farm has 1,200 hens and buys 34 more. How many now?", "answer": "1200+34=1234\n#### 1,234"},
]


def source_copy(tmp_path) -> Path:
    """What a wheel is built from (pyproject.toml, README, LICENSE, armor_trl, configs), copied to ``tmp_path/src``:
    a build then writes nothing into the repository."""
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    for name in ("armor_trl", "configs"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return src


def load_gpu_check():
    """scripts/gpu_check.py as a module (a script, not part of the package), for the parts that run without a GPU."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_parquet(path, rows):
    Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


# --- launching scripts in subprocesses (tests/scripts/) ------------------------------------------------------------
def _env() -> dict:
    env = os.environ.copy()
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(command: list[str], out: Path, processes: int) -> list[dict]:
    """Run a launcher command; return the per-process result files, in rank order."""
    try:
        done = subprocess.run(
            command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
        )
    except subprocess.TimeoutExpired as error:
        tail = (error.stdout or b"")[-4000:] if isinstance(error.stdout, bytes) else (error.stdout or "")[-4000:]
        pytest.fail(f"{' '.join(command)} timed out after {LAUNCH_TIMEOUT}s:\n{tail}")
    if done.returncode != 0:
        log = done.stdout + done.stderr
        errors = [line for line in log.splitlines() if "Error" in line or "error" in line]
        pytest.fail(
            f"{' '.join(map(str, command))} exited with {done.returncode}.\nError lines:\n"
            + "\n".join(errors[-10:])
            + f"\n--- output tail ---\n{log[-6000:]}"
        )
    files = sorted(out.glob("rank*.json"))
    assert len(files) == processes, f"expected {processes} result files, got {[f.name for f in files]}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(processes)]


def check_exact_resume(run, tiny_model_path, tiny_tokenizer, dataset, tmp_path, steps=(3, 4)):
    """A run stopped at step 2 and resumed ends like the straight run: same resets, π_ref's tensors, later losses.
    ``run(model, tokenizer, dataset, out, stop_at=None, resume=False)`` returns (trainer, reference tensors,
    {step: loss})."""
    straight, reference, losses = run(tiny_model_path, tiny_tokenizer, dataset, tmp_path / "straight")
    interrupted = tmp_path / "interrupted"
    first, _, _ = run(tiny_model_path, tiny_tokenizer, dataset, interrupted, stop_at=2)
    assert first.state.global_step == 2 and first.reference.resets == 1
    resumed, resumed_reference, resumed_losses = run(tiny_model_path, tiny_tokenizer, dataset, interrupted,
                                                     resume=True)
    assert resumed.reference.resets == straight.reference.resets == 2
    assert all(torch.equal(a, b) for a, b in zip(reference, resumed_reference))
    for step in steps:
        assert resumed_losses[step] == pytest.approx(losses[step], abs=1e-6)
