"""ARMOR on TRL's continuous-batching path (``use_transformers_continuous_batching=True``): anchors from π_ref on that
path, π_ref left exactly as it was by TRL's in-place cast, the drop-in identity, and resume."""

import pytest
import torch
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from armor_trl import ArmorConfig, ArmorGRPOTrainer
from armor_trl.integration import trl_generation
from armor_trl.rollout.anchors import anchor_rows
from armor_trl.reference.policy import REF_ADAPTER, adapter_parameters
from testing import (StopAt, capture_rounds, check_exact_resume, cpu_args, digit_share_reward, has_digit_reward, logged,
                     make_trainer)

# a small KV cache: sized from free memory by default, which makes every generate_batch call take seconds on a CPU
CB = dict(use_transformers_continuous_batching=True,
          transformers_continuous_batching_config={"num_blocks": 32, "max_batch_tokens": 128, "page_size": 16})


def record_generate_batch(monkeypatch):
    """Every model that TRL's continuous-batching path generated with, and how many rows."""
    from transformers import GenerationMixin

    calls = []
    original = GenerationMixin.generate_batch

    def recording(model, inputs, *args, **kwargs):
        calls.append((model, len(inputs)))
        return original(model, inputs, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate_batch", recording)
    return calls


def test_anchors_on_the_continuous_batching_path_come_from_the_reference(tiny_model_path, tiny_tokenizer,
                                                                          prompt_dataset, tmp_path, monkeypatch):
    batches = record_generate_batch(monkeypatch)
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=2,
                           reward_funcs=digit_share_reward, anchor_reward_threshold=0.1, anchor_same_call=False,
                           ref_reset_steps=None, **CB)
    candidates = []
    original = trl_generation.generate

    def recording(t, prompt_ids, n):
        ids = original(t, prompt_ids, n)
        if t.model_wrapped is trainer.reference.model:
            candidates.append(ids)
        return ids

    monkeypatch.setattr(trl_generation, "generate", recording)
    rounds = capture_rounds(trainer)
    trainer.train()

    # both the policy's rows and the reference's candidates went through generate_batch, with the right models
    policy = trainer.unwrapped_policy()
    assert [rows for model, rows in batches if model is policy] == [6, 6]  # G - 1 = 3 rows for each of 2 groups
    assert [rows for model, rows in batches if model is trainer.reference.model] == [8, 8]  # K = 4 per group
    slots = anchor_rows(8, 4)
    anchored = 0
    for output, round_candidates in zip(rounds, candidates):
        for slot in output["armor_is_anchor"].nonzero().flatten().tolist():
            group = slots.index(slot)
            anchor = output["completion_ids"][slot][output["completion_mask"][slot].bool()].tolist()
            assert anchor in round_candidates[group * 4 : (group + 1) * 4]
            anchored += 1
        # π_ref's log-probs of every row (anchors included) are a direct forward of the reference on that row
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad():
            logits = trainer.reference.model(input_ids=ids, attention_mask=mask).logits
        width = output["completion_ids"].size(1)
        logps = torch.log_softmax(logits[:, -width - 1 : -1].float() / trainer.temperature, dim=-1)
        direct = logps.gather(-1, output["completion_ids"].unsqueeze(-1)).squeeze(-1)
        keep = output["completion_mask"].bool()
        torch.testing.assert_close(output["armor_ref_logps"][keep], direct[keep], rtol=1e-4, atol=1e-4)
    assert anchored > 0
    assert logged(trainer, "armor/anchor_found_frac")


def test_the_in_place_cast_of_continuous_batching_leaves_a_full_reference_as_it_was(tiny_model_path, tiny_tokenizer,
                                                                                     prompt_dataset, tmp_path,
                                                                                     monkeypatch):
    """TRL casts the model it generates with to bf16 in place; the reference generates anchors through that path and
    keeps its float32 tensors, exactly. TRL's own cast runs; generate_batch itself is replaced by a recorder that
    returns fixed completions, because on a CPU transformers' paged cache fails in bf16 (for GRPOTrainer too:
    'PagedAttentionCache' object has no attribute 'float')."""
    from types import SimpleNamespace

    from transformers import GenerationMixin

    seen = []

    def fake_generate_batch(model, inputs, *args, **kwargs):
        seen.append((model, next(model.parameters()).dtype))
        return {f"req_{i}": SimpleNamespace(generated_tokens=[5 + i % 3, 6, tiny_tokenizer.eos_token_id])
                for i in range(len(inputs))}

    monkeypatch.setattr(GenerationMixin, "generate_batch", fake_generate_batch)
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1, bf16=True,
                           anchor_same_call=False, ref_reset_steps=None, **CB)
    before = {name: p.detach().clone() for name, p in trainer.reference.model.named_parameters()}
    assert {p.dtype for p in before.values()} == {torch.float32}
    rounds = capture_rounds(trainer)
    trainer.train()
    # TRL cast both models it generated with: the policy for good (its own behaviour on this path), the reference ...
    assert (trainer.reference.model, torch.bfloat16) in seen and (trainer.unwrapped_policy(), torch.bfloat16) in seen
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    # ... which came back with its own float32 tensors, unrounded, in eval mode
    after = dict(trainer.reference.model.named_parameters())
    for name, param in before.items():
        assert after[name].dtype == torch.float32 and torch.equal(after[name], param), name
    assert not trainer.reference.model.training
    assert rounds[0]["armor_ref_logps"].dtype == torch.float32


