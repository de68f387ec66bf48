"""`armor-trl anchors`: bulk pre-generation of verified anchors, resumable and shardable; training on its output."""

import json
import os

import pytest
import yaml
from datasets import Dataset, load_dataset

from armor_trl.data import pregenerate
from armor_trl.rollout.anchors import anchor_rows
from armor_trl.app.cli import main
from armor_trl.data.pregenerate import AnchorSettings, TransformersSampler, finalize, generate_shards, prepare_output
from testing import capture_rounds, count_reference_rows, has_digit_reward, logged, make_trainer, write_parquet


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


# --- anchor sets checked at start (issue 19, item 3) -----------------------------------------------------------------
def anchor_set(folder, prompts, reference, texts=None, **column_overrides):
    """An anchor-set folder as `armor-trl anchors` writes it: anchors.parquet and metadata.json naming its reference."""
    os.makedirs(folder, exist_ok=True)
    rows = [{"prompt": p, "anchors": [f"{i}"] if texts is None else texts[i], "num_verified": 1}
            for i, p in enumerate(prompts)]
    for row in rows:
        row.update(column_overrides)
    write_parquet(os.path.join(folder, "anchors.parquet"), rows)
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({"reference": reference, "reference_fingerprint": pregenerate.weight_fingerprint(reference)}, f)
    return str(folder)


@pytest.fixture(scope="module")
def other_model_path(tiny_model_path, tmp_path_factory):
    """The tiny model with other weights: anchors sampled from it are not the tiny model's."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)
    path = str(tmp_path_factory.mktemp("other_model"))
    model.save_pretrained(path)
    return path


def test_anchors_from_another_reference_are_refused_unless_allowed(prompt_dataset, tiny_model_path, other_model_path,
                                                                    tmp_path):
    train = prompt_dataset.select(range(4))
    folder = anchor_set(tmp_path / "a", train["prompt"], other_model_path)
    with pytest.raises(ValueError) as error:
        pregenerate.attach_anchors(train, folder, reference=tiny_model_path)
    message = str(error.value)
    assert other_model_path in message and tiny_model_path in message and "\n" not in message
    assert "anchor_set_allow_other_reference" in message
    with pytest.warns(UserWarning, match="accepted"):
        attached = pregenerate.attach_anchors(train, folder, reference=tiny_model_path, allow_other_reference=True)
    assert attached["anchors"] == [["0"], ["1"], ["2"], ["3"]]
    same = anchor_set(tmp_path / "b", train["prompt"], tiny_model_path)  # the run's own reference: accepted silently
    assert pregenerate.attach_anchors(train, same, reference=tiny_model_path)["anchors"] == attached["anchors"]
    os.remove(os.path.join(folder, "metadata.json"))  # unknown origin: refused too
    with pytest.raises(ValueError, match="no metadata.json"):
        pregenerate.attach_anchors(train, folder, reference=tiny_model_path)


def test_train_refuses_anchors_of_another_model_before_loading_weights(tiny_model_path, other_model_path, tmp_path,
                                                                      capsys):
    from armor_trl.app.recipe.build import train_datasets
    from armor_trl.app.recipe.parsing import parse_train_args

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(dict(
        model_name_or_path=tiny_model_path, dataset_name="arithmetic", arithmetic_train_size=6, use_cpu=True,
        bf16=False, per_device_train_batch_size=8, num_generations=4, max_steps=1, report_to="none",
        output_dir=str(tmp_path / "run"), anchor_source="column", reward_funcs=["exact_integer"])))
    script, _, _, _ = parse_train_args(["--config", str(recipe)])
    folder = anchor_set(tmp_path / "anchors", train_datasets(script)[0]["prompt"], other_model_path)
    argv = ["train", "--config", str(recipe), "--anchors_dataset", folder, "--dry_run"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "armor-trl train: error: anchors_dataset" in err and other_model_path in err and tiny_model_path in err
    assert main(argv + ["--anchor_set_allow_other_reference", "true"]) == 0
    assert "accepted (anchor_set_allow_other_reference true)" in capsys.readouterr().out
    assert main(argv + ["--model_name_or_path", other_model_path]) == 0  # the model the anchors come from


def test_a_prompt_present_more_often_than_in_the_training_set_is_refused(prompt_dataset, tiny_model_path, tmp_path):
    train = prompt_dataset.select(range(3))
    prompts = list(train["prompt"]) + [train["prompt"][1]]
    folder = anchor_set(tmp_path / "dup", prompts, tiny_model_path, texts=[["a"], ["b"], ["c"], ["d"]])
    with pytest.raises(ValueError, match=r"the prompt '.*' is present 2 times \(rows 1, 3\) but 1 time"):
        pregenerate.attach_anchors(train, folder, reference=tiny_model_path)
    # a prompt the training set itself holds twice may have two rows (one per training row): their anchors pool
    doubled = Dataset.from_dict({"prompt": prompts, "answer": list(train["answer"]) + [train["answer"][1]]})
    attached = pregenerate.attach_anchors(doubled, folder, reference=tiny_model_path)
    assert attached["anchors"] == [["a"], ["b", "d"], ["c"], ["b", "d"]]


@pytest.mark.parametrize("column,value,named", [
    ("anchors", 7, "column 'anchors' has type int64"),
    ("anchors", [1, 2], r"column 'anchors' has type list<\w+: int64>"),
    ("prompt", 3.5, "column 'prompt' has type double"),
    ("num_verified", "many", "column 'num_verified' has type string"),
])
def test_wrong_typed_columns_fail_at_load_naming_column_and_type(prompt_dataset, tiny_model_path, tmp_path, column,
                                                                 value, named):
    train = prompt_dataset.select(range(2))
    folder = anchor_set(tmp_path / "typed", train["prompt"], tiny_model_path, **{column: value})
    with pytest.raises(ValueError, match=named) as error:
        pregenerate.load_anchors(folder)
    assert os.path.join(folder, "anchors.parquet") in str(error.value)


def test_every_file_error_is_one_line_naming_the_file(prompt_dataset, tiny_model_path, tmp_path):
    train = prompt_dataset.select(range(4))
    folder = anchor_set(tmp_path / "file", train["prompt"], tiny_model_path)
    file = os.path.join(folder, "anchors.parquet")
    data = open(file, "rb").read()
    cases = {}
    with open(file, "wb") as f:  # a copy cut short (a killed transfer)
        f.write(data[: len(data) // 2])
    cases["truncated or corrupt"] = folder
    empty = tmp_path / "empty.parquet"
    Dataset.from_dict({"prompt": [], "anchors": []}).to_parquet(str(empty))
    cases["0 rows"] = str(empty)
    cases["no such file"] = str(tmp_path / "gone.parquet")
    cases["no anchors.parquet in the folder"] = str(tmp_path)
    for what, path in cases.items():
        with pytest.raises(ValueError) as error:
            pregenerate.attach_anchors(train, path)
        message = str(error.value)
        assert what in message and "\n" not in message, message
        assert (os.path.join(path, "anchors.parquet") if os.path.isdir(path) else path) in message
