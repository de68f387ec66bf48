"""Resume restores the reference exactly (full and LoRA), and refuses checkpoints it cannot honour."""

import json
import os

import pytest
import torch
from peft import LoraConfig

from armor_trl.integration.checkpoint import STATE_FILE, read_state
from testing import StopAt, digit_share_reward, has_digit_reward, make_trainer

LORA = dict(peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), learning_rate=5e-2)


def run(tiny_model_path, tiny_tokenizer, dataset, output_dir, stop_at=None, resume=None, **extra):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, dataset, output_dir, reward_funcs=digit_share_reward,
        anchor_reward_threshold=0.1, ref_reset_steps=2, max_steps=5, save_strategy="steps", save_steps=3,
        anchor_cache=True, **extra,
    )
    if stop_at is not None:
        trainer.add_callback(StopAt(stop_at))
    trainer.train(resume_from_checkpoint=resume)
    reference = [p.detach().clone() for p in trainer.reference.parameters_of(trainer.unwrapped_policy())]
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    return trainer, reference, losses


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_resume_restores_the_reset_reference_exactly(kind, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    extra = LORA if kind == "lora" else {}
    _, reference, losses = run(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "straight", **extra)

    interrupted = tmp_path / "interrupted"
    first, _, _ = run(tiny_model_path, tiny_tokenizer, prompt_dataset, interrupted, stop_at=3, **extra)
    assert first.state.global_step == 3 and first.reference.resets == 1
    state = read_state(str(interrupted / "checkpoint-3"))["parts"]["reference"]
    assert state["resets"] == 1 and state["kind"] == kind

    resumed, resumed_reference, resumed_losses = run(
        tiny_model_path, tiny_tokenizer, prompt_dataset, interrupted, resume=True, **extra
    )
    assert resumed.reference.resets == 2
    assert max((a - b).abs().max().item() for a, b in zip(reference, resumed_reference)) == 0.0
    for step in (4, 5):
        assert resumed_losses[step] == pytest.approx(losses[step], abs=1e-6)


def test_resume_with_a_different_armor_configuration_is_refused(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    run(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, stop_at=3)
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, ref_reset_steps=4, max_steps=5, anchor_cache=True,
        anchor_reward_threshold=0.1,
    )
    with pytest.raises(ValueError, match="ref_reset_steps: checkpoint 2 vs now 4"):
        trainer.train(resume_from_checkpoint=True)


def test_resume_skips_an_incomplete_checkpoint_and_keeps_it(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    run(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, stop_at=3)
    partial = tmp_path / "checkpoint-4"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half-written")
    trainer, _, _ = run(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, resume=True)
    assert trainer.state.global_step == 5
    assert (tmp_path / "checkpoint-3" / STATE_FILE).exists()  # the last complete checkpoint is intact


def test_resume_from_a_checkpoint_not_written_by_armor_is_refused(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path)
    plain = tmp_path / "checkpoint-1"
    plain.mkdir()
    with pytest.raises(ValueError, match="not written"):
        trainer.train(resume_from_checkpoint=str(plain))


def test_rotation_keeps_the_last_complete_checkpoint_until_the_new_one_is_complete(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    from armor_trl.reference.policy import ReferencePolicy

    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=3, save_strategy="steps", save_steps=1,
        save_total_limit=1,
    )
    original_save = ReferencePolicy.save_weights

    def save_then_die_at_step_2(self, directory, *args, **kwargs):
        if directory.endswith("checkpoint-2"):
            raise KeyboardInterrupt("killed while writing checkpoint-2")
        return original_save(self, directory, *args, **kwargs)

    monkeypatch.setattr(ReferencePolicy, "save_weights", save_then_die_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert (tmp_path / "checkpoint-1" / STATE_FILE).exists()  # not rotated away before checkpoint-2 was complete
    monkeypatch.setattr(ReferencePolicy, "save_weights", original_save)
    resumed = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=3, save_strategy="steps", save_steps=1,
        save_total_limit=1,
    )
    resumed.train(resume_from_checkpoint=True)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]  # rotation still applies


def checkpoint_written_with(tiny_model_path, tiny_tokenizer, dataset, folder, **settings):
    """A checkpoint folder holding the ARMOR state file of a run with ``settings`` (its fingerprint as it saves it)."""
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, dataset, folder, **settings)
    checkpoint = folder / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    trainer.armor_state.save(str(checkpoint), trainer._fingerprint())
    return str(checkpoint)


LOOP_CHANGES = [  # (settings of the checkpoint, settings of the resuming run, what the refusal names)
    (dict(armor_alpha_decay_steps=4, ref_reset_at_steps=[1], mask_negative_anchor_advantage=True), {},
     ["armor_alpha_decay_steps: checkpoint 4 vs now None", "ref_reset_at_steps: checkpoint [1] vs now None",
      "mask_negative_anchor_advantage: checkpoint True vs now False"]),
    ({}, dict(armor_alpha_decay_steps=8), ["armor_alpha_decay_steps: checkpoint None vs now 8"]),
    (dict(collapse_guard="armor"), {}, ["collapse_guard: checkpoint 'armor' vs now None"]),
    ({}, dict(collapse_guard="armor"), ["collapse_guard: checkpoint None vs now 'armor'"]),
    (dict(collapse_guard="stop", collapse_guard_patience=2), dict(collapse_guard="stop"),
     ["collapse_guard_patience: checkpoint 2 vs now 3"]),
]


