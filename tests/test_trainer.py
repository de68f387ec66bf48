"""ArmorGRPOTrainer end to end on a tiny local model (CPU, offline)."""

import math

import pytest
import torch
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from armor_trl import ArmorConfig, ArmorGRPOTrainer, mixed_logprobs
from armor_trl.integration import trl_generation
from armor_trl.rollout.anchors import anchor_rows
from testing import capture_rounds, cpu_args, has_digit_reward, logged, make_trainer, trainable_state


# --- drop-in guarantee ---------------------------------------------------------------------------------------------
def test_with_both_switches_off_training_is_identical_to_grpo_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    common = cpu_args(max_steps=3, num_iterations=2, epsilon_high=0.28)
    grpo = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=has_digit_reward,
        args=GRPOConfig(output_dir=str(tmp_path / "grpo"), **common),
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
    )
    grpo.train()
    armor = ArmorGRPOTrainer(
        model=tiny_model_path,
        reward_funcs=has_digit_reward,
        args=ArmorConfig(output_dir=str(tmp_path / "armor"), use_anchors=False, use_mixed_ratio=False, **common),
        train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
    )
    armor.train()
    assert armor.reference is None
    grpo_params, armor_params = dict(grpo.model.named_parameters()), dict(armor.model.named_parameters())
    assert grpo_params.keys() == armor_params.keys()
    for name, param in grpo_params.items():
        assert torch.equal(param, armor_params[name]), name
    assert logged(grpo, "loss") == logged(armor, "loss")


def test_alpha_one_without_anchors_matches_grpo(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    common = cpu_args(max_steps=2, epsilon_high=0.28)
    grpo = GRPOTrainer(
        model=tiny_model_path, reward_funcs=has_digit_reward, args=GRPOConfig(output_dir=str(tmp_path / "g"), **common),
        train_dataset=prompt_dataset, processing_class=tiny_tokenizer,
    )
    grpo.train()
    armor = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "a", use_anchors=False, armor_alpha=1.0, max_steps=2
    )
    armor.train()
    for (name, p), q in zip(grpo.model.named_parameters(), armor.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=name)
    # ... and a real mixture changes the update
    mixed = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "m", use_anchors=False, armor_alpha=0.5, max_steps=2
    )
    mixed.train()
    assert any(not torch.allclose(p, q) for p, q in zip(grpo.model.parameters(), mixed.model.parameters()))


