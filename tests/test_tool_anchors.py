"""Anchors on TRL's tool loop (``tools=[...]``) and with ``environment_factory``: armor_trl.rollout.tool_anchors.

The tiny tool model (armor_trl.app.tiny, ``tools=True``: a chat template that renders tool calls, a response template
that parses them back) generates through a deterministic fake at the model: the policy answers without the tool (a
wrong answer), π_ref calls the tool and then answers with its result (the right answer). So every group's on-policy
rows fail, every anchor is a π_ref trajectory with a tool call, and what each row holds is known to the token.
"""

from __future__ import annotations

import functools
import json
import re
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from armor_trl import ArmorConfig, ArmorGRPOTrainer
from testing import (G, ToolFake, anchor_rows, answer_reward, async_multiply, build_tool_trainer, capture_rounds,
                     chat_numbers, cpu_args, divide, last_tool_result, logged, multiply, row_text, tool_call)


@pytest.mark.parametrize("tool", [multiply, async_multiply], ids=["sync", "async"])
def test_anchors_are_reference_trajectories_through_the_tool_loop(tool, tool_model, tool_tokenizer, tmp_path,
                                                                   monkeypatch):
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), tools=[tool], anchor_same_call=False)
    fake = ToolFake(tool_tokenizer, trainer, tool.__name__).install(monkeypatch)
    batches = capture_rounds(trainer)
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
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), max_steps=1)
    fake = ToolFake(tool_tokenizer, trainer).install(monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    assert logged(trainer, "armor/anchor_same_call") == [1.0]
    assert not any(is_reference for is_reference, _ in fake.calls)
    # the first call: per prompt G - 1 on-policy rows and K candidates; the next: only the candidates' tool results
    assert len(fake.calls[0][1]) == 2 * (G - 1 + 2) and len(fake.calls[1][1]) == 2 * 2
    assert all("\nt:" in text for text in fake.calls[1][1])
    rows = anchor_rows(batches[0])
    assert len(rows) == 2
    assert all(row_text(tool_tokenizer, batches[0], row, mask_value=0).startswith("\nt:") for row in rows)


def test_malformed_tool_calls_are_handled_as_trl_handles_the_policys(tool_model, tool_tokenizer, tmp_path,
                                                                     monkeypatch):
    """π_ref writes tool calls TRL cannot parse (no name; not JSON): TRL's parser falls back to the text, no tool
    runs, and the anchor is that one turn, every token the model's."""
    malformed = ['<tool_call>{"arguments": {"a": 3, "b": 4}}</tool_call></s>',
                 "<tool_call>{arguments: {a: 3}}</tool_call></s>"]

    def reference_turn(text):
        return malformed[int(re.search(r"u:(\d+)\*", text).group(1)) % 2]

    def long_reward(completions, **kwargs):
        return [float(len(c[-1]["content"]) > 5) for c in completions]

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)),
                                 reward_funcs=long_reward, anchor_same_call=False)
    fake = ToolFake(tool_tokenizer, trainer, reference_turn=reference_turn).install(monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    assert not any("\nt:" in text for _, texts in fake.calls for text in texts)  # no tool ran, no second turn
    for batch in batches:
        rows = anchor_rows(batch)
        assert len(rows) == 2
        for row in rows:
            assert row_text(tool_tokenizer, batch, row) in malformed
            assert batch["tool_mask"][row].bool().all()
    assert logged(trainer, "tools/call_frequency") == [0.0, 0.0]


@pytest.mark.parametrize("setting", [
    # eligible-only: the on-policy trajectories are scored before the candidates (all wrong: kept with an anchor only)
    {"dynamic_sampling": True, "dynamic_sampling_keep_unsolved": True},
    {"dynamic_sampling": True, "dynamic_sampling_keep_unsolved": True, "anchor_filter": "keep",
     "anchor_sampling": "lazy"},
    {"peft_config": "lora"},  # π_ref is the "ref" adapter, routed into every turn
    {"use_transformers_continuous_batching": True},
    {"ref_reset_steps": 1},  # π_ref reset after every step: each round's candidates on a freshly copied reference
], ids=["dynamic_sampling", "keep_lazy_deferred", "lora", "continuous_batching", "reset_every_step"])
def test_tool_anchors_combine(setting, tool_model, tool_tokenizer, tmp_path, monkeypatch):
    from peft import LoraConfig

    setting = dict(setting)
    if setting.pop("peft_config", None):
        setting["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM")
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), anchor_same_call=False,
                                 **setting)
    fake = ToolFake(tool_tokenizer, trainer).install(monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    assert any(is_reference and any("\nt:" in text for text in texts) for is_reference, texts in fake.calls)
    # every on-policy row fails: an unsolved group is kept only with an anchor (keep_unsolved), so it draws in its
    # round (deferred tool candidates: tests/test_tool_deferred.py)
    assert trainer.anchor_rollout.counts["deferred_calls"] == 0
    for batch in batches:
        rows = anchor_rows(batch)
        assert len(rows) == 2
        for row in rows:
            n = int(re.search(r"u:(\d+)\*", tool_tokenizer.decode(batch["prompt_ids"][row])).group(1))
            assert row_text(tool_tokenizer, batch, row, mask_value=0) == f"\nt:{3 * n}\na:"
            assert row_text(tool_tokenizer, batch, row, mask_value=1).endswith(f"</tool_call></s>{3 * n}</s>")


def test_a_cached_anchor_keeps_the_tool_mask_of_the_loop_that_made_it(tool_model, tool_tokenizer, tmp_path,
                                                                     monkeypatch):
    """Stateless tools: the cache's anchor is the stored trajectory, replayed with its tool_mask (π_ref is not asked
    again for a prompt it holds), and the stored trajectories travel with the checkpoint."""
    data = chat_numbers([1, 2] * 8)  # the same two prompts every round: the second round reads the cache
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, data, anchor_same_call=False,
                                 anchor_cache=True, shuffle_dataset=False)
    fake = ToolFake(tool_tokenizer, trainer).install(monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    assert logged(trainer, "armor/anchor_cache_hit_frac")[-1] == 1.0
    assert sum(is_reference for is_reference, _ in fake.calls) == 2  # round 1: a first turn and a turn after a result
    for row in anchor_rows(batches[-1]):
        n = int(re.search(r"u:(\d+)\*", tool_tokenizer.decode(batches[-1]["prompt_ids"][row])).group(1))
        assert row_text(tool_tokenizer, batches[-1], row, mask_value=0) == f"\nt:{3 * n}\na:"
    part = trainer.armor_state.parts["tool_trajectories"]  # saved and restored with the cache (JSON)
    kept = dict(trainer.anchor_rollout.kept)
    assert len(kept) == 2
    saved = json.loads(json.dumps(part.state_dict()))
    trainer.anchor_rollout.kept = {}
    part.load_state_dict(saved)
    assert trainer.anchor_rollout.kept == kept


def counting(tool, calls: list):
    """``tool`` (its schema kept) recording each call in ``calls``."""
    @functools.wraps(tool)
    def call(*args, **kwargs):
        calls.append(kwargs)
        return tool(*args, **kwargs)

    return call


def test_trls_tool_metrics_count_a_cached_anchors_calls_once(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """TRL's ``tools/*`` count the calls its loop ran for the round's rows: a cached anchor replayed in a later round
    ran none (its stored calls are not counted again); the anchors' own metric still counts the calls its row holds."""
    calls, per_round = [], []
    data = chat_numbers([1, 2] * 8)
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, data, tools=(counting(multiply, calls),),
                                 anchor_same_call=False, anchor_cache=True, shuffle_dataset=False)
    ToolFake(tool_tokenizer, trainer).install(monkeypatch)
    batches = capture_rounds(trainer)
    generate = trainer.anchor_rollout.generate

    def counted_round(*args):
        before = len(calls)
        output = generate(*args)
        anchors = output[2]
        per_round.append((len(calls) - before, int(anchors.found.sum()), float(anchors.cache_hits[0])))
        return output

    trainer.anchor_rollout.generate = counted_round
    trainer.train()
    assert [hits for *_, hits in per_round] == [0.0, 2.0]  # the second round's anchors are the cache's
    # by hand: the calls that went into the round's rows (the anchors' trajectories; the policy calls no tool)
    in_rows = [0 if hits else found for _, found, hits in per_round]
    assert logged(trainer, "tools/call_frequency") == pytest.approx([n / len(batch["completion_ids"])
                                                                     for n, batch in zip(in_rows, batches)])
    assert logged(trainer, "armor/anchor_tool_call_frequency") == [1.0, 1.0]


def test_trls_tool_metrics_count_a_filler_slot_once(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """Under dynamic sampling a group whose anchor waits for the refill loop (``anchor_deferred``) fills its slot
    with its first on-policy row meanwhile, the very trajectory that row holds: TRL's ``tools/*`` count that
    trajectory's calls once, as its loop ran them once."""
    calls, answers = [], iter(range(10**6))

    def policy_turn(text):  # call the tool, then answer with its result on every other row (mixed groups: kept)
        result = last_tool_result(text)
        if result is None:
            return tool_call("multiply", a=int(re.search(r"u:(\d+)\*", text).group(1)), b=3)
        return f"{result}</s>" if next(answers) % 2 == 0 else "7</s>"

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(1, 9)),
                                 tools=(counting(multiply, calls),), anchor_same_call=False, max_steps=1,
                                 dynamic_sampling=True, anchor_filter="keep")
    ToolFake(tool_tokenizer, trainer, reference_turn=lambda text: "5</s>", policy_turn=policy_turn,
             policy_tools=True).install(monkeypatch)
    trainer.train()
    assert logged(trainer, "armor/generation_rounds") == [1.0] and trainer.anchor_rollout.counts["deferred_calls"]
    # by hand: one call per on-policy row (2 groups of G - 1), over the round's 8 rows
    assert len(calls) == 2 * (G - 1)
    assert logged(trainer, "tools/call_frequency") == [pytest.approx(len(calls) / (2 * G))]
    assert logged(trainer, "armor/policy_tool_call_frequency") == [1.0]


