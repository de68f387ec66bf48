"""An agent (TRL's tool loop, ``tools=[multiply]``) in two processes generating through TRL's own vLLM generation
object in server mode (``trl.generation.vllm_generation.VLLMGeneration``, its ``generate`` unchanged: it gathers every
process's prompts, the main process asks the server, every process takes its slice), with a fake server client that
answers each prompt with a completion naming the prompt's number (launched by tests/test_multiprocess_vllm_server.py).

On "n*3?" a row calls ``multiply(a=n, b=3)`` when n % 3 != 0 and then answers "n=<n>"; else it answers "n=<n>" at
once. So the processes send different numbers of rows in the tool turns, and some processes none (unequal turns).
Every process writes ``OUT/rank{R}.json``: per row of every round whether its completion names its own prompt, the
rows each process sent per tool turn, or the error it stopped with.

    torchrun --nproc_per_node 2 tests/scripts/mp_vllm_server_script.py --model DIR --out DIR [--no_anchors | --plain]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]  # the repository root, tests/

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402

from armor_trl import ArmorConfig, ArmorGRPOTrainer  # noqa: E402
from testing import chat_numbers, end_launch, last_tool_result, multiply, tool_call  # noqa: E402


def answer(prompt_text: str) -> str:
    """The server's completion of a prompt: it names the prompt's number (module docstring)."""
    found = re.findall(r"u:(\d+)\*", prompt_text)
    if not found:  # a throw-away row (one token of a prompt)
        return "</s>"
    n = int(found[-1])
    if n % 3 and last_tool_result(prompt_text) is None:
        return tool_call("multiply", a=n, b=3)
    return f"n={n}</s>"


class FakeServer:
    """What VLLMClient.generate returns, on the main process: ``n`` completions per prompt, each naming it."""

    def __init__(self, tokenizer):
        self.tokenizer, self.turn_rows = tokenizer, []

    def generate(self, prompts, features=None, n=1, **sampling):
        completions = [self.tokenizer(answer(self.tokenizer.decode(ids)), add_special_tokens=False)["input_ids"]
                       for ids in prompts for _ in range(n)]
        return {"prompt_ids": prompts, "completion_ids": completions,
                "logprobs": [[[-0.5] for _ in ids] for ids in completions]}


def server_engine(trainer, tokenizer, monkeypatch):
    """TRL's VLLMGeneration in server mode, built by its own constructor (its connection to a server left out), with
    the fake client; weight pushes are recorded, not sent."""
    monkeypatch.setattr(VLLMGeneration, "_init_vllm", lambda self: None)
    engine = VLLMGeneration(model=trainer.model, accelerator=trainer.accelerator,
                            processing_class=tokenizer, mode="server",
                            max_completion_length=trainer.max_completion_length)
    engine.vllm_client = FakeServer(tokenizer)
    engine.sync_weights = lambda: None
    trainer.use_vllm, trainer.vllm_mode, trainer.vllm_generation = True, "server", engine
    trainer._last_loaded_step, trainer.vllm_importance_sampling_correction = -1, False
    return engine


def named_reward(completions, **kwargs):
    """1 when the last message names a number (every trajectory that ends: anchors are found)."""
    return [float(c[-1]["content"].startswith("n=")) for c in completions]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--no_anchors", action="store_true")
    parser.add_argument("--plain", action="store_true", help="plain trl.GRPOTrainer")
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    settings = dict(output_dir=os.path.join(cli.out, "trainer"), per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=96, max_steps=3, learning_rate=1e-2, use_cpu=True, ddp_backend="gloo",
                    ddp_timeout=60, bf16=False, gradient_checkpointing=False, report_to="none", logging_steps=1,
                    save_strategy="no", seed=42, disable_tqdm=True)
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    common = dict(model=cli.model, reward_funcs=named_reward,
                  train_dataset=chat_numbers(range(24)), processing_class=tokenizer, tools=[multiply])
    if cli.plain:
        trainer = GRPOTrainer(args=GRPOConfig(**settings), **common)
    else:
        trainer = ArmorGRPOTrainer(args=ArmorConfig(**settings, anchor_num_samples=2, anchor_same_call=False,
                                                    use_anchors=not cli.no_anchors), **common)
    monkeypatch = pytest.MonkeyPatch()
    server_engine(trainer, tokenizer, monkeypatch)
    rows, turns = [], []
    generate = VLLMGeneration.generate

    def recorded(engine, prompts, images, num_generations, profiler=None):
        if num_generations == 1:  # a tool turn: the rows each process sends
            count = torch.tensor([len(prompts)])
            turns.append(trainer.accelerator.gather(count).tolist())
        return generate(engine, prompts, images, num_generations, profiler)

    monkeypatch.setattr(VLLMGeneration, "generate", recorded)
    original = trainer._generate

    def checked(prompts):  # every row's completion names its own prompt
        output = original(prompts)
        prompt_ids, completion_ids = output[0], output[1]
        for p_ids, c_ids in zip(prompt_ids, completion_ids, strict=True):
            n = re.findall(r"u:(\d+)\*", tokenizer.decode(p_ids))[-1]
            text = tokenizer.decode(c_ids)
            named = re.findall(r"n=(\d+)", text) + re.findall(r'"a": (\d+)', text)
            rows.append(bool(named) and all(m == n for m in named))
        return output

    trainer._generate = checked
    error = None
    try:
        trainer.train()
    except Exception as caught:  # noqa: BLE001 (recorded: plain GRPOTrainer's outcome is what the test reads)
        error = f"{type(caught).__name__}: {caught}"[:500]
    record = {"rank": trainer.accelerator.process_index, "rows_own": rows, "turn_rows": turns, "error": error}
    with open(os.path.join(cli.out, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(record, f)
    if error is None:  # not after a failed collective
        end_launch(trainer)


if __name__ == "__main__":
    main()
