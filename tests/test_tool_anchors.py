"""Anchors on TRL's tool loop (``tools=[...]``) and with ``environment_factory``: armor_trl.rollout.tool_anchors.

The tiny tool model (armor_trl.app.tiny, ``tools=True``: a chat template that renders tool calls, a response template
that parses them back) generates through a deterministic fake at the model: the policy answers without the tool (a
wrong answer), π_ref calls the tool and then answers with its result (the right answer). So every group's on-policy
rows fail, every anchor is a π_ref trajectory with a tool call, and what each row holds is known to the token.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, LlamaForCausalLM

from armor_trl import ArmorConfig, ArmorGRPOTrainer
from armor_trl.app.tiny import build_tiny_model
from armor_trl.reference.policy import REF_ADAPTER
from testing import cpu_args, logged

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

G = 4  # num_generations


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tool-model"), tools=True)


@pytest.fixture(scope="module")
def tool_tokenizer(tool_model):
    return AutoTokenizer.from_pretrained(tool_model)


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


async def async_multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


def chat_dataset(numbers) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{n}*3?"}] for n in numbers],
                              "answer": [str(3 * n) for n in numbers]})


def answer_reward(completions, answer, **kwargs):
    """1 when the last assistant message states the answer."""
    return [float(completion[-1]["role"] == "assistant" and completion[-1]["content"].strip() == expected)
            for completion, expected in zip(completions, answer)]


class ToolFake:
    """A deterministic generator at the model. The policy answers "7" at once (no tool call). π_ref calls
    ``tool_name`` with (n, 3) on its first turn, and after a tool result answers with that result. ``first_turn`` /
    ``after_tool`` override what π_ref says (token strings). Every call is recorded: (who, prompt texts)."""

    def __init__(self, tokenizer, trainer, tool_name="multiply", reference_call=None):
        self.tokenizer, self.trainer, self.tool_name = tokenizer, trainer, tool_name
        self.reference_call = reference_call or (lambda n: {"name": tool_name, "arguments": {"a": n, "b": 3}})
        self.calls = []

    def is_reference(self, model) -> bool:
        reference = self.trainer.reference
        if reference.kind == "full":
            return model is reference.model
        return self.trainer.model.active_adapter == REF_ADAPTER

    def text(self, reference: bool, prompt_text: str) -> str:
        results = re.findall(r"\nt:(\S+)\n", prompt_text)
        if results:  # (only π_ref's trajectories call the tool)
            return f"{results[-1]}</s>"
        if not reference:
            return "7</s>"
        n = int(re.search(r"u:(\d+)\*", prompt_text).group(1))
        return f"<tool_call>{json.dumps(self.reference_call(n))}</tool_call></s>"

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
            candidate = same_call and seen[text] > G - 1
            out.append(self.tokenizer(self.text(reference or candidate, text), add_special_tokens=False)["input_ids"])
        width = max(map(len, out))
        return [ids + [self.tokenizer.pad_token_id] * (width - len(ids)) for ids in out]

    def install(self, monkeypatch):
        fake = self

        def generate(model, input_ids=None, attention_mask=None, **kwargs):
            prompts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
            return torch.cat([input_ids, torch.tensor(fake.completions(model, prompts))], dim=1)

        monkeypatch.setattr(LlamaForCausalLM, "generate", generate)
        return self


def capture(trainer):
    """Every generation batch as it reaches the loss, with the round's tool masks (rows in order)."""
    batches = []
    original = trainer._generate_and_score_completions

    def recording(inputs):
        output = original(inputs)
        batches.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in output.items()})
        return output

    trainer._generate_and_score_completions = recording
    return batches


def build(tool_model, tool_tokenizer, tmp_path, dataset, tools=(multiply,), environment_factory=None,
          reward_funcs=answer_reward, **overrides):
    settings = cpu_args(**{"max_completion_length": 96, "max_steps": 2, "per_device_train_batch_size": 8,
                           "anchor_num_samples": 2, **overrides})
    return ArmorGRPOTrainer(model=tool_model, reward_funcs=reward_funcs, args=ArmorConfig(str(tmp_path), **settings),
                            train_dataset=dataset, processing_class=tool_tokenizer, tools=list(tools) or None,
                            environment_factory=environment_factory)