def test_what_tool_anchors_cannot_combine_with_is_refused_naming_why(tool_model, tool_tokenizer, tmp_path):
    def rollout_func(prompts, trainer):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="both tools and rollout_func.*replaces.*env_mask"):
        ArmorGRPOTrainer(model=tool_model, reward_funcs=answer_reward, processing_class=tool_tokenizer,
                         args=ArmorConfig(str(tmp_path), **cpu_args()), train_dataset=chat_numbers(range(8)),
                         tools=[multiply], rollout_func=rollout_func)
    with pytest.raises(ValueError, match="tools and a reference server.*not built.*Leave vllm_reference_server_\\* unset"):
        build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), use_vllm=True,
                           vllm_mode="server", vllm_reference_server_base_url="http://localhost:8001")


class ToolEngine:
    """A fake of TRL's vLLM wrapper (as tests/test_vllm_anchors.py's): it records which weights it holds at each
    generation (the policy's or π_ref's, pushed by ARMOR) and answers as ToolFake, with sampling log-probs."""

    def __init__(self, trainer, fake: ToolFake):
        self.trainer, self.fake, self.model, self.loaded = trainer, fake, trainer.model, "policy"
        self.generated_with = []
        self.llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(max_model_len=512)))

    def sync_weights(self):
        self.loaded = "reference" if self.model is not self.trainer.model else "policy"

    def generate(self, prompts, images, num_generations, profiler):
        texts = [self.fake.tokenizer.decode(ids) for ids in prompts]
        self.generated_with.append((self.loaded, texts))
        completions = [self.fake.tokenizer(self.fake.text(self.loaded == "reference", text),
                                           add_special_tokens=False)["input_ids"] for text in texts]
        return prompts, completions, [[[-0.5] for _ in ids] for ids in completions], None