@pytest.mark.parametrize("saved,resumed,named", LOOP_CHANGES, ids=["to_defaults", "from_defaults", "guard_dropped",
                                                                   "guard_added", "guard_patience"])
def test_resume_compares_every_loop_field_both_ways(saved, resumed, named, tiny_model_path, tiny_tokenizer,
                                                    prompt_dataset, tmp_path):
    checkpoint = checkpoint_written_with(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "a", **saved)
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "b", **resumed)
    with pytest.raises(ValueError, match="different ARMOR configuration") as refused:
        trainer._resolve_checkpoint(checkpoint)
    for text in named:
        assert text in str(refused.value)
    same = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "c", **saved)
    assert same._resolve_checkpoint(checkpoint) == checkpoint  # the same settings resume


def test_a_checkpoint_without_a_later_loop_field_resumes_at_its_default(tiny_model_path, tiny_tokenizer,
                                                                        prompt_dataset, tmp_path):
    # written before armor_alpha_decay_steps existed: its fingerprint has no such key
    checkpoint = checkpoint_written_with(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "a")
    path = os.path.join(checkpoint, STATE_FILE)
    state = json.loads(open(path).read())
    assert "armor_alpha_decay_steps" not in state["config"]
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "b")
    assert trainer._resolve_checkpoint(checkpoint) == checkpoint
    state["parts"]["collapse_guard"] = {"steps": [1], "scores": [0.5]}  # a guard's history this run cannot continue
    with open(path, "w") as f:
        json.dump(state, f)
    with pytest.raises(ValueError, match="ARMOR state this run does not use \\(collapse_guard\\)"):
        trainer.armor_state.load(checkpoint)


@pytest.mark.parametrize("saved,resumed", [(("has_digit_reward",), ("has_digit_reward",)),
                                           (("has_digit_reward", "digit_share_reward"),
                                            ["digit_share_reward", "has_digit_reward"])],
                         ids=["tuple", "other_order"])
def test_a_fingerprint_resumes_as_it_reads_back_and_in_any_order_of_names(saved, resumed, tiny_model_path,
                                                                          tiny_tokenizer, prompt_dataset, tmp_path):
    # the state file is JSON (a tuple reads back as a list); anchor_reward_funcs names a set of reward functions
    rewards = [has_digit_reward, digit_share_reward]
    checkpoint = checkpoint_written_with(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "a",
                                         reward_funcs=rewards, anchor_reward_funcs=saved)
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "b", reward_funcs=rewards,
                           anchor_reward_funcs=resumed)
    assert trainer._resolve_checkpoint(checkpoint) == checkpoint
    other = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "c", reward_funcs=rewards,
                         anchor_reward_funcs=["digit_share_reward"])
    with pytest.raises(ValueError, match="anchor_reward_funcs: checkpoint"):  # other names are still refused
        other._resolve_checkpoint(checkpoint)


def test_a_second_train_resuming_on_the_same_trainer_generates_afresh(tiny_model_path, tiny_tokenizer, prompt_dataset,
                                                                     tmp_path):
    # one generation per two optimizer steps: after step 3 TRL holds step 4's rows (made by the step-2 policy, with its
    # π_old / π_ref log-probs); resuming checkpoint-2 with the same trainer must not train on them
    from testing import capture_rounds

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=3,
                           steps_per_generation=2, save_strategy="steps", save_steps=2)
    rounds = capture_rounds(trainer)
    trainer.train()
    assert len(rounds) == 2
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert trainer.state.global_step == 3
    assert len(rounds) == 3  # step 3 of the second call trained on rows generated in that call


def run_deferred(tiny_model_path, tiny_tokenizer, dataset, output_dir, stop_at=None, resume=None):
    """Dynamic sampling whose mixed groups draw their anchors after the refill loop (anchor_filter='keep',
    anchor_deferred), with resets and the anchor cache."""
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, dataset, output_dir, reward_funcs=has_digit_reward,
                           ref_reset_steps=2, max_steps=4, save_strategy="steps", save_steps=2, anchor_cache=True,
                           dynamic_sampling=True, anchor_filter="keep", anchor_same_call=False)
    if stop_at is not None:
        trainer.add_callback(StopAt(stop_at))
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.anchor_rollout.counts["deferred_groups"] > 0
    reference = [p.detach().clone() for p in trainer.reference.parameters_of(trainer.unwrapped_policy())]
    return trainer, reference, {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_resume_with_anchors_drawn_after_the_refill_loop_continues_exactly(tiny_model_path, tiny_tokenizer,
                                                                           prompt_dataset, tmp_path):
    from testing import check_exact_resume

    check_exact_resume(run_deferred, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path)