def anchor_rows(batch) -> list[int]:
    return batch["armor_is_anchor"].nonzero().flatten().tolist()


def row_text(tokenizer, batch, row, mask_value=None) -> str:
    ids = batch["completion_ids"][row][batch["completion_mask"][row].bool()]
    if mask_value is not None:
        ids = ids[batch["tool_mask"][row][: len(ids)] == mask_value]
    return tokenizer.decode(ids)


@pytest.mark.parametrize("tool", [multiply, async_multiply], ids=["sync", "async"])
def test_anchors_are_reference_trajectories_through_the_tool_loop(tool, tool_model, tool_tokenizer, tmp_path,
                                                                   monkeypatch):
    trainer = build(tool_model, tool_tokenizer, tmp_path, chat_dataset(range(8)), tools=[tool], anchor_same_call=False)
    fake = ToolFake(tool_tokenizer, trainer, tool.__name__).install(monkeypatch)
    batches = capture(trainer)
    trainer.train()
    assert batches and logged(trainer, "train_loss")
    for batch in batches:
        rows = anchor_rows(batch)
        assert len(rows) == 2, "one anchor per group, every group (π_ref's trajectories are all verified)"
        for row in rows:
            n = int(re.search(r"u:(\d+)\*", tool_tokenizer.decode(batch["prompt_ids"][row])).group(1))
            # the model's tokens: the tool call, then the answer; the tool's result (masked) between them
            model_text = row_text(tool_tokenizer, batch, row, mask_value=1)
            tool_text = row_text(tool_tokenizer, batch, row, mask_value=0)
            assert model_text == (f'<tool_call>{{"name": "{tool.__name__}", "arguments": {{"a": {n}, "b": 3}}}}'
                                  f"</tool_call></s>{3 * n}</s>")
            assert tool_text == f"\nt:{3 * n}\na:"
        on_policy = [r for r in range(batch["completion_ids"].size(0)) if r not in rows]
        assert all(row_text(tool_tokenizer, batch, r) == "7</s>" for r in on_policy)
        assert batch["tool_mask"][on_policy].bool().all()
    # π_ref made every call of its loop: its first turns and its turns after a tool result
    reference_calls = [texts for is_reference, texts in fake.calls if is_reference]
    assert any("\nt:" in text for texts in reference_calls for text in texts)
    assert not any("\nt:" in text for is_reference, texts in fake.calls if not is_reference for text in texts)
    # TRL's tool metrics count the round's rows, anchors included: 2 anchors with one call each in 8 rows
    assert logged(trainer, "tools/call_frequency")[-1] == pytest.approx(2 / 8)
    assert logged(trainer, "tools/failure_frequency")[-1] == 0.0


def test_a_same_call_round_runs_the_candidates_in_the_policys_own_loop(tool_model, tool_tokenizer, tmp_path,
                                                                       monkeypatch):
    """π_ref = π_θ (the first step): the K candidates per group are extra rows of the policy's call and of its tool
    loop; no generation call is routed to π_ref, and the anchors are still the candidates' whole trajectories."""
    trainer = build(tool_model, tool_tokenizer, tmp_path, chat_dataset(range(8)), max_steps=1)
    fake = ToolFake(tool_tokenizer, trainer).install(monkeypatch)
    batches = capture(trainer)
    trainer.train()
    assert logged(trainer, "armor/anchor_same_call") == [1.0]
    assert not any(is_reference for is_reference, _ in fake.calls)
    # the first call: per prompt G - 1 on-policy rows and K candidates; the next: only the candidates' tool results
    assert len(fake.calls[0][1]) == 2 * (G - 1 + 2) and len(fake.calls[1][1]) == 2 * 2
    assert all("\nt:" in text for text in fake.calls[1][1])
    rows = anchor_rows(batches[0])
    assert len(rows) == 2
    assert all(row_text(tool_tokenizer, batches[0], row, mask_value=0).startswith("\nt:") for row in rows)
