"""`armor-trl anchors`: bulk pre-generation of verified anchors, resumable and shardable; training on its output."""

import json
import os

import pytest
import yaml
from datasets import Dataset, load_dataset

from armor_trl import pregenerate
from armor_trl.anchors import anchor_rows
from armor_trl.cli import main
from armor_trl.pregenerate import AnchorSettings, TransformersSampler, finalize, generate_shards, prepare_output
from testing import capture_rounds, count_reference_rows, has_digit_reward, logged, make_trainer


def settings_for(path, **overrides):
    values = dict(reference=path, num_candidates=4, max_anchors_per_prompt=2, threshold=1.0,
                  reward_funcs=["has_digit_reward"], max_completion_length=8, seed=3, shard_size=4)
    values.update(overrides)
    return AnchorSettings(**values)


def run(dataset, settings, tokenizer, output, rank=0, world=1):
    prepare_output(str(output), settings, is_main=rank == 0)
    sampler = TransformersSampler(settings.reference, settings, tokenizer, "cpu", batch_size=3)
    counts = generate_shards(dataset, settings, [has_digit_reward], tokenizer, sampler, str(output), rank, world,
                             progress=False)
    return counts, finalize(str(output), settings, len(dataset))


def merged(output):
    return load_dataset("parquet", data_files=os.path.join(output, "anchors.parquet"), split="train").to_list()


@pytest.fixture
def twelve_prompts(prompt_dataset):
    return prompt_dataset.select(range(12))


@pytest.fixture
def uninterrupted(tiny_model_path, tiny_tokenizer, twelve_prompts, tmp_path):
    output = tmp_path / "full"
    run(twelve_prompts, settings_for(tiny_model_path), tiny_tokenizer, output)
    return merged(output)


def test_dataset_holds_verified_anchors_and_reloads_exactly(uninterrupted, twelve_prompts, tmp_path, tiny_model_path, tiny_tokenizer):
    rows = uninterrupted
    assert [r["prompt"] for r in rows] == twelve_prompts["prompt"] and [r["answer"] for r in rows] == twelve_prompts["answer"]
    anchors = [a for r in rows for a in r["anchors"]]
    assert anchors and all(has_digit_reward(anchors))  # every kept anchor passes the verifier
    for r in rows:  # distinct verified completions, at most M = 2, none where no candidate was verified
        assert len(set(r["anchors"])) == len(r["anchors"]) <= min(r["num_verified"], 2)
        assert bool(r["anchors"]) == (r["num_verified"] > 0)
    assert any(r["num_verified"] < 4 for r in rows)  # the verifier did reject candidates
    # same settings, same samples: a second run in another folder writes the same dataset
    _, metadata = run(twelve_prompts, settings_for(tiny_model_path), tiny_tokenizer, tmp_path / "again")
    assert merged(tmp_path / "again") == rows
    assert Dataset.from_parquet(str(tmp_path / "again" / "anchors.parquet")).to_list() == rows
    assert metadata["prompts"] == 12 and metadata["prompts_with_anchor"] == sum(bool(r["anchors"]) for r in rows)
    assert metadata["num_candidates"] == 4 and metadata["reward_funcs"] == ["has_digit_reward"]


