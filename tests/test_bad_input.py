"""Rows of docs/bad_input.md not covered by the module tests: each bad input gets our clear error first."""

import logging

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from armor_trl import ArmorConfig
from armor_trl.rewards.checks import RewardFunctionError
from testing import cpu_args, has_digit_reward, logged, make_trainer


def test_anchor_cache_size_below_one(tmp_path):
    with pytest.raises(ValueError, match="anchor_cache_size"):
        ArmorConfig(output_dir=str(tmp_path), anchor_cache=True, anchor_cache_size=0, **cpu_args())


def test_bf16_without_support_says_what_to_do(tmp_path, monkeypatch):
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_torch_bf16_gpu_available", lambda: False)
    args = cpu_args(bf16=True, use_cpu=False)
    with pytest.raises(ValueError, match=r"bf16=True needs a GPU with bf16 support.*leave bf16 unset.*bf16=False"):
        ArmorConfig(output_dir=str(tmp_path), **args)


@pytest.mark.parametrize("use_cpu", [False, True])
def test_bf16_left_at_trls_default_trains_in_fp32_on_a_cpu(tmp_path, monkeypatch, use_cpu):
    """TRL's default bf16=None became True: transformers' "Your setup doesn't support bf16/gpu" on a CPU, slow
    emulated bf16 with use_cpu=True. ArmorConfig resolves it to fp32 there; fp16=True still wins as in TRL."""
    import torch
    import transformers.utils

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(transformers.utils, "is_torch_bf16_gpu_available", lambda: False)
    args = cpu_args(use_cpu=use_cpu)
    del args["bf16"]
    config = ArmorConfig(output_dir=str(tmp_path), **args)
    assert config.bf16 is False and config.fp16 is False
    assert ArmorConfig(output_dir=str(tmp_path), bf16=None, **args).bf16 is False


def test_bf16_left_at_trls_default_stays_bf16_where_the_gpu_has_it(tmp_path, monkeypatch):
    import transformers.training_args
    import transformers.utils

    from armor_trl import config

    monkeypatch.setattr(config, "default_precision", lambda use_cpu=False: "fp32" if use_cpu else "bf16")
    for module in (transformers.utils, transformers.training_args):  # a GPU with bf16, as transformers sees it
        monkeypatch.setattr(module, "is_torch_bf16_gpu_available", lambda: True)
    args = cpu_args(use_cpu=False)
    del args["bf16"]
    assert ArmorConfig(output_dir=str(tmp_path), **args).bf16 is True
    assert ArmorConfig(output_dir=str(tmp_path), fp16=True, **args).bf16 is False  # TRL: fp16 set, no bf16


@pytest.mark.parametrize("capability, hip, expected", [((7, 5), None, "fp16"), ((7, 0), None, "fp16"),
                                                      ((8, 0), None, "bf16"), ((9, 0), None, "bf16"),
                                                      ((9, 4), "6.2", "bf16")])
def test_default_precision_is_fp16_on_gpus_without_native_bf16(monkeypatch, capability, hip, expected):
    """A T4 (compute capability 7.5) gets fp16 mixed precision, although torch.cuda.is_bf16_supported() says True
    there (bf16 emulated); Ampere and newer get bf16; a CPU fp32 (the notebook's precision comes from here)."""
    import torch

    from armor_trl.config import default_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert default_precision() == expected
    assert default_precision(use_cpu=True) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_precision() == "fp32"  # this machine has no other accelerator


def test_bf16_left_unset_on_a_gpu_without_native_bf16_trains_in_fp16(tmp_path, monkeypatch):
    """A T4 (default_precision "fp16"): bf16=None becomes fp16=True, not TRL's emulated bf16; an explicit choice stays."""
    from armor_trl import config

    monkeypatch.setattr(config, "default_precision", lambda use_cpu=False: "fp32" if use_cpu else "fp16")
    args = cpu_args(use_cpu=False)
    del args["bf16"]
    resolved = ArmorConfig(output_dir=str(tmp_path), **args)
    assert (resolved.bf16, resolved.fp16) == (False, True)
    assert ArmorConfig(output_dir=str(tmp_path), bf16=False, **args).fp16 is False  # fp32 asked for: kept


def test_default_precision_honours_accelerate_use_cpu(monkeypatch):
    """transformers trains on the CPU when ACCELERATE_USE_CPU is set (as `use_cpu`), so precision is fp32 there."""
    import torch

    from armor_trl.config import default_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert default_precision() == "bf16"
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert default_precision() == "fp32"
    monkeypatch.setenv("ACCELERATE_USE_CPU", "0")
    assert default_precision() == "bf16"


