"""One checkpoint path: ARMOR's state saved last and atomically, incomplete checkpoints skipped, rotation after a
checkpoint is complete; a run stopped at any save phase resumes, with and without ARMOR and dynamic sampling."""

import json

import pytest
import torch

from armor_trl.integration import checkpoint as ckpt
from armor_trl.integration import trl_seam as seam
from armor_trl.integration.checkpoint import STATE_FILE, ArmorState, latest_complete_checkpoint, read_state
from testing import has_digit_reward, make_trainer, numbers_dataset, trainable_state


class Killed(BaseException):
    """Stands in for SIGKILL: nothing after the raise runs, no handler catches it."""


RUNS = {
    "armor": dict(),
    "dynamic_sampling": dict(use_anchors=False, use_mixed_ratio=False, dynamic_sampling=True),
    "plain": dict(use_anchors=False, use_mixed_ratio=False),
}
PHASES = ("before_armor_files", "before_state_file", "before_rotation")


def kill_at(monkeypatch, phase: str, step: int, trainer_of):
    """Raise Killed in the save of optimizer step ``step`` at ``phase``."""
    def due():
        return trainer_of().state.global_step == step

    if phase == "before_armor_files":
        original = ArmorState.save

        def save(self, *args, **kwargs):
            if due():
                raise Killed
            return original(self, *args, **kwargs)

        monkeypatch.setattr(ArmorState, "save", save)
    elif phase == "before_state_file":
        original_write = ckpt.write_json_atomically

        def write(path, value):
            if due():
                raise Killed
            return original_write(path, value)

        monkeypatch.setattr(ckpt, "write_json_atomically", write)
    else:
        original_rotate = seam.rotate

        def rotate(trainer, trial=None):
            if due():
                raise Killed
            return original_rotate(trainer, trial)

        monkeypatch.setattr(seam, "rotate", rotate)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("phase", PHASES)
def test_a_run_stopped_at_any_save_phase_resumes_from_its_newest_complete_checkpoint(
    run, phase, tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch
):
    common = dict(max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=1, anchor_num_samples=2, **RUNS[run])
    dataset = numbers_dataset(range(16))
    first = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path / "run", **common)
    with monkeypatch.context() as patch:
        kill_at(patch, phase, 3, lambda: first)
        with pytest.raises(Killed):
            first.train()
    newest, incomplete = latest_complete_checkpoint(str(tmp_path / "run"))
    expected = 3 if phase == "before_rotation" else 2  # the state file marks a checkpoint complete
    assert newest == str(tmp_path / "run" / f"checkpoint-{expected}")
    assert incomplete == ([] if expected == 3 else [str(tmp_path / "run" / "checkpoint-3")])
    if phase != "before_rotation":  # rotation waited: the complete checkpoint-2 outlived save_total_limit=1
        assert (tmp_path / "run" / "checkpoint-2" / "trainer_state.json").exists()

    resumed = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path / "run", **common)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    assert read_state(str(tmp_path / "run" / "checkpoint-4"))["config"]["kind"] == (
        "full" if run == "armor" else None)
    assert [p.name for p in (tmp_path / "run").glob("checkpoint-*")] == ["checkpoint-4"]  # rotated once complete


def test_the_state_file_holds_every_registered_part_and_resume_restores_them(
    tiny_model_path, tiny_tokenizer, tmp_path
):
    common = dict(max_steps=2, save_strategy="steps", save_steps=2, anchor_cache=True, dynamic_sampling=True,
                  anchor_num_samples=2, ref_reset_steps=1)
    dataset = numbers_dataset(range(16))
    first = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path, **common)
    first.train()
    state = read_state(str(tmp_path / "checkpoint-2"))
    assert state["format"] == ckpt.FORMAT
    assert set(state["parts"]) == {"schedule", "refill", "anchor_cache", "reference"}
    assert state["parts"]["reference"]["resets"] == 2
    assert (tmp_path / "checkpoint-2" / "armor_reference.safetensors").exists()

    resumed = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path / "again", **common)
    resumed.armor_state.load(str(tmp_path / "checkpoint-2"))  # what resuming does after transformers' own part
    assert resumed.reference.resets == 2
    assert resumed.dynamic_sampling.refill.drawn == first.dynamic_sampling.refill.drawn
    assert resumed.anchor_cache.state_dict() == first.anchor_cache.state_dict()
    policy, reference = trainable_state(first), dict(resumed.reference.model.named_parameters())
    assert all(torch.equal(policy[name], reference[name]) for name in policy)  # π_ref = the policy after step 2


def test_resume_refuses_a_checkpoint_of_other_settings_naming_them(tiny_model_path, tiny_tokenizer, tmp_path):
    common = dict(max_steps=1, save_strategy="steps", save_steps=1, use_anchors=False, use_mixed_ratio=False)
    make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(range(8)), tmp_path, **common).train()
    other = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(range(8)), tmp_path,
                         **{**common, "dynamic_sampling": True})
    with pytest.raises(ValueError, match="dynamic_sampling: checkpoint False vs now True"):
        other.train(resume_from_checkpoint=True)


