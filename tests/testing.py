"""Helpers shared by the test modules: reward functions, trainer factories, recorders and the launch helpers.

Imported as ``from testing import ...`` (pytest puts tests/ on ``sys.path``; the launch scripts in tests/scripts/
add it themselves). Fixtures stay in conftest.py; no test module imports another.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import LlamaForCausalLM, TrainerCallback
from trl import GRPOTrainer

from armor_trl import ArmorConfig, ArmorGRPOTrainer
from armor_trl.integration import trl_generation
from armor_trl.reference.policy import REF_ADAPTER

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
    """The rows in a batch's loss: (prompt ids, completion ids, advantage rounded to ``digits``, tool mask over the
    completion or None without tools, anchor flag), in batch order."""
    rows = []
    for i in torch.nonzero(batch["completion_mask"].sum(dim=1) > 0).flatten().tolist():
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        kept = batch["completion_mask"][i].bool()
        completion = batch["completion_ids"][i][kept].tolist()
        tools = batch["tool_mask"][i][kept].tolist() if "tool_mask" in batch else None
        rows.append((prompt, completion, round(batch["advantages"][i].item(), digits), tools,
                     bool(batch["armor_is_anchor"][i])))
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


# --- tools and environments (tests/test_tool_anchors.py, tests/test_environment_anchors.py) -------------------------
G = 4  # num_generations of build_tool_trainer


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


def divide(a: int, b: int) -> float:
    """
    Divides two integers.

    Args:
        a: The dividend.
        b: The divisor.

    Returns:
        The quotient.
    """
    return a / b


async def async_multiply(a: int, b: int) -> int:
    return multiply(a, b)


async_multiply.__doc__ = multiply.__doc__  # (TRL reads a tool's schema from its docstring)


def chat_numbers(numbers) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{n}*3?"}] for n in numbers],
                              "answer": [str(3 * n) for n in numbers]})


def answer_reward(completions, answer, **kwargs):
    """1 when the last assistant message states the answer."""
    return [float(completion[-1]["role"] == "assistant" and completion[-1]["content"].strip() == expected)
            for completion, expected in zip(completions, answer)]


def tool_call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call></s>"


def last_tool_result(prompt_text: str) -> str | None:
    results = re.findall(r"\nt:(\S+)\n", prompt_text)
    return results[-1] if results else None


def multiply_turn(tool_name="multiply"):
    """π_ref's turn on "n*3?": call ``tool_name`` with (n, 3), then answer with its result."""

    def turn(prompt_text: str) -> str:
        result = last_tool_result(prompt_text)
        if result is not None:
            return f"{result}</s>"
        return tool_call(tool_name, a=int(re.search(r"u:(\d+)\*", prompt_text).group(1)), b=3)

    return turn


