"""anchor_source='column': anchors read from the dataset instead of sampled from the reference."""

import pytest
import torch
from datasets import Dataset

from armor_trl import ArmorConfig
from armor_trl.rollout.anchors import anchor_rows
from armor_trl.rollout.column_anchors import ColumnAnchors, anchor_texts
from armor_trl.integration.checkpoint import read_state
from testing import capture_rounds, count_reference_rows, cpu_args, logged, make_trainer


def anchor_ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def unpadded(ids, pad):
    return [t for t in ids.tolist() if t != pad]


def column_dataset(prompts, anchors):
    return Dataset.from_dict({"prompt": prompts, "answer": ["0"] * len(prompts), "anchors": anchors})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(anchor_source="teacher"), "anchor_source must be one of"),
        (dict(anchor_source="column", anchors_per_group=2), "anchors_per_group=2"),
        (dict(anchor_source="column", anchor_selection="any"), "anchor_selection='any'"),
        (dict(anchor_source="column", anchor_gate_only=True), "anchor_gate_only=True"),
        (dict(anchor_source="column", use_anchors=False), "use_anchors=False"),
        (dict(anchor_column=""), "anchor_column must be"),
    ],
)
def test_config_refuses_what_column_anchors_cannot_do(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        ArmorConfig(output_dir=str(tmp_path), **cpu_args(**kwargs))


def test_anchor_texts_accepts_strings_and_lists_only():
    assert anchor_texts({"a": "x"}, "a") == ["x"]
    assert anchor_texts({"a": ["x", "", "y"]}, "a") == ["x", "y"]
    assert anchor_texts({"a": None}, "a") == [] and anchor_texts({"a": []}, "a") == []
    with pytest.raises(ValueError, match="anchor_column='a' must hold a string or a list of strings"):
        anchor_texts({"a": 3}, "a")
    with pytest.raises(ValueError, match="lacks"):
        anchor_texts({"b": "x"}, "a")


def test_missing_column_is_refused(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    with pytest.raises(ValueError, match="anchor_column='solution'"):
        make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, anchor_source="column",
                     anchor_column="solution")


@pytest.mark.parametrize("chat", [False, True])
def test_column_anchor_fills_the_last_slot_without_reference_generation(chat, tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    prompts = [f"{i}+{i + 1}=" for i in range(16)]
    if chat:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    teacher = [f"{2 * i + 1}" for i in range(16)]  # a teacher trace per row (a string, not a list)
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, column_dataset(prompts, teacher), tmp_path,
                           anchor_source="column", max_steps=2)
    calls = count_reference_rows(monkeypatch, trainer)
    trainer.reference.model.generate = None  # any direct call would fail too
    rounds = capture_rounds(trainer)
    trainer.train()
    assert calls == []
    pad, slots = tiny_tokenizer.pad_token_id, anchor_rows(8, 4)
    for out in rounds:
        assert out["armor_is_anchor"].nonzero().flatten().tolist() == slots  # exactly one anchor, the last row
        for slot in slots:
            anchor = unpadded(out["completion_ids"][slot], pad)
            text = tiny_tokenizer.decode(anchor, skip_special_tokens=True)
            assert text in teacher and anchor == anchor_ids(tiny_tokenizer, text)
            prompt_text = tiny_tokenizer.decode(unpadded(out["prompt_ids"][slot], pad))
            assert prompt_text.endswith(f"{int(text) // 2}+{int(text) // 2 + 1}=" + ("\na:" if chat else ""))
        assert out["armor_ref_logps"].shape == out["completion_ids"].shape  # π_ref's log-probs of the anchors
    assert logged(trainer, "armor/anchor_found_frac") == [1.0, 1.0]
    assert logged(trainer, "armor/column_anchor_rejected_frac") == [0.0, 0.0]


def test_several_anchors_rotate_per_visit(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    options = {"1+2=": ["3a", "3b", "3c"], "3+4=": ["7a", "7b"]}
    dataset = column_dataset(list(options) * 4, list(options.values()) * 4)
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path, anchor_source="column", max_steps=6)
    count_reference_rows(monkeypatch, trainer)
    rounds = capture_rounds(trainer)
    trainer.train()
    picked = {prompt: [] for prompt in options}
    pad = tiny_tokenizer.pad_token_id
    for out in rounds:
        for slot in anchor_rows(8, 4):
            text = tiny_tokenizer.decode(unpadded(out["completion_ids"][slot], pad), skip_special_tokens=True)
            picked["1+2=" if text.startswith("3") else "3+4="].append(text)
    for prompt, texts in picked.items():
        n = len(options[prompt])
        assert len(texts) >= 2 * n
        for visit in range(len(texts) - n + 1):  # every n consecutive visits use every anchor once
            assert sorted(texts[visit : visit + n]) == sorted(options[prompt])
    assert sum(trainer.anchor_rollout.column.visits.values()) == 2 * 6


def test_unverified_and_empty_anchors_count_as_missing(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    # row 0: verified; row 1: a trace without a digit (fails has_digit); row 2: no anchor at all
    dataset = column_dataset(["1+2=", "3+4=", "5+6="] * 4, [["3"], ["no"], []] * 4)
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path, anchor_source="column",
                           anchor_filter="keep", per_device_train_batch_size=12, max_steps=1, shuffle_dataset=False)
    count_reference_rows(monkeypatch, trainer)
    rounds = capture_rounds(trainer)
    trainer.train()
    out = rounds[0]
    slots = anchor_rows(12, 4)
    prompts = [tiny_tokenizer.decode(unpadded(out["prompt_ids"][s], tiny_tokenizer.pad_token_id)) for s in slots]
    is_anchor = out["armor_is_anchor"][slots].tolist()
    empty_slot = out["completion_mask"][slots].sum(dim=1) == 0
    for prompt, anchored, empty in zip(prompts, is_anchor, empty_slot.tolist()):
        assert anchored == (prompt == "1+2=") and empty == (prompt != "1+2=")
    assert logged(trainer, "armor/column_anchor_rejected_frac") == [0.5]  # "no" of the two offered
    assert logged(trainer, "armor/anchor_found_frac") == [pytest.approx(1 / 3)]


def test_after_a_reset_anchors_are_sampled_online(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    dataset = column_dataset(["1+2=", "3+4="] * 8, [["3"], ["7"]] * 8)
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path, anchor_source="column",
                           ref_reset_steps=1, max_steps=3, anchor_same_call=False)
    calls = count_reference_rows(monkeypatch, trainer)
    trainer.train()
    assert calls == [2 * 4, 2 * 4]  # step 1 from the column; steps 2 and 3 after resets: K candidates per group
    assert len(logged(trainer, "armor/column_anchor_rejected_frac")) == 1


def test_rotation_state_is_saved_and_restored(tiny_model_path, tiny_tokenizer, tmp_path):
    dataset = column_dataset(["1+2=", "3+4="] * 8, [["3a", "3b", "3c"], ["7a", "7b"]] * 8)
    common = dict(anchor_source="column", save_strategy="steps", save_steps=2)
    first = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path, max_steps=2, **common)
    first.train()
    state = read_state(str(tmp_path / "checkpoint-2"))["parts"]
    column = first.anchor_rollout.column
    assert state["column_anchors"]["visits"] == column.visits and sum(column.visits.values()) == 4
    resumed = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path, max_steps=3, **common)
    resumed.train(resume_from_checkpoint=True)
    assert sum(resumed.anchor_rollout.column.visits.values()) == 4 + 2


def test_rotation_start_is_seeded(tiny_tokenizer):
    row = {"anchors": [str(i) for i in range(10)]}
    starts = {seed: ColumnAnchors("anchors", seed, tiny_tokenizer, 8).pick([1, 2, 3], row) for seed in range(6)}
    assert len(set(starts.values())) > 1
    assert ColumnAnchors("anchors", 0, tiny_tokenizer, 8).pick([1, 2, 3], row) == starts[0]


def test_a_long_anchor_is_cut_like_a_truncated_completion(tiny_tokenizer):
    columns = ColumnAnchors("anchors", 0, tiny_tokenizer, max_length=4)
    assert columns.tokenize("12345678") == tiny_tokenizer("1234", add_special_tokens=False)["input_ids"]
    assert columns.tokenize("12")[-1] == tiny_tokenizer.eos_token_id