def test_with_lora_the_reference_adapter_follows_the_trained_adapter_through_the_cast(tiny_model_path, tiny_tokenizer,
                                                                                      prompt_dataset, tmp_path):
    """With LoRA TRL casts the whole PEFT model (both adapters) in its policy rollout; the reference adapter keeps
    the trained adapter's dtype, and a reset copies it exactly."""
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=2, bf16=True,
                           anchor_same_call=False, ref_reset_steps=1, learning_rate=5e-2,
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), **CB)
    trainer.train()
    assert trainer.reference.resets == 2
    policy = trainer.unwrapped_policy()
    trained = adapter_parameters(policy, trainer.reference.trained_adapter)
    reference = adapter_parameters(policy, REF_ADAPTER)
    for name, param in trained.items():
        assert reference[name].dtype == param.dtype and torch.equal(reference[name], param), name


def test_with_both_switches_off_continuous_batching_is_identical_to_grpo_trainer(tiny_model_path, tiny_tokenizer,
                                                                                  prompt_dataset, tmp_path):
    common = cpu_args(max_steps=2, num_iterations=2, epsilon_high=0.28, **CB)  # (ArmorConfig's epsilon_high)
    grpo = GRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward,
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo"), **common), train_dataset=prompt_dataset,
                       processing_class=tiny_tokenizer)
    grpo.train()
    armor = ArmorGRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward,
                             args=ArmorConfig(output_dir=str(tmp_path / "armor"), use_anchors=False,
                                              use_mixed_ratio=False, **common),
                             train_dataset=prompt_dataset, processing_class=tiny_tokenizer)
    armor.train()
    for (name, p), q in zip(grpo.model.named_parameters(), armor.model.parameters()):
        assert torch.equal(p, q), name
    assert logged(grpo, "loss") == logged(armor, "loss")
    assert logged(grpo, "completions/mean_length") == logged(armor, "completions/mean_length")


def run(tiny_model_path, tiny_tokenizer, dataset, output_dir, stop_at=None, resume=None):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, dataset, output_dir, reward_funcs=digit_share_reward,
                           anchor_reward_threshold=0.1, ref_reset_steps=2, max_steps=4, save_strategy="steps",
                           save_steps=2, anchor_cache=True, **CB)
    if stop_at is not None:
        trainer.add_callback(StopAt(stop_at))
    trainer.train(resume_from_checkpoint=resume)
    reference = [p.detach().clone() for p in trainer.reference.parameters_of(trainer.unwrapped_policy())]
    return trainer, reference, {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_resume_on_the_continuous_batching_path_continues_the_run_exactly(tiny_model_path, tiny_tokenizer,
                                                                          prompt_dataset, tmp_path):
    check_exact_resume(run, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path)


def test_a_generation_path_that_loses_rows_stops_the_round_instead_of_shifting_anchors(tiny_model_path, tiny_tokenizer,
                                                                                       prompt_dataset, tmp_path,
                                                                                       monkeypatch):
    """transformers' generate_batch logs failed or missing requests and returns the others; the round stops (here
    a same-call round: 3 on-policy rows and 4 candidates per group)."""
    from types import SimpleNamespace

    from transformers import GenerationMixin

    def losing_generate_batch(model, inputs, *args, **kwargs):
        return {f"req_{i}": SimpleNamespace(generated_tokens=[5, tiny_tokenizer.eos_token_id])
                for i in range(len(inputs) - 1)}

    monkeypatch.setattr(GenerationMixin, "generate_batch", losing_generate_batch)
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1, **CB)
    with pytest.raises(RuntimeError, match="returned 13 completions for 14 prompt rows"):
        trainer.train()


def test_column_anchors_on_the_continuous_batching_path_need_no_reference_generation(tiny_model_path, tiny_tokenizer,
                                                                                     tmp_path, monkeypatch):
    from datasets import Dataset

    batches = record_generate_batch(monkeypatch)
    numbers = range(16)
    dataset = Dataset.from_dict({"prompt": [f"{n}+{n + 1}=" for n in numbers],
                                 "anchors": [[f"{2 * n + 1}"] for n in numbers]})
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path, max_steps=2, anchor_source="column",
                           **CB)
    rounds = capture_rounds(trainer)
    trainer.train()
    assert [rows for _, rows in batches] == [6, 6]  # the policy's rows only
    for output in rounds:
        prompts = tiny_tokenizer.batch_decode(output["prompt_ids"], skip_special_tokens=True)
        for row in output["armor_is_anchor"].nonzero().flatten().tolist():
            n = int(prompts[row].split("+")[0])
            assert tiny_tokenizer.decode(output["completion_ids"][row], skip_special_tokens=True) == str(2 * n + 1)
    assert min(logged(trainer, "armor/anchor_found_frac")) == 1.0