def test_a_damaged_state_file_is_named(tmp_path):
    (tmp_path / STATE_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=f"{STATE_FILE} is not valid JSON"):
        read_state(str(tmp_path))


def test_format_1_checkpoints_are_read(tmp_path):
    (tmp_path / STATE_FILE).write_text(json.dumps({
        "kind": "full", "resets": 3, "last_reset_step": 6, "synced_step": 6, "weights_step": 6, "config": {"a": 1},
        "anchor_cache": None, "armor_started_at": 0, "collapse_guard": {"steps": [2]},
    }))
    (tmp_path / ckpt.LEGACY_REFILL_FILE).write_text(json.dumps({"dataset_size": 4, "seed": 0, "drawn": 8}))
    state = read_state(str(tmp_path))
    assert state["config"] == {"kind": "full", "a": 1}
    assert state["parts"]["reference"]["resets"] == 3 and state["parts"]["refill"]["drawn"] == 8
    assert state["parts"]["schedule"] == {"armor_started_at": 0} and state["parts"]["collapse_guard"] == {"steps": [2]}


def test_registering_a_part_twice_is_refused():
    state = ArmorState()
    state.register("x", dict, lambda _: None)
    with pytest.raises(ValueError, match="registered twice"):
        state.register("x", dict, lambda _: None)


def test_reference_weights_are_safetensors_not_pickle(tiny_model_path, tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(range(8)), tmp_path, max_steps=1,
                           save_strategy="steps", save_steps=1, reward_funcs=has_digit_reward)
    trainer.train()
    data = (tmp_path / "checkpoint-1" / "armor_reference.safetensors").read_bytes()
    assert not data.startswith(b"PK") and not data.startswith(b"\x80")  # neither a torch zip nor a pickle


def tiny_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=2, num_experts_per_tok=1))


def loader_of(model):
    """What load_policy_weights reads of a trainer, and the record of transformers' loader's calls."""
    from types import SimpleNamespace

    calls = []
    trainer = SimpleNamespace(model=model, is_fsdp_enabled=False, accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    return trainer, calls, lambda checkpoint, model=None: calls.append(checkpoint)


def test_a_vlm_checkpoint_loads_back_under_the_names_it_was_saved_from(tmp_path):
    """transformers saves a Qwen2-VL's ``model.visual.*`` as ``visual.*``; every weight loads back into its place."""
    from transformers import AutoModelForImageTextToText

    from armor_trl.app.tiny import build_tiny_vlm

    saved_from = AutoModelForImageTextToText.from_pretrained(build_tiny_vlm(tmp_path / "initial"))
    with torch.no_grad():
        for p in saved_from.parameters():
            p.add_(1.0)
    saved_from.save_pretrained(tmp_path / "checkpoint")
    names = seam.checkpoint_key_names(saved_from)
    assert names["visual.patch_embed.proj.weight"] == "model.visual.patch_embed.proj.weight"

    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "initial")
    trainer, calls, load = loader_of(model)
    ckpt.load_policy_weights(trainer, load, str(tmp_path / "checkpoint"))
    assert not calls  # transformers' loader is not used: it would load nothing
    for (name, p), q in zip(saved_from.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_a_checkpoint_that_does_not_fit_the_vlm_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    from armor_trl.app.tiny import build_tiny_vlm

    path = build_tiny_vlm(tmp_path)
    weights = load_file(f"{path}/model.safetensors")
    del weights["visual.merger.ln_q.bias"]
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    trainer, _, load = loader_of(AutoModelForImageTextToText.from_pretrained(path))
    with pytest.raises(ValueError, match=r"not saved from this Qwen2VLForConditionalGeneration.*"
                                         r"missing in the checkpoint: \['model.visual.merger.ln_q.bias'\]"):
        ckpt.load_policy_weights(trainer, load, path)


def test_a_model_saved_under_its_own_names_loads_through_transformers(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert seam.checkpoint_key_names(model) is None
    trainer, calls, load = loader_of(model)
    ckpt.load_policy_weights(trainer, load, str(tiny_model_path))
    assert calls == [str(tiny_model_path)]


def test_resuming_a_model_saved_with_fused_tensors_is_refused(tmp_path):
    """A Qwen2-MoE saves its fused experts one by one: no renaming loads them back, and transformers' Trainer would
    leave them at their initial values, so the resume stops."""
    model = tiny_moe()
    model.save_pretrained(tmp_path)
    trainer, calls, load = loader_of(model)
    with pytest.raises(ValueError, match="Qwen2MoeForCausalLM is saved with tensors converted .*experts.*resuming it "
                                         "is refused"):
        ckpt.load_policy_weights(trainer, load, str(tmp_path))
    assert not calls