def test_with_vllm_pi_refs_weights_are_in_the_engine_for_every_turn_of_the_candidates(tool_model, tool_tokenizer,
                                                                                     tmp_path):
    """vLLM (the policy's engine, colocated): π_ref's weights are pushed into it for the candidates' first turns and
    every turn after a tool result; anchors are never importance-corrected (NaN sampling log-probs, ratio 1)."""
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), anchor_same_call=False)
    engine = ToolEngine(trainer, ToolFake(tool_tokenizer, trainer))
    trainer.use_vllm, trainer.vllm_generation, trainer.vllm_mode = True, engine, "colocate"
    trainer._last_loaded_step, trainer.vllm_importance_sampling_correction = -1, True
    batches = capture_rounds(trainer)
    trainer.train()
    turns = [(loaded, all("\nt:" in text for text in texts)) for loaded, texts in engine.generated_with]
    # step 1: π_ref holds the policy's weights, no swap (the fake engine then answers as the policy: no tool call);
    # step 2: the policy's rows, then π_ref's weights for the candidates' first turns and their turns after a result
    assert turns == [("policy", False)] * 2 + [("policy", False), ("reference", False), ("reference", True)]
    batch = batches[1]
    rows = anchor_rows(batch)
    assert len(rows) == 2
    for row in rows:
        length = int(batch["completion_mask"][row].sum())
        assert torch.isnan(batch["sampling_per_token_logps"][row][:length]).all()
        assert (batch["importance_sampling_ratio"][row] == 1).all()
        assert row_text(tool_tokenizer, batch, row, mask_value=0).startswith("\nt:")