# --- anchor rollout ------------------------------------------------------------------------------------------------
def test_anchors_come_from_the_reference_and_join_their_group(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=2, anchor_num_samples=4,
                           anchor_same_call=False)  # a separate call on π_ref also at step 0 (same-call: its own tests)
    generation_calls = []
    original_generate = trl_generation.generate

    def recording_generate(t, prompt_ids, num_generations):
        ids = original_generate(t, prompt_ids, num_generations)
        generation_calls.append((t.model_wrapped is trainer.reference.model, ids))
        return ids

    monkeypatch.setattr(trl_generation, "generate", recording_generate)
    rounds = capture_rounds(trainer)
    trainer.train()

    assert len(rounds) == 2
    # per round: one call for the candidates, on the reference model, with K per group
    reference_calls = [ids for on_reference, ids in generation_calls if on_reference]
    assert len(reference_calls) == 2 and all(len(ids) == (8 // 4) * 4 for ids in reference_calls)
    first = rounds[0]
    pad = tiny_tokenizer.pad_token_id
    slots = anchor_rows(8, 4)
    anchor_positions = first["armor_is_anchor"].nonzero().flatten().tolist()
    assert anchor_positions and set(anchor_positions) <= set(slots)
    for slot in anchor_positions:
        anchor = [t for t in first["completion_ids"][slot].tolist() if t != pad]
        group = slots.index(slot)
        candidates = reference_calls[0][group * 4 : (group + 1) * 4]
        assert anchor in [[t for t in c if t != pad] for c in candidates]
    assert logged(trainer, "armor/anchor_found_frac")


def test_anchor_is_a_group_member_before_advantages(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    """With anchors verified by construction, advantages equal TRL's group normalisation over all G rows."""
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1, anchor_reward_threshold=0.5)
    rounds = capture_rounds(trainer)
    trainer.train()
    out = rounds[0]
    rewards = torch.tensor(trainer._logs["rewards"]["has_digit_reward"]).view(-1, 4)
    advantages = torch.tensor(list(trainer._logs["advantages"])).view(-1, 4)
    is_anchor = out["armor_is_anchor"].view(-1, 4)
    for group in range(rewards.size(0)):
        if not is_anchor[group, -1]:
            continue
        assert rewards[group, -1] == 1.0  # the anchor is verified
        expected = (rewards[group] - rewards[group].mean()) / (rewards[group].std() + 1e-4)
        torch.testing.assert_close(advantages[group], expected)
        if rewards[group, :-1].min() < 1:
            assert advantages[group, -1] > 0  # a correct anchor in a group with failures is pushed up


def test_candidate_scoring_stays_out_of_logs(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    scored_rows = []

    def counting_reward(completions, log_metric=None, log_extra=None, **kwargs):
        scored_rows.append(len(completions))
        log_metric("calls", 1.0)
        log_extra("tag", ["x"] * len(completions))
        return has_digit_reward(completions)

    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, reward_funcs=counting_reward, max_steps=1,
        anchor_num_samples=3, log_completions=True,
    )
    trainer.train()
    # candidates (2 groups × K=3), then the batch's on-policy rows: the anchors keep the scores they were picked with
    assert scored_rows == [2 * 3, 8 - 2]
    assert len(trainer._logs["prompt"]) == 8  # the completions table holds the batch only
    assert len(trainer._logs["extra"]["tag"]) == 8


def test_a_candidate_no_reward_function_applies_to_is_never_an_anchor(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    def none_for_all(completions, **kwargs):
        return [None] * len(completions)

    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path,
        reward_funcs=[none_for_all, none_for_all], anchor_reward_threshold=0.0, max_steps=1,
        anchor_fail_after_rounds=0,  # else the run stops: test_bad_input.py::test_a_verifier_that_returns_none_...
    )
    trainer.train()
    assert logged(trainer, "armor/anchor_found_frac") == [0.0]


def test_multi_task_rewards_returning_none_still_train(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    # TRL's multi-task convention (its test_train_multiple_reward_funcs_with_None_output): a reward function
    # returns None for rows it does not apply to. A candidate is correct when the functions that apply reach
    # the threshold, so anchors are found and the model trains.
    def digits_on_even_prompts(completions, prompts, **kwargs):
        scores = has_digit_reward(completions)
        return [s if int(p.split("+")[0]) % 2 == 0 else None for s, p in zip(scores, prompts)]

    def digits_on_odd_prompts(completions, prompts, **kwargs):
        scores = has_digit_reward(completions)
        return [s if int(p.split("+")[0]) % 2 == 1 else None for s, p in zip(scores, prompts)]

    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path,
        reward_funcs=[digits_on_even_prompts, digits_on_odd_prompts], max_steps=2,
    )
    before = trainable_state(trainer)
    trainer.train()
    assert all(value > 0 for value in logged(trainer, "armor/anchor_found_frac"))
    after = trainable_state(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_drop_removes_groups_without_anchor(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    # threshold 2 cannot be reached by a 0/1 reward: no anchor is ever verified
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, anchor_reward_threshold=2.0, max_steps=2)
    before = trainable_state(trainer)
    rounds = capture_rounds(trainer)
    trainer.train()
    assert logged(trainer, "armor/groups_dropped_frac") == [1.0, 1.0]
    assert logged(trainer, "armor/anchor_found_frac") == [0.0, 0.0]
    for out in rounds:
        assert out["completion_mask"].sum() == 0 and out["advantages"].abs().sum() == 0
    after = trainable_state(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_keep_trains_groups_without_anchor_as_on_policy_groups(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, anchor_reward_threshold=2.0, anchor_filter="keep", max_steps=2
    )
    before = trainable_state(trainer)
    rounds = capture_rounds(trainer)
    trainer.train()
    assert logged(trainer, "armor/groups_dropped_frac") == [0.0, 0.0]
    out = rounds[-1]
    slots = anchor_rows(8, 4)
    assert out["completion_mask"][slots].sum() == 0 and out["advantages"][slots].abs().sum() == 0
    rewards = torch.tensor(trainer._logs["rewards"]["has_digit_reward"]).view(-1, 4)
    assert torch.isnan(rewards[:, -1]).all()  # the empty slot is no member of its group
    policy = [i for i in range(8) if i not in slots]
    assert out["completion_mask"][policy].sum() > 0
    after = trainable_state(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)


# --- mixed optimization --------------------------------------------------------------------------------------------
def test_loss_is_the_clipped_surrogate_of_the_mixed_ratio(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, armor_alpha=0.6)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = [prompt_dataset[i] for i in range(2) for _ in range(4)]
    inputs = trainer._generate_and_score_completions(batch)
    # make the reference and the old policy differ from the current policy, so the ratio is not 1
    torch.manual_seed(0)
    inputs["armor_ref_logps"] = inputs["armor_ref_logps"] - torch.rand_like(inputs["armor_ref_logps"])
    logits_to_keep = inputs["completion_ids"].size(1)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logp = trl_generation.per_token_logps(trainer, trainer.model, input_ids, attention, logits_to_keep, 8)
    inputs["old_per_token_logps"] = logp + 0.5 * torch.randn_like(logp)
    if inputs["advantages"].abs().sum() == 0:
        inputs["advantages"] = torch.linspace(-1, 1, 8)

    loss = trainer._compute_loss(trainer.model, inputs)

    alpha, ref, old = 0.6, inputs["armor_ref_logps"], inputs["old_per_token_logps"]
    ratio = torch.exp(mixed_logprobs(logp, ref, alpha) - mixed_logprobs(old, ref, alpha))
    adv = inputs["advantages"].unsqueeze(1)
    surrogate = -torch.min(ratio * adv, ratio.clamp(1 - 0.2, 1 + 0.28) * adv)
    mask = inputs["completion_mask"]
    expected = (surrogate * mask).sum() / inputs["num_items_in_batch"]
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    metrics = trainer._metrics["train"]
    assert not math.isnan(metrics["armor/ratio_policy_mean"][-1])
    assert metrics["armor/kl_reverse_policy"][-1] > 0


# --- it trains, in the supported combinations ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(num_iterations=2),
        dict(gradient_accumulation_steps=2, per_device_train_batch_size=4),
        dict(steps_per_generation=2, per_device_train_batch_size=4),
        dict(loss_type="grpo"),
        dict(loss_type="bnpo"),
        dict(loss_type="dr_grpo"),
        dict(use_mixed_ratio=False),
        dict(use_anchors=False),
        dict(peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), learning_rate=5e-2),
    ],
    ids=["default", "num_iterations", "grad_accum", "steps_per_generation", "grpo", "bnpo", "dr_grpo",
         "anchors_only", "mixed_only", "lora"],
)
def test_training_changes_parameters(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, overrides):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, **overrides)
    before = trainable_state(trainer)
    trainer.train()
    after = trainable_state(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    if trainer.args.use_anchors:
        assert logged(trainer, "armor/anchor_found_frac")


def test_conversational_prompts_and_weighted_rewards(tiny_model_path, tiny_tokenizer, chat_dataset, tmp_path):
    def length_reward(completions, **kwargs):
        return [len(c[0]["content"]) / 8 for c in completions]

    args = cpu_args(reward_weights=[1.0, 0.5], anchor_reward_threshold=1.0)
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, chat_dataset, tmp_path, reward_funcs=[has_digit_reward, length_reward], **args)
    before = trainable_state(trainer)
    trainer.train()
    assert logged(trainer, "armor/anchor_reward_mean")
    found_rewards = [r for r in logged(trainer, "armor/anchor_reward_mean") if r is not None]
    assert all(r >= 1.0 for r in found_rewards)
    assert any(not torch.equal(p, trainable_state(trainer)[n]) for n, p in before.items())


