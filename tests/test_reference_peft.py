"""The LoRA reference across PEFT layouts: exact resets, save/restore, frozen weights, no dropout."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from armor_trl.reference.policy import REF_ADAPTER, ReferencePolicy

# Each layout keeps weights whose PEFT names end with the adapter name, or carry it in the middle.
LAYOUTS = {
    "lora_embedding": dict(target_modules=["q_proj", "embed_tokens"]),
    "trainable_token_indices": dict(target_modules=["q_proj"], trainable_token_indices=[3, 4, 5, 20]),
    "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "dora": dict(target_modules=["q_proj", "v_proj"], use_dora=True),
}
INPUT_IDS = torch.tensor([[1, 3, 4, 5, 20, 21, 30, 4, 5, 6, 7, 8], [1, 9, 10, 3, 4, 20, 11, 12, 13, 14, 15, 16]])


def peft_policy(model_path, **lora):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **lora))


def adapter_weights(model, adapter):
    """The parameters whose dotted name holds ``adapter`` as a component (found apart from the code under test)."""
    return {name: p for name, p in model.named_parameters() if adapter in name.split(".")}


@torch.no_grad()
def perturb(params, seed):
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.add_(0.5 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


@torch.no_grad()
def policy_and_reference_logits(model, reference):
    model.eval()
    policy = model(INPUT_IDS).logits
    with reference.active(model):
        ref = model(INPUT_IDS).logits
    return policy, ref


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reset_makes_the_reference_adapter_an_exact_copy(layout, tiny_model_path):
    model = peft_policy(tiny_model_path, **LAYOUTS[layout])
    reference = ReferencePolicy.lora(model)
    initial, _ = policy_and_reference_logits(model, reference)
    trained = adapter_weights(model, "default")
    assert len(trained) == len(adapter_weights(model, REF_ADAPTER)) > 0
    perturb(trained.values(), seed=1)

    policy, ref = policy_and_reference_logits(model, reference)
    assert (policy - ref).abs().max() > 0.1  # the trained adapter moved away from π_ref ...
    assert torch.equal(ref, initial)  # ... which still runs its own copy of every adapter weight

    reference.reset(model, step=1)
    policy, ref = policy_and_reference_logits(model, reference)
    assert (policy - ref).abs().max().item() == 0.0
    assert reference.holds_policy_weights()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_adapter_save_then_load_restores_it_exactly(layout, tiny_model_path, tmp_path):
    model = peft_policy(tiny_model_path, **LAYOUTS[layout])
    reference = ReferencePolicy.lora(model)
    perturb(adapter_weights(model, "default").values(), seed=1)
    reference.reset(model, step=3)
    _, saved = policy_and_reference_logits(model, reference)
    reference.save_weights(str(tmp_path), model)
    state = reference.state_dict()

    perturb(adapter_weights(model, REF_ADAPTER).values(), seed=2)
    _, perturbed = policy_and_reference_logits(model, reference)
    assert (perturbed - saved).abs().max() > 0.1

    reference.load_weights(str(tmp_path), model)
    reference.load_state_dict(state)
    _, restored = policy_and_reference_logits(model, reference)
    assert (restored - saved).abs().max().item() == 0.0
    assert reference.synced_step == 3 and reference.holds_policy_weights()  # saved right after the reset


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_adapter_stays_frozen_through_adapter_switching(layout, tiny_model_path):
    model = peft_policy(tiny_model_path, **LAYOUTS[layout])
    reference = ReferencePolicy.lora(model)
    ref_weights, trained = adapter_weights(model, REF_ADAPTER), adapter_weights(model, "default")

    def check():
        assert ref_weights and not any(p.requires_grad for p in ref_weights.values())
        assert trained and all(p.requires_grad for p in trained.values())
        assert model.active_adapter == "default"

    check()
    model.train()
    with reference.active(model):
        assert model.active_adapter == REF_ADAPTER
        model(INPUT_IDS)
    check()
    reference.reset(model, step=1)
    check()
    assert model.training


def test_lora_dropout_is_off_for_the_reference_only(tiny_model_path):
    model = peft_policy(tiny_model_path, target_modules=["q_proj", "v_proj"], lora_dropout=0.5)
    reference = ReferencePolicy.lora(model)
    perturb(adapter_weights(model, "default").values(), seed=1)
    reference.reset(model, step=1)  # a non-zero ref adapter, so its dropout would show in the logits
    model.train()
    with torch.no_grad():
        with reference.active(model):
            first, second = model(INPUT_IDS).logits, model(INPUT_IDS).logits
        assert (first - second).abs().max().item() == 0.0
        assert model.training and all(m.training for m in model.modules())
        policy_first, policy_second = model(INPUT_IDS).logits, model(INPUT_IDS).logits
    assert (policy_first - policy_second).abs().max() > 0  # the trained adapter keeps its dropout in train mode


def test_trainable_weights_outside_the_adapter_are_refused(tiny_model_path):
    model = peft_policy(tiny_model_path, target_modules=["q_proj"])
    model.base_model.model.model.norm.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"Trainable parameters outside the adapter 'default'.*model\.norm\.weight"):
        ReferencePolicy.lora(model)


def test_a_reference_adapter_that_does_not_mirror_the_trained_one_is_refused(tiny_model_path):
    model = peft_policy(tiny_model_path, target_modules=["q_proj", "v_proj"])
    model.add_adapter(REF_ADAPTER, LoraConfig(r=4, target_modules=["q_proj"]))
    reference = ReferencePolicy("lora", trained_adapter="default")
    with pytest.raises(ValueError, match=r"does not mirror the trained adapter 'default'.*v_proj"):
        reference.reset(model, step=1)


def test_loading_a_reference_saved_with_other_adapter_weights_names_them(tiny_model_path, tmp_path):
    saved = peft_policy(tiny_model_path, target_modules=["q_proj", "v_proj"])
    ReferencePolicy.lora(saved).save_weights(str(tmp_path), saved)
    model = peft_policy(tiny_model_path, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"other weights than this run's \(only in the checkpoint: \[.*v_proj\.lora_A"):
        ReferencePolicy.lora(model).load_weights(str(tmp_path), model)