@pytest.fixture(scope="module")
def tool_vlm(tmp_path_factory):
    from armor_trl.app.tiny import build_tiny_vlm, build_tiny_vlm_processor

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-tool-vlm"), tools=True), build_tiny_vlm_processor(tools=True)


def screenshot() -> list:
    """
    Takes a screenshot.

    Returns:
        The screenshot and its caption.
    """
    from PIL import Image

    return [{"type": "image", "image": Image.new("RGB", (56, 56), color="red")}, {"type": "text", "text": "shot"}]


def test_a_tool_that_returns_an_image_on_a_vision_language_model(tool_vlm, tmp_path, monkeypatch):
    """A multimodal tool response: π_ref's candidate sees its screenshot in its next turn (TRL's loop hands the turn the
    image), and the anchor row carries its tool image into the batch's image fields, masked out of the loss."""
    from transformers import Qwen2VLForConditionalGeneration

    model, processor = tool_vlm

    def reference_turn(text):
        return "Done</s>" if "\nt:" in text else tool_call("screenshot")

    def done_reward(completions, **kwargs):
        return [float(c[-1]["content"].strip() == "Done") for c in completions]

    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{n}?"}] for n in range(8)]})
    trainer = ArmorGRPOTrainer(model=model, reward_funcs=done_reward, processing_class=processor, tools=[screenshot],
                               train_dataset=data, args=ArmorConfig(str(tmp_path), **cpu_args(
                                   max_completion_length=96, max_steps=2, anchor_num_samples=2,
                                   anchor_same_call=False)))
    fake = ToolFake(processor.tokenizer, trainer, reference_turn=reference_turn).install(
        monkeypatch, Qwen2VLForConditionalGeneration)
    batches = capture_rounds(trainer)
    trainer.train()
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert any(is_reference and "<|image_pad|>" in text for is_reference, texts in fake.calls for text in texts)
    for batch in batches:
        rows = anchor_rows(batch)
        assert len(rows) == 2
        for row in rows:
            ids, tool = batch["completion_ids"][row], batch["tool_mask"][row].bool()
            assert (ids == image_pad).any() and not tool[ids == image_pad].any()  # the screenshot: masked
            assert processor.tokenizer.decode(ids[tool & batch["completion_mask"][row].bool()]).endswith("Done</s>")
        assert [batch["num_images"][row] for row in rows] == [1, 1]  # (the prompts have none)