class ToolFake:
    """A deterministic generator at the model: ``policy_turn`` and ``reference_turn`` map a prompt's text (everything
    the model sees, tool results included) to what the policy / π_ref says. By default the policy answers "7" at once
    (no tool call) and π_ref calls ``multiply`` and answers with its result. Every call is recorded: (π_ref's?, the
    prompt texts)."""

    def __init__(self, tokenizer, trainer, tool_name="multiply", reference_turn=None, policy_turn=None,
                 policy_tools=False):
        self.tokenizer, self.trainer, self.policy_tools = tokenizer, trainer, policy_tools
        self.reference_turn = reference_turn or multiply_turn(tool_name)
        self.policy_turn = policy_turn or (lambda text: "7</s>")
        self.calls = []

    def is_reference(self, model) -> bool:
        reference = self.trainer.reference
        if reference.kind == "full":
            return model is reference.model
        return self.trainer.model.active_adapter == REF_ADAPTER

    def text(self, reference: bool, prompt_text: str) -> str:
        return (self.reference_turn if reference else self.policy_turn)(prompt_text)

    def completions(self, model, prompts: list[list[int]]) -> list[list[int]]:
        texts = [self.tokenizer.decode(ids) for ids in prompts]
        reference = self.is_reference(model)
        self.calls.append((reference, texts))
        # a same-call round: the policy's call holds G - 1 + K rows per prompt, the last K being π_ref's candidates
        per_prompt = Counter(texts)
        same_call = not reference and set(per_prompt.values()) == {G - 1 + self.trainer.args.anchor_num_samples}
        seen, out = Counter(), []
        for text in texts:
            seen[text] += 1
            # (the policy here never calls a tool: a turn after a tool result in its call continues a candidate)
            candidate = same_call and seen[text] > G - 1 or not self.policy_tools and last_tool_result(text) is not None
            out.append(self.tokenizer(self.text(reference or candidate, text), add_special_tokens=False)["input_ids"])
        width = max(map(len, out))
        return [ids + [self.tokenizer.pad_token_id] * (width - len(ids)) for ids in out]

    def install(self, monkeypatch, model_class=LlamaForCausalLM):
        fake = self

        def generate(model, input_ids=None, attention_mask=None, **kwargs):
            prompts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
            return torch.cat([input_ids, torch.tensor(fake.completions(model, prompts))], dim=1)

        def generate_batch(model, inputs, **kwargs):
            return {f"req_{i}": SimpleNamespace(generated_tokens=[t for t in ids if t != fake.tokenizer.pad_token_id])
                    for i, ids in enumerate(fake.completions(model, [list(ids) for ids in inputs]))}

        monkeypatch.setattr(model_class, "generate", generate)
        monkeypatch.setattr(model_class, "generate_batch", generate_batch)
        return self


class DrawToolFake(ToolFake):
    """ToolFake with draws counted per prompt (``start_round`` and ``start_deferred_draw`` restart the counts): the
    policy answers at once, all right (n % 3 == 0), all wrong (n % 3 == 1) or mixed (n % 3 == 2: its j-th row of a
    round right iff j is even); π_ref's j-th draw of a prompt calls ``tool`` (``multiply(n, 3)``, or
    ``increment(3n)``) and then answers with its result iff j >= n % 4, else answers "5" at once."""

    def __init__(self, tokenizer, trainer, tool="multiply"):
        super().__init__(tokenizer, trainer, tool)
        self.tool, self.drawn = tool, {}

    def start_round(self):
        self.drawn = {}

    def start_deferred_draw(self):
        """π_ref's draws after the refill loop count from 0 for each group, as in the round it came from."""
        self.drawn = {key: j for key, j in self.drawn.items() if not key[0]}

    def text(self, reference: bool, prompt_text: str) -> str:
        result = last_tool_result(prompt_text)
        if result is not None:  # a candidate's turn after its tool result: answer with it
            return f"{result}</s>"
        n = int(re.search(r"u:(\d+)\*", prompt_text).group(1))
        key = (reference, prompt_text)
        j = self.drawn.get(key, 0)
        self.drawn[key] = j + 1
        if reference:
            if j < n % 4:
                return "5</s>"
            return tool_call(self.tool, a=n, b=3) if self.tool == "multiply" else tool_call(self.tool, step=3 * n)
        return f"{3 * n}</s>" if n % 3 == 0 or (n % 3 == 2 and j % 2 == 0) else "7</s>"

    def hook(self, trainer) -> "DrawToolFake":
        """Restart the counts at each round and at the draw after the refill loop."""
        rollout = trainer.anchor_rollout
        generate, deferred = rollout.generate, rollout.deferred_anchors
        rollout.generate = lambda *args: self.start_round() or generate(*args)
        rollout.deferred_anchors = lambda *args: self.start_deferred_draw() or deferred(*args)
        return self


def build_tool_trainer(tool_model, tool_tokenizer, tmp_path, dataset, tools=(multiply,), environment_factory=None,
                       reward_funcs=answer_reward, peft_config=None, **overrides):
    """An ArmorGRPOTrainer on the tiny tool model: 2 groups of G rows per round, K = 2 candidates, 2 steps."""
    settings = cpu_args(**{"max_completion_length": 96, "max_steps": 2, "per_device_train_batch_size": 8,
                           "anchor_num_samples": 2, **overrides})
    return ArmorGRPOTrainer(model=tool_model, reward_funcs=reward_funcs, args=ArmorConfig(str(tmp_path), **settings),
                            train_dataset=dataset, processing_class=tool_tokenizer, tools=list(tools) or None,
                            environment_factory=environment_factory, peft_config=peft_config)


