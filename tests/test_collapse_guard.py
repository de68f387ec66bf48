"""The collapse guard: its rule as a pure function, and in training with a scripted validation sequence."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from armor_trl import ArmorConfig
from armor_trl.callbacks.collapse_guard import best_index, collapse_detected
from armor_trl.callbacks.validation import ValidationCallback
from armor_trl.integration.checkpoint import read_state
from testing import capture_rounds, cpu_args, digit_share_reward, make_trainer


# --- the rule ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "scores, rewards, fires",
    [
        ([0.3, 0.5, 0.45, 0.35, 0.3], [1, 2, 3, 4, 5], True),  # best 0.5, then two validations ≥ 0.1 below
        ([0.3, 0.5, 0.45, 0.35], [1, 2, 3, 4], False),  # one collapsed validation only (0.45 is 0.05 below)
        ([0.3, 0.5, 0.35, 0.45, 0.3], [1, 2, 3, 4, 5], False),  # not consecutive: 0.45 breaks the run
        ([0.3, 0.5, 0.4, 0.4], [1, 2, 3, 4], True),  # exactly drop below counts (0.5 − 0.4 = 0.1, up to rounding)
        ([0.3, 0.5, 0.35, 0.3], [1, 2, 1.9, 1.95], False),  # training reward fell too: not over-optimization
        ([0.3, 0.5, 0.35, 0.3], [1, 2, 1.9, 2.1], True),  # mean of the window (2.0) ≥ reward at the best (2)
        ([0.3, 0.5, 0.35, 0.3], [1, None, 1.0, 0.5], True),  # reward at the best unknown: not checked
        ([0.5, 0.5, 0.35, 0.3], [1, 2, 1.5, 1.5], True),  # ties: the first best (reward 1) is b
        ([0.5, 0.3], [1, 2], False),  # fewer validations than patience + 1
    ],
)
def test_rule_on_scripted_sequences(scores, rewards, fires):
    assert collapse_detected(scores, rewards, drop=0.1, patience=2) is fires


def test_rule_properties_on_random_sequences():
    rng = random.Random(0)
    for _ in range(2000):
        n, patience, drop = rng.randint(1, 8), rng.randint(1, 3), rng.choice([0.05, 0.1, 0.2])
        scores = [round(rng.random(), 2) for _ in range(n)]
        rewards = [rng.choice([None, round(rng.random(), 2)]) for _ in range(n)]
        fired = collapse_detected(scores, rewards, drop, patience)
        best = best_index(scores)
        window = list(range(n - patience, n))
        if fired:
            assert best < n - patience and all(scores[best] - scores[i] >= drop - 1e-9 for i in window)
            known = [rewards[i] for i in window if rewards[i] is not None]
            assert rewards[best] is None or not known or sum(known) / len(known) >= rewards[best] - 1e-9
        else:
            collapsed = n > patience and best < n - patience and all(scores[best] - scores[i] >= drop for i in window)
            known = [rewards[i] for i in window if i >= 0 and rewards[i] is not None]
            assert not collapsed or (rewards[best] is not None and known and sum(known) / len(known) < rewards[best])
        # a new best never fires
        assert not collapse_detected(scores + [max(scores) + 0.01], rewards + [0.0], drop, patience)


# --- in training ---------------------------------------------------------------------------------------------------
SCRIPT = {0: 0.2, 1: 0.3, 2: 0.5, 3: 0.45, 4: 0.35, 5: 0.3, 6: 0.3, 7: 0.3}  # fires at step 5, best at step 2


def rising_reward():
    """A graded reward whose level rises with every call, so training reward never falls in these runs."""
    calls = []

    def reward(completions, **kwargs):
        calls.append(1)
        return [len(calls) + share for share in digit_share_reward(completions)]

    return reward


def scripted_validation(trainer, script=SCRIPT):
    callback = ValidationCallback(None, None, every_steps=1, k=2, num_samples=2).attach(trainer)
    callback._evaluate = lambda state, model, tokenizer: {"val/avg@2": script[state.global_step], "val/pass@2": 0.0}
    return callback


class Snapshot(TrainerCallback):
    """The policy's parameters at the start of every optimizer step (after the previous step's callbacks)."""

    def __init__(self, trainer):
        self.trainer, self.at = trainer, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.at[state.global_step] = {n: p.detach().clone() for n, p in self.trainer.unwrapped_policy().named_parameters()}


def guarded(tiny_model_path, tiny_tokenizer, dataset, output_dir, action="armor", **overrides):
    # rising_reward drives the scripted run and goes past 1: no verifier, so the check for rewards that cannot say
    # "incorrect" (docs/bad_input.md row 87) is off here
    overrides = {"max_steps": 7, "collapse_guard_drop": 0.1, "collapse_guard_patience": 2, "anchor_fail_after_rounds": 0,
                 **overrides}
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, dataset, output_dir, reward_funcs=rising_reward(),
                           collapse_guard=action, **overrides)
    scripted_validation(trainer)
    return trainer


def train_recording(trainer):
    """Train; return the generation rounds and a Snapshot of the policy at the start of every step."""
    rounds = capture_rounds(trainer)
    snapshot = Snapshot(trainer)
    trainer.add_callback(snapshot)
    trainer.train()
    return rounds, snapshot


def max_abs_difference(tensors, named):
    return max((tensors[name] - named[name].detach().cpu()).abs().max().item() for name in tensors)


def test_armor_action_switches_stages_at_the_collapse(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = guarded(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path)
    assert trainer.reference is not None and not trainer.armor_active  # dormant: plain GRPO until the collapse
    rounds, snapshot = train_recording(trainer)

    fired = trainer.collapse_guard.fired
    assert (fired["step"], fired["best_step"], fired["action"]) == (5, 2, "armor")
    assert fired["best_checkpoint"].endswith("checkpoint-2")
    assert trainer.armor_started_at == 5 and trainer.armor_active
    # anchors appear after the switch (steps 6, 7), not before
    assert ["armor_is_anchor" in r for r in rounds] == [False] * 5 + [True] * 2
    assert all(r["armor_is_anchor"].any() for r in rounds[5:])
    # the policy starts stage 2 with the best checkpoint's weights, and π_ref is exactly them (static reference)
    best = load_file(str(tmp_path / "checkpoint-2" / "model.safetensors"))
    policy_at_switch = snapshot.at[5]
    assert max(((best[n] - policy_at_switch[n]).abs().max().item() for n in best)) == 0.0
    reference = dict(trainer.reference.model.named_parameters())
    assert max_abs_difference(best, reference) == 0.0
    assert any(not torch.equal(snapshot.at[4][n], best[n]) for n in best)  # the weights did move after step 2
    # π_ref holds step 2's weights: logged so that its accuracy is read from step 2's validation
    held = {e["step"]: e["armor/ref_weights_step"] for e in trainer.state.log_history if "armor/ref_weights_step" in e}
    assert held and set(held) > {6} and all(held[s] == 2 for s in held if s > 5)
    # logged as an event, once
    events = [e for e in trainer.state.log_history if "collapse_guard/fired" in e]
    assert [(e["step"], e["armor/stage"]) for e in events] == [(5, 1.0)]
    assert any("armor/anchor_found_frac" in e for e in trainer.state.log_history if e["step"] > 5)
    assert not any("armor/anchor_found_frac" in e for e in trainer.state.log_history if e["step"] <= 5)


def test_stop_action_ends_training_and_names_the_best_checkpoint(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = guarded(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, action="stop", use_anchors=False,
                      use_mixed_ratio=False)
    assert trainer.reference is None
    trainer.train()
    assert trainer.state.global_step == 5
    assert trainer.collapse_guard.fired["best_checkpoint"] == str(tmp_path / "checkpoint-2")
    assert (tmp_path / "checkpoint-2" / "model.safetensors").exists()  # forced at the best validation
    assert [e["step"] for e in trainer.state.log_history if "collapse_guard/fired" in e] == [5]


def test_rollback_action_restores_the_best_checkpoint_and_keeps_the_method(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    trainer = guarded(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, action="rollback", use_anchors=False,
                      use_mixed_ratio=False)
    assert trainer.reference is None
    rounds, snapshot = train_recording(trainer)
    fired = trainer.collapse_guard.fired
    assert (fired["step"], fired["best_step"], fired["action"]) == (5, 2, "rollback")
    assert trainer.state.global_step == 7  # training goes on
    best = load_file(str(tmp_path / "checkpoint-2" / "model.safetensors"))
    assert max(((best[n] - snapshot.at[5][n]).abs().max().item() for n in best)) == 0.0  # step 6 starts from step 2
    assert any(not torch.equal(snapshot.at[4][n], best[n]) for n in best)
    assert not any("armor_is_anchor" in r for r in rounds)  # still plain GRPO: no anchors after the rollback
    events = [e for e in trainer.state.log_history if "collapse_guard/fired" in e]
    assert [e["step"] for e in events] == [5] and "armor/stage" not in events[0]


def test_resume_after_the_switch_continues_in_armor_mode_with_the_same_reference(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    from testing import StopAt

    saving = dict(save_strategy="steps", save_steps=1)
    straight = guarded(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "straight", **saving)
    straight.train()
    interrupted = guarded(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "run", **saving)
    interrupted.add_callback(StopAt(6))
    interrupted.train()
    parts = read_state(str(tmp_path / "run" / "checkpoint-6"))["parts"]
    assert parts["schedule"]["armor_started_at"] == 5 and parts["collapse_guard"]["fired"]["best_step"] == 2
    assert read_state(str(tmp_path / "run" / "checkpoint-4"))["parts"]["schedule"]["armor_started_at"] is None

    resumed = guarded(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "run", **saving)
    rounds = capture_rounds(resumed)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.armor_started_at == 5 and resumed.collapse_guard.fired["step"] == 5
    assert len(rounds) == 1 and rounds[0]["armor_is_anchor"].any()  # step 7 in ARMOR mode
    reference = {n: p.detach() for n, p in resumed.reference.model.named_parameters()}
    expected = {n: p.detach() for n, p in straight.reference.model.named_parameters()}
    assert max((reference[n] - expected[n]).abs().max().item() for n in expected) == 0.0
    best = load_file(str(tmp_path / "run" / "checkpoint-2" / "model.safetensors"))
    assert max_abs_difference(best, reference) == 0.0
    assert resumed.reference.weights_step == 2  # restored from the checkpoint, not the resume step
    assert not any("collapse_guard/fired" in e for e in resumed.state.log_history if e["step"] > 6)


def test_resume_before_the_switch_stays_dormant_until_the_rule_fires(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    from testing import StopAt

    saving = dict(save_strategy="steps", save_steps=1, max_steps=6)
    first = guarded(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, **saving)
    first.add_callback(StopAt(4))
    first.train()
    resumed = guarded(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, **saving)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.collapse_guard.steps == [1, 2, 3, 4, 5]  # restored history (steps 1-4), then 5, where it fired
    assert resumed.collapse_guard.fired["step"] == 5 and resumed.armor_started_at == 5


def test_collapse_guard_config_errors_name_the_field():
    common = cpu_args()
    for overrides, field in [
        (dict(collapse_guard="rewind"), "collapse_guard must be"),
        (dict(collapse_guard="stop", collapse_guard_drop=0.0), "collapse_guard_drop"),
        (dict(collapse_guard="stop", collapse_guard_patience=0), "collapse_guard_patience"),
        (dict(collapse_guard="armor", use_anchors=False, use_mixed_ratio=False), "collapse_guard='armor'"),
        (dict(collapse_guard="stop", save_total_limit=2), "metric_for_best_model"),
    ]:
        with pytest.raises(ValueError, match=field):
            ArmorConfig(output_dir="unused", **{**common, **overrides})


def test_dormant_stage_trains_exactly_like_grpo_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    from testing import has_digit_reward

    common = cpu_args(max_steps=2)
    grpo = GRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, train_dataset=prompt_dataset,
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo"), **common), processing_class=tiny_tokenizer)
    grpo.train()
    dormant = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "guarded", max_steps=2,
                           collapse_guard="armor")
    dormant.train()  # no validation is attached: the guard warns and never fires
    assert dormant.collapse_guard.fired is None and not dormant.armor_active
    for (name, p), q in zip(grpo.model.named_parameters(), dormant.model.parameters()):
        assert torch.equal(p, q), name


def test_rollback_with_armor_restores_the_reference_its_resets_the_cache_and_the_schedule(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    # π_ref is reset after every step, so after the best step (2) it moves on; the rollback must bring back the
    # checkpoint's π_ref, its reset count and anchor cache, and continue the schedule from step 2
    trainer = guarded(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, action="rollback", max_steps=5,
                      ref_reset_steps=1, anchor_cache=True, anchor_num_samples=2)
    saved = {}
    original = trainer.armor_state.load

    def load(directory, skip=()):
        saved["reference"] = {n: p.detach().clone() for n, p in trainer.reference.model.named_parameters()}
        return original(directory, skip)

    trainer.armor_state.load = load
    restored = {}

    class AtFire(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if trainer.collapse_guard.fired and not restored:
                restored.update(resets=trainer.reference.resets, started=trainer.armor_started_at,
                                cache=trainer.anchor_cache.state_dict(),
                                reference={n: p.detach().clone() for n, p in trainer.reference.model.named_parameters()})

    trainer.add_callback(AtFire())
    trainer.train()
    assert trainer.collapse_guard.fired["best_step"] == 2 and trainer.collapse_guard.fired["step"] == 5
    checkpoint = read_state(str(tmp_path / "checkpoint-2"))["parts"]
    assert restored["resets"] == checkpoint["reference"]["resets"] == 2  # not the 5 resets reached at the collapse
    assert restored["cache"] == checkpoint["anchor_cache"]
    assert restored["started"] == 3  # steps counted from 3: the schedule goes on as from step 2
    weights = load_file(str(tmp_path / "checkpoint-2" / "armor_reference.safetensors"))
    assert max_abs_difference(weights, restored["reference"]) == 0.0
    assert any(not torch.equal(saved["reference"][n], restored["reference"][n]) for n in weights)  # it did change


def test_guard_state_loads_known_fields_only(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = guarded(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, action="stop")
    guard = trainer.collapse_guard
    guard.load_state_dict({"steps": [1], "scores": [0.5], "trainer": None, "action": "armor", "drop": -1})
    assert guard.steps == [1] and guard.scores == [0.5]
    assert guard.trainer is trainer and guard.action == "stop" and guard.drop == 0.1


def resumed_run_rolls_back(tiny_model_path, tiny_tokenizer, dataset, first: Path, resumed: Path, moved: bool = False):
    """A rollback run writes validations 1-4 (best at step 2) and checkpoints to ``first`` and stops after step 4; a
    second run resumes from its checkpoint-4 and writes to ``resumed`` (with ``moved``: the folder ``first`` is moved
    there before). The guard fires at step 5 and rolls back to checkpoint-2 where the checkpoints now are, and step 6
    starts from its weights. Returns the resumed trainer."""
    from testing import StopAt

    saving = dict(save_strategy="steps", save_steps=1, max_steps=6, use_anchors=False, use_mixed_ratio=False)
    run = guarded(tiny_model_path, tiny_tokenizer, dataset, first, action="rollback", **saving)
    run.add_callback(StopAt(4))
    run.train()
    if moved:
        shutil.move(str(first), str(resumed))
    checkpoints = resumed if moved else first
    trainer = guarded(tiny_model_path, tiny_tokenizer, dataset, resumed, action="rollback", **saving)
    snapshot = Snapshot(trainer)
    trainer.add_callback(snapshot)
    trainer.train(resume_from_checkpoint=str(checkpoints / "checkpoint-4"))
    fired = trainer.collapse_guard.fired
    assert (fired["step"], fired["best_step"]) == (5, 2)
    assert fired["best_checkpoint"] == str(checkpoints / "checkpoint-2")
    best = load_file(str(checkpoints / "checkpoint-2" / "model.safetensors"))
    assert max(((best[n] - snapshot.at[5][n]).abs().max().item() for n in best)) == 0.0  # step 6 starts from it
    return trainer


def test_a_run_resumed_into_another_output_dir_rolls_back_to_the_checkpoint_it_recorded(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    resumed_run_rolls_back(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "first", tmp_path / "second")


def test_a_moved_run_folder_rolls_back_to_the_checkpoint_in_its_new_place(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    resumed_run_rolls_back(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "run1", tmp_path / "run2",
                           moved=True)
    # the history the checkpoints hold is relative to the run folder they were written in
    history = read_state(str(tmp_path / "run2" / "checkpoint-5"))["parts"]["collapse_guard"]
    assert history["checkpoints"] == [f"checkpoint-{step}" for step in range(1, 6)]