def test_a_killed_run_resumes_without_duplicates(uninterrupted, twelve_prompts, tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    output = tmp_path / "killed"
    real_write, written = pregenerate._write_shard, []

    def dying_write(rows, path):
        if len(written) == 2:  # killed while writing the third shard: only a partial temporary file is left
            with open(path + ".tmp", "w") as f:
                f.write("partial")
            raise KeyboardInterrupt
        real_write(rows, path)
        written.append(path)

    monkeypatch.setattr(pregenerate, "_write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        run(twelve_prompts, settings_for(tiny_model_path), tiny_tokenizer, output)
    assert finalize(str(output), settings_for(tiny_model_path), 12) is None  # not complete
    finished = {path: os.stat(path).st_mtime_ns for path in written}
    monkeypatch.setattr(pregenerate, "_write_shard", real_write)
    counts, _ = run(twelve_prompts, settings_for(tiny_model_path), tiny_tokenizer, output)
    assert counts["shards_written"] == 1 and counts["prompts"] == 4  # only the missing shard
    assert {path: os.stat(path).st_mtime_ns for path in written} == finished  # finished shards kept
    assert merged(output) == uninterrupted  # each prompt once, as an uninterrupted run writes it


def test_processes_take_every_nth_shard(uninterrupted, twelve_prompts, tiny_model_path, tiny_tokenizer, tmp_path):
    output = tmp_path / "sharded"
    counts, metadata = run(twelve_prompts, settings_for(tiny_model_path), tiny_tokenizer, output, rank=0, world=2)
    assert sorted(os.listdir(output / "shards")) == ["shard-00000.parquet", "shard-00002.parquet"] and metadata is None
    counts, metadata = run(twelve_prompts, settings_for(tiny_model_path), tiny_tokenizer, output, rank=1, world=2)
    assert counts["shards_written"] == 1 and metadata["prompts"] == 12
    assert merged(output) == uninterrupted


def test_resuming_with_other_settings_is_refused(twelve_prompts, tiny_model_path, tiny_tokenizer, tmp_path):
    run(twelve_prompts.select(range(4)), settings_for(tiny_model_path, shard_size=4), tiny_tokenizer, tmp_path)
    with pytest.raises(ValueError, match="num_candidates: 4 there vs 8 now"):
        prepare_output(str(tmp_path), settings_for(tiny_model_path, num_candidates=8), is_main=True)


def test_chat_prompts_pregenerated_then_trained_on(chat_dataset, tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    dataset = chat_dataset.select(range(8))
    run(dataset, settings_for(tiny_model_path, num_candidates=6), tiny_tokenizer, tmp_path / "anchors")
    train = load_dataset("parquet", data_files=str(tmp_path / "anchors" / "anchors.parquet"), split="train")
    assert train["prompt"] == dataset["prompt"]
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, train, tmp_path / "run", anchor_source="column",
                           anchor_filter="keep", max_steps=2)
    calls = count_reference_rows(monkeypatch, trainer)
    rounds = capture_rounds(trainer)
    trainer.train()
    assert calls == []
    by_prompt = {row["prompt"][0]["content"]: row["anchors"] for row in train.to_list()}
    pad, seen = tiny_tokenizer.pad_token_id, 0
    for out in rounds:
        anchors = out["armor_is_anchor"].nonzero().flatten().tolist()
        assert set(anchors) <= set(anchor_rows(8, 4))
        for slot in anchors:
            prompt = tiny_tokenizer.decode([t for t in out["prompt_ids"][slot].tolist() if t != pad])
            text = tiny_tokenizer.decode(out["completion_ids"][slot], skip_special_tokens=True)
            assert text in by_prompt[prompt[len("u:"):-len("\na:")]]
            seen += 1
    assert seen > 0 and logged(trainer, "armor/column_anchor_rejected_frac") == [0.0, 0.0]


def test_cli_two_step_workflow(tiny_model_path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(os.path.dirname(__file__))  # the recipe names its reward by import path (testing:...)
    recipe = dict(
        model_name_or_path=tiny_model_path, dataset_name="arithmetic", arithmetic_train_size=10,
        reward_funcs=["testing:has_digit_reward"], output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=1, report_to="none",
        save_strategy="no", seed=0,
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    output = tmp_path / "anchors"
    assert main(["anchors", "--config", str(path), "--output_dir", str(output), "--num_candidates", "4",
                 "--max_anchors_per_prompt", "3", "--shard_size", "4", "--no_progress"]) == 0
    printed = capsys.readouterr().out
    assert "prompts/s" in printed and "have at least one verified anchor" in printed
    metadata = json.loads((output / "metadata.json").read_text())
    assert metadata["reference"] == tiny_model_path and len(metadata["reference_fingerprint"]) == 16
    assert metadata["prompts"] == 10 and metadata["max_anchors_per_prompt"] == 3 and metadata["threshold"] == 1.0
    assert all(has_digit_reward(row["anchors"]) == [1.0] * len(row["anchors"]) for row in merged(output))
    assert main(["train", "--config", str(path), "--anchor_source", "column", "--anchors_dataset", str(output)]) == 0