# --- bad input -----------------------------------------------------------------------------------------------------
def test_a_grpo_config_is_converted_with_the_fields_it_sets_and_armors_defaults(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, caplog
):
    config = GRPOConfig(output_dir=str(tmp_path), **cpu_args(learning_rate=3e-3, gradient_accumulation_steps=2))
    assert config.epsilon_high is None  # TRL's default; ARMOR's is 0.28
    with caplog.at_level("WARNING"):
        trainer = ArmorGRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, args=config,
                                   train_dataset=prompt_dataset, processing_class=tiny_tokenizer)
    assert "args is a GRPOConfig: converted to an ArmorConfig" in caplog.text  # docs/bad_input.md row 12
    args = trainer.args
    assert isinstance(args, ArmorConfig) and trainer.reference is not None
    assert (args.learning_rate, args.gradient_accumulation_steps, args.num_generations) == (3e-3, 2, 4)  # as set
    assert (args.loss_type, args.beta, args.epsilon_high) == ("dapo", 0.0, 0.28)  # left unset: ARMOR's defaults
    with pytest.raises(ValueError, match="ArmorConfig"):
        ArmorGRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, args={"learning_rate": 1.0},
                         train_dataset=prompt_dataset, processing_class=tiny_tokenizer)


def test_vllm_without_vllm_installed_says_how_to_install(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="vLLM is not available"):
            make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, use_vllm=True)
    else:
        pytest.skip("vllm is installed here; tests/test_vllm_gpu.py covers it")