def test_tool_calls_are_logged_for_anchors_and_on_policy_rows_apart(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """π_ref calls a tool once per trajectory, for n = 0 one that raises (a failure, whose result TRL drops: it would
    overflow max_completion_length; TRL counts the call all the same), then answers; the policy never calls one."""

    def reference_call(text):
        if "\nt:" in text:
            return "done</s>"
        n = int(re.search(r"u:(\d+)\*", text).group(1))
        return tool_call("multiply", a=n, b=3) if n else tool_call("divide", a=n, b=0)

    def any_answer(completions, **kwargs):
        return [float(c[-1]["content"] != "7") for c in completions]

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers([0, 1] * 4),
                                 tools=(multiply, divide), reward_funcs=any_answer, anchor_same_call=False, max_steps=1, shuffle_dataset=False)
    ToolFake(tool_tokenizer, trainer, reference_turn=reference_call).install(monkeypatch)
    trainer.train()
    assert logged(trainer, "armor/anchor_tool_call_frequency") == [1.0]
    assert logged(trainer, "armor/anchor_tool_failure_frequency") == [0.5]  # the n = 0 group's anchor failed
    assert logged(trainer, "armor/policy_tool_call_frequency") == [0.0]
    assert logged(trainer, "tools/call_frequency") == [2 / 8] and logged(trainer, "tools/failure_frequency") == [0.5]


def test_a_run_resumed_from_its_checkpoint_repeats_the_next_step_exactly(tool_model, tool_tokenizer, tmp_path,
                                                                         monkeypatch):
    """With the anchor cache (its stored trajectories in ARMOR's checkpoint state): step 3 of a run resumed from
    step 2's checkpoint has the uninterrupted run's rows, tool masks and loss."""
    from testing import StopAt

    def run(output_dir, resume=None, stop=None):
        trainer = build_tool_trainer(tool_model, tool_tokenizer, output_dir, chat_numbers([1, 2, 3, 4] * 4),
                                     anchor_same_call=False, anchor_cache=True, max_steps=3, save_strategy="steps",
                                     save_steps=1)
        ToolFake(tool_tokenizer, trainer).install(monkeypatch)
        if stop is not None:
            trainer.add_callback(StopAt(stop))
        batches = capture_rounds(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, batches

    straight, straight_batches = run(tmp_path / "straight")
    run(tmp_path / "stopped", stop=2)
    resumed, resumed_batches = run(tmp_path / "stopped", resume=str(tmp_path / "stopped" / "checkpoint-2"))
    assert len(resumed_batches) == 1
    for key in ("completion_ids", "tool_mask", "armor_is_anchor", "advantages"):
        assert torch.equal(resumed_batches[0][key], straight_batches[-1][key]), key
    assert logged(resumed, "loss")[-1] == pytest.approx(logged(straight, "loss")[-1])
    assert resumed.anchor_rollout.kept == straight.anchor_rollout.kept


def test_without_anchors_the_policys_own_tool_loop_trains_with_the_mixed_ratio(tool_model, tool_tokenizer, tmp_path,
                                                                               monkeypatch):
    from testing import multiply_turn

    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(range(8)), use_anchors=False)
    assert trainer.anchor_rollout is None
    ToolFake(tool_tokenizer, trainer, policy_turn=multiply_turn(), policy_tools=True).install(monkeypatch)
    batches = capture_rounds(trainer)
    trainer.train()
    assert logged(trainer, "tools/call_frequency") == [1.0, 1.0]
    assert all(not batch["armor_is_anchor"].any() and (batch["tool_mask"] == 0).any() for batch in batches)
    assert "armor_ref_logps" in batches[0]  # π_ref's log-probs of the policy's own trajectories (the mixed ratio)