def test_dataset_without_prompt_column(tiny_model_path, tiny_tokenizer, tmp_path):
    dataset = Dataset.from_dict({"question": ["1+1="] * 8, "answer": ["2"] * 8})
    with pytest.raises(ValueError, match=r"'prompt' column .*\['question', 'answer'\]"):
        make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path)


def test_tokenizer_without_pad_token_pads_with_eos(tiny_model_path, prompt_dataset, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.pad_token = None
    trainer = make_trainer(tiny_model_path, tokenizer, prompt_dataset, tmp_path, max_steps=1)
    assert trainer.processing_class.pad_token == trainer.processing_class.eos_token
    trainer.train()


def test_tokenizer_without_pad_or_eos_token(tiny_model_path, prompt_dataset, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="neither a pad token nor an eos token"):
        make_trainer(tiny_model_path, tokenizer, prompt_dataset, tmp_path)


def test_prompt_longer_than_the_model_allows(tiny_model_path, tiny_tokenizer, tmp_path):
    dataset = Dataset.from_dict({"prompt": ["1+" * 200 + "1="] * 8})
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        trainer.train()


@pytest.mark.parametrize(
    "reward, message",
    [
        (lambda completions, **kw: [1.0] * (len(completions) - 1), "returned 7 rewards for 8|returned 3 rewards for 4"),
        (lambda completions, **kw: 1.0 / 0, "raised ZeroDivisionError"),
        (lambda completions, **kw: ["yes"] * len(completions), "returned 'yes'"),
        (lambda completions, **kw: None, "must return a list"),
    ],
    ids=["wrong_count", "raises", "not_a_number", "returns_none"],
)
def test_reward_function_mistakes_name_the_function(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, reward, message):
    def my_reward(completions, **kwargs):
        return reward(completions, **kwargs)

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, reward_funcs=my_reward, max_steps=1)
    with pytest.raises(RewardFunctionError, match=f"Reward function 'my_reward' ({message})"):
        trainer.train()


def test_nan_reward_is_treated_like_none(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, caplog):
    def nan_reward(completions, **kwargs):
        return [float("nan")] * len(completions)

    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, reward_funcs=[has_digit_reward, nan_reward],
        anchor_reward_threshold=1.0, max_steps=1,
    )
    with caplog.at_level(logging.WARNING):
        trainer.train()
    # like None, NaN does not apply: candidates are judged by has_digit_reward alone
    assert 0.0 < logged(trainer, "armor/anchor_found_frac")[0]
    assert "nan_reward" in caplog.text and "treated like None" in caplog.text
    only_nan = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "only", reward_funcs=[nan_reward],
        anchor_reward_threshold=0.0, max_steps=1, anchor_fail_after_rounds=0,
    )
    only_nan.train()
    assert logged(only_nan, "armor/anchor_found_frac") == [0.0]  # nothing applies: never an anchor


def test_a_verifier_that_returns_none_for_every_candidate_stops_at_the_first_round(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    def judges_nothing(completions, **kwargs):
        return [None] * len(completions)

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path,
                           reward_funcs=[has_digit_reward, judges_nothing], anchor_reward_funcs=["judges_nothing"],
                           anchor_filter="keep", max_steps=3)
    with pytest.raises(ValueError, match=r"No reward function judging correctness \(\['judges_nothing'\]; "
                                         r"anchor_reward_funcs\) returned a reward for any of the 8 reference candidates"
                                         r".*anchor_reward_threshold=1.0.*anchor_fail_after_rounds=0"):
        trainer.train()
    assert trainer.state.global_step == 0  # not three rounds of zero losses first


def distinct_characters(completions, **kwargs):
    """TRL's README reward ``len(set(c))``, shifted so that the tiny model's completions (an empty one included)
    score like a real LM's (about 11 to 13): a reward every candidate passes, far outside [0, 1]."""
    return [10.0 + len(set(text)) for text in completions]


def test_a_reward_every_candidate_passes_outside_zero_one_stops_naming_the_threshold(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path,
                           reward_funcs=distinct_characters, max_steps=5)
    with pytest.raises(ValueError, match=r"Every reference candidate of the first 3 anchor rounds \(24 of 24\) reached "
                                         r"anchor_reward_threshold=1.0, with weighted rewards outside \[0, 1\] \(from 1\d "
                                         r"to 1\d; reward functions judging correctness: \['distinct_characters'\]\)"
                                         r".*named in anchor_reward_funcs"):
        trainer.train()
    assert trainer.state.global_step == 2  # stopped in the third round
    assert logged(trainer, "armor/anchor_found_frac") == [1.0, 1.0]  # what went unnoticed: every anchor "verified"