def test_tools_with_anchors_are_refused(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: first
            b: second
        """
        return a + b

    with pytest.raises(ValueError, match="not supported with tools: an anchor would be a whole multi-turn π_ref "
                                         "trajectory.*use_anchors=False.*rollout_func.*env_mask"):
        ArmorGRPOTrainer(
            model=tiny_model_path, reward_funcs=has_digit_reward, args=ArmorConfig(output_dir=str(tmp_path), **cpu_args()),
            train_dataset=prompt_dataset, processing_class=tiny_tokenizer, tools=[add],
        )


def test_environment_factory_with_anchors_is_refused_naming_why_and_what_works(tiny_model_path, tiny_tokenizer,
                                                                              prompt_dataset, tmp_path):
    class Counter:
        def reset(self, **kwargs):
            return None

        def increment(self, step: int) -> int:
            """Add to the counter.

            Args:
                step: how much
            """
            return step

    with pytest.raises(ValueError, match="not supported with environment_factory: an anchor would be a whole π_ref "
                                         "trajectory in an environment of its own.*use_anchors=False.*rollout_func"):
        ArmorGRPOTrainer(
            model=tiny_model_path, reward_funcs=has_digit_reward, args=ArmorConfig(output_dir=str(tmp_path), **cpu_args()),
            train_dataset=prompt_dataset, processing_class=tiny_tokenizer, environment_factory=Counter,
        )


def test_ref_model_with_lora_is_refused(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    with pytest.raises(ValueError, match="ref_model"):
        make_trainer(
            tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path,
            peft_config=LoraConfig(r=4, target_modules=["q_proj"]), ref_model=tiny_model_path,
        )


def test_missing_ref_model_path_names_the_argument(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    with pytest.raises(ValueError, match="ref_model"):
        make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, ref_model=str(tmp_path / "no-such-model"))


def test_off_policy_mask_compares_mixture_with_mixture(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    # With vLLM, TRL's off-policy sequence mask compares the loss's log-probs (here: the mixture's) with the engine's
    # sampling log-probs. Those must be mixed too: with sampler = old = current policy nothing is off-policy, so
    # the mask must not change the loss.
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1, anchor_reward_threshold=0.0)
    batches = capture_rounds(trainer)
    trainer.train()
    batch = dict(batches[0])
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        current = trl_generation.per_token_logps(trainer, trainer.model, input_ids, attention_mask,
                                                 batch["completion_ids"].size(1), 8)
    batch["old_per_token_logps"] = current
    batch["sampling_per_token_logps"] = current
    batch["advantages"] = -batch["advantages"].abs() - 1.0  # the mask only acts on negative advantages
    with torch.no_grad():
        trainer.off_policy_mask_threshold = None
        unmasked = trainer._compute_loss(trainer.model, batch).item()
        trainer.off_policy_mask_threshold = 1e-6
        masked = trainer._compute_loss(trainer.model, batch).item()
    assert masked == pytest.approx(unmasked, rel=1e-5)


def test_verifier_timeouts_are_logged(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch):
    import armor_trl.trainer as trainer_module
    from armor_trl.rewards import math_verify_reward

    counter = iter(range(0, 1000, 3))  # every call: 3 more completions timed out
    monkeypatch.setattr(trainer_module, "verifier_timeouts", lambda: next(counter))
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, reward_funcs=math_verify_reward, max_steps=2,
        use_anchors=False,
    )
    trainer.train()
    assert logged(trainer, "rewards/verifier_timeouts") == [3.0, 3.0]


def test_anchors_are_scored_once_so_a_second_judgement_cannot_flip_them(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    calls = []

    def flaky_verifier(completions, **kwargs):
        """Verifies everything on its first call (the candidates), then judges everything wrong (as a verifier that
        times out on a second pass would turn a verified anchor into a wrong one)."""
        calls.append(len(completions))
        return [1.0 if len(calls) == 1 else 0.0] * len(completions)

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, reward_funcs=flaky_verifier,
                           max_steps=1, anchor_num_samples=2)
    rounds = capture_rounds(trainer)
    trainer.train()
    assert calls == [2 * 2, 8 - 2]  # the candidates, then the on-policy rows only
    is_anchor = rounds[0]["armor_is_anchor"]
    assert is_anchor.sum() == 2 and logged(trainer, "armor/anchor_reward_mean") == [1.0]
    # the anchors kept their verified score: they lead their groups of wrong answers (scored again, they would tie)
    assert (rounds[0]["advantages"][is_anchor] > 0).all()


def test_anchor_loss_weight_zero_removes_the_anchors_gradient_but_not_their_group_role(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    batches = {}
    for weight in (1.0, 0.0):
        trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / str(weight),
                               anchor_loss_weight=weight, max_steps=1, anchor_num_samples=4)
        batches[weight] = capture_rounds(trainer)
        trainer.train()
    full, zero = batches[1.0][0], batches[0.0][0]
    anchors = zero["armor_is_anchor"]
    assert anchors.any()
    assert (zero["advantages"][anchors] == 0).all()  # λ = 0: no gradient from the anchor rows
    # the same seed draws the same batch: on-policy advantages (group statistics with the anchor) and the token
    # normaliser (anchor tokens included) are unchanged by λ, as the field's help says
    assert torch.equal(zero["advantages"][~anchors], full["advantages"][~anchors])
    assert zero["num_items_in_batch"] == full["num_items_in_batch"] and anchors.equal(full["armor_is_anchor"])


def test_no_metric_is_logged_as_none_when_a_step_has_no_anchor(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    def never_correct(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, reward_funcs=never_correct,
                           max_steps=2, logging_steps=1)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and logged(trainer, "armor/anchor_found_frac") == [0.0, 0.0]
    assert [key for entry in logs for key, value in entry.items() if value is None] == []
    assert all("armor/ratio_anchor_mean" not in entry for entry in logs)  # no anchor rows: not logged, not None