def anchor_rows(batch) -> list[int]:
    return batch["armor_is_anchor"].nonzero().flatten().tolist()


def row_text(tokenizer, batch, row, mask_value=None) -> str:
    ids = batch["completion_ids"][row][batch["completion_mask"][row].bool()]
    if mask_value is not None:
        ids = ids[batch["tool_mask"][row][: len(ids)] == mask_value]
    return tokenizer.decode(ids)



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


def allow_fsdp_on_cpu() -> None:
    """Let accelerate run FSDP in CPU processes (gloo), for the FSDP tests of the launch scripts (tests/scripts/).

    torch's ``fully_shard`` shards over a CPU mesh with gloo, but accelerate turns FSDP on only inside
    ``AcceleratorState.__init__``'s branch for GPU-like distributed types (MULTI_GPU, MULTI_XPU, ...): CPU processes
    stay MULTI_CPU and the FSDP plugin is dropped without a word (the run is plain DDP). After accelerate's own
    ``__init__``, a MULTI_CPU state handed an FSDP plugin is made the FSDP state that branch makes (without mixed
    precision, which the launches turn off). tests/test_multiprocess.py checks that accelerate still drops it and
    that this still turns it on; call before the trainer (its Accelerator) is built."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def init_keeping_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init_keeping_fsdp


def end_launch(trainer) -> None:
    """End a launch script after a clean run (its record written): wait for every rank, then leave at once, without
    the interpreter's teardown. Launches aborted now and then after every rank had written its record, under load
    ("terminate called without an active exception": an FSDP2 agent launch, a vLLM server-mode launch in a
    clean-clone `make test`), with and without ``destroy_process_group`` first: the abort is in the teardown of
    torch.distributed's C++ state, which ``os._exit`` skips. Not after a failed collective (a rank left waiting would
    hang): call it where the run ended without an error."""
    trainer.accelerator.wait_for_everyone()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fsdp_command(config: Path, script: Path, *args: str, processes: int = 2) -> list[str]:
    """accelerate launch with an FSDP config in CPU processes (gloo), the script run through tests/scripts/
    fsdp_on_cpu.py (allow_fsdp_on_cpu)."""
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
        "--num_processes", str(processes), "--mixed_precision", "no", "--main_process_ip", "127.0.0.1",
        "--main_process_port", str(_free_port()), str(SCRIPTS / "fsdp_on_cpu.py"), str(script), *args,
    ]  # fmt: skip


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


# --- environments (test_environment_anchors, test_tool_deferred) ----------------------------------------------
class Registry:
    """The environment instances made in one test, in order, and the policy's pool to tell them apart."""

    def __init__(self):
        self.instances = []

    def candidates_of(self, trainer) -> list:
        policy = {id(instance) for pool in trainer._environment_pool.values() for instance in pool}
        return [instance for instance in self.instances if id(instance) not in policy]


def counter_environment(registry: Registry, with_reward: bool = True, observation: str | None = None):
    """An environment with a counter: ``increment(step)`` adds to it; its reward (``get_reward``) is 1 when the counter
    holds the row's answer."""

    class CounterEnvironment:
        def __init__(self):
            self.counter, self.resets, self.row = 0, [], None
            registry.instances.append(self)

        def reset(self, **kwargs):
            self.counter, self.row = 0, kwargs
            self.resets.append(dict(kwargs))
            return observation

        def increment(self, step: int) -> int:
            """
            Increment the counter.

            Args:
                step: Value to add.

            Returns:
                The counter.
            """
            self.counter += step
            return self.counter

    if with_reward:
        def get_reward(self) -> float:
            return float(str(self.counter) == self.row["answer"])

        CounterEnvironment.get_reward = get_reward
    return CounterEnvironment