def trls_readme_reward(completions, **kwargs):
    """TRL's README reward ``len(set(c))`` as it is: 0 for an empty completion, 1 or more for any other."""
    return [float(len(set(text))) for text in completions]


def test_a_reward_that_fails_only_empty_completions_cannot_say_incorrect(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    # the tiny model, with its end token favoured, ends some completions at once (empty text: 0 < threshold 1.0);
    # every other completion passes
    calls = []

    def counting(completions, **kwargs):
        calls.append(sum(not text.strip() for text in completions))
        return trls_readme_reward(completions)

    counting.__name__ = "trls_readme_reward"
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, reward_funcs=counting,
                           max_steps=5, generation_kwargs={"sequence_bias": {(tiny_tokenizer.eos_token_id,): 3.0}})
    with pytest.raises(ValueError, match=r"first 3 anchor rounds.*reached anchor_reward_threshold=1.0 but empty "
                                         r"completions .*cannot say \"incorrect\""):
        trainer.train()
    assert sum(calls) > 0  # there were empty completions, failed (which the check used to take as "incorrect")


@pytest.mark.parametrize("reward, overrides", [
    (lambda completions, **kw: [1.0] * len(completions), {}),  # always right, but a 0/1 reward: an easy task
    (lambda completions, **kw: [2.0 * any(c.isdigit() for c in t) for t in completions], {}),  # it can say wrong
    (distinct_characters, {"anchor_reward_funcs": ["has_digit_reward"]}),  # a shaping reward beside a verifier
    (distinct_characters, {"anchor_fail_after_rounds": 0}),  # the check off
], ids=["always_one", "zero_or_two", "shaping_beside_a_verifier", "check_off"])
def test_rewards_that_can_say_correct_train_on(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, reward,
                                               overrides):
    funcs = [has_digit_reward, reward] if "anchor_reward_funcs" in overrides else reward
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, reward_funcs=funcs,
                           max_steps=3, **overrides)
    trainer.train()
    assert trainer.state.global_step == 3


def test_a_run_whose_first_rounds_find_no_anchor_stops_naming_the_fixes(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    def reward_len(completions, **kwargs):  # the reward of TRL's GRPO quickstart: continuous, never 1.0
        return [-abs(20 - len(text)) / 20 for text in completions]

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, reward_funcs=reward_len,
                           max_steps=5)
    with pytest.raises(ValueError, match=r"No anchor in the first 3 anchor rounds.*threshold=1.0.*\['reward_len'\]"
                                         r".*anchor_filter='keep'"):
        trainer.train()
    assert trainer.state.global_step == 2  # stopped in the third round, not after a whole run of zero losses


def test_with_anchor_filter_keep_no_anchor_is_a_loud_warning_every_n_rounds(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, caplog
):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, anchor_reward_threshold=2.0,
                           max_steps=4, anchor_filter="keep", anchor_fail_after_rounds=2)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.state.global_step == 4
    assert logged(trainer, "armor/anchor_found_frac") == [0.0] * 4
    assert caplog.text.count("No anchor in the first") == 2  # after rounds 2 and 4


def test_existing_checkpoints_are_not_overwritten(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    earlier = tmp_path / "checkpoint-1"
    earlier.mkdir()
    (earlier / "model.safetensors").write_bytes(b"earlier run")
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1, save_strategy="steps", save_steps=1)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        trainer.train()
    assert (earlier / "model.safetensors").read_bytes() == b"earlier run"
    allowed = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1, overwrite_output_dir=True)
    allowed.train()


def test_resuming_a_lora_checkpoint_in_a_full_model_run_is_refused(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    from peft import LoraConfig

    lora = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1, save_strategy="steps", save_steps=1,
        peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
    )
    lora.train()
    full = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=2)
    with pytest.raises(ValueError, match="kind: checkpoint 'lora' vs now 'full'"):
        full.train(resume_from_checkpoint=True)


def test_use_cpu_under_deepspeed_on_a_gpu_machine_is_refused_at_construction(tiny_model_path, tiny_tokenizer,
                                                                              prompt_dataset, tmp_path, monkeypatch):
    import torch

    from armor_trl import ArmorGRPOTrainer

    args = ArmorConfig(output_dir=str(tmp_path), **cpu_args())  # use_cpu=True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch` with a DeepSpeed config sets
    with pytest.raises(ValueError, match=r"use_cpu=True under DeepSpeed on a machine with a GPU.*--use_cpu false"):
        ArmorGRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, args=args, train_dataset=prompt_dataset,
                         processing_class=tiny_tokenizer)
