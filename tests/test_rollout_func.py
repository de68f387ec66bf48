"""ARMOR with a ``rollout_func``: anchors from π_ref through the user's function, rows and extra fields aligned, the
contract's errors, the drop-in identity, and resume."""

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from armor_trl import ArmorConfig, ArmorGRPOTrainer, generate_completions
from armor_trl.rollout.anchors import anchor_rows
from testing import (StopAt, capture_rounds, check_exact_resume, cpu_args, digit_share_reward, has_digit_reward,
                     logged)

CB = dict(use_transformers_continuous_batching=True,
          transformers_continuous_batching_config={"num_blocks": 32, "max_batch_tokens": 128, "page_size": 16})


def tracing_rollout(tokenizer, calls):
    """A rollout_func that generates with the trainer's model and returns, per row, where it came from: the prompt,
    the completion, and which model generated it (an extra field, as TRL's rollout functions return them)."""

    def rollout_func(prompts, trainer):
        prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
        completion_ids = generate_completions(trainer, prompt_ids)
        reference = getattr(trainer, "reference", None)
        by_reference = reference is not None and trainer.model_wrapped is reference.model
        calls.append((by_reference, list(prompts)))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None,
                "origin": [[prompt, list(ids), by_reference] for prompt, ids in zip(prompts, completion_ids)]}

    return rollout_func


def origin_checked_reward(prompts, completions, completion_ids, origin, **kwargs):
    """digit_share_reward, after checking that each row's extra field came with its own prompt and completion."""
    for prompt, ids, row_origin in zip(prompts, completion_ids, origin):
        if row_origin is None or row_origin[0] != prompt or row_origin[1] != list(ids):
            raise AssertionError(f"misaligned row: {prompt!r} {ids} got the extra field {row_origin}")
    return digit_share_reward(completions)


def armor_trainer(tiny_model_path, tiny_tokenizer, dataset, output_dir, rollout_func, reward_funcs=origin_checked_reward,
                  **overrides):
    fields = dict(anchor_reward_threshold=0.1, anchor_same_call=False)
    fields.update(overrides)
    return ArmorGRPOTrainer(model=tiny_model_path, reward_funcs=reward_funcs,
                            args=ArmorConfig(output_dir=str(output_dir), **cpu_args(**fields)),
                            train_dataset=dataset, processing_class=tiny_tokenizer, rollout_func=rollout_func)


@pytest.mark.parametrize("path", ["generate", "continuous_batching"])
def test_anchors_through_a_rollout_func_come_from_the_reference_with_their_own_extra_fields(
        path, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    calls = []
    trainer = armor_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path,
                            tracing_rollout(tiny_tokenizer, calls), max_steps=2, **(CB if path != "generate" else {}))
    rounds = capture_rounds(trainer)
    seen_inputs = []
    original = trainer._calculate_rewards

    def recording(inputs, prompts, completions, completion_ids_list):
        seen_inputs.append([dict(row) for row in inputs])
        return original(inputs, prompts, completions, completion_ids_list)

    trainer._calculate_rewards = recording
    trainer.train()

    # per round: the policy's rows (G - 1 = 3 per group), then K = 4 candidates per group on the reference model
    assert [(by_reference, len(prompts)) for by_reference, prompts in calls] == [(False, 6), (True, 8)] * 2
    slots, anchored = anchor_rows(8, 4), 0
    for output, rows, (_, candidates_prompts) in zip(rounds, seen_inputs, calls[1::2]):
        assert len(rows) == 8
        for row, inputs in enumerate(rows):
            # every row's extra field is the one its call returned with it: same prompt, same completion (padded;
            # the completion mask of a row taken out of the loss is 0)
            completion, pad = output["completion_ids"][row].tolist(), tiny_tokenizer.pad_token_id
            made = inputs["origin"][1]
            assert inputs["origin"][0] == inputs["prompt"]
            assert completion[: len(made)] == made and set(completion[len(made):]) <= {pad}
            # anchor slots (a verified anchor, or an unverified filler): generated on the reference; others: policy
            assert inputs["origin"][2] == (row in slots)
            if output["armor_is_anchor"][row]:
                group = slots.index(row)
                assert candidates_prompts[group * 4 : (group + 1) * 4] == [inputs["prompt"]] * 4
                anchored += 1
    assert anchored > 0
    assert logged(trainer, "armor/anchor_found_frac")


def test_an_env_mask_travels_with_its_row_anchors_included(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    """A tool loop written as a rollout_func marks environment tokens with env_mask (here: every other token of a
    completion); each row, anchor rows included, trains with the mask of the call that made it."""
    calls = []
    traced = tracing_rollout(tiny_tokenizer, calls)

    def with_env_mask(prompts, trainer):
        output = traced(prompts, trainer)
        output["env_mask"] = [[(i + len(prompt)) % 2 for i in range(len(ids))]
                              for prompt, ids in zip(prompts, output["completion_ids"])]
        return output

    trainer = armor_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, with_env_mask, max_steps=2)
    rounds = capture_rounds(trainer)
    trainer.train()
    for output in rounds:
        assert output["armor_is_anchor"].any()
        for row in range(8):
            ids, eos = output["completion_ids"][row].tolist(), tiny_tokenizer.eos_token_id
            length = ids.index(eos) + 1 if eos in ids else len(ids)
            prompt = tiny_tokenizer.decode(output["prompt_ids"][row][output["prompt_mask"][row].bool()],
                                           skip_special_tokens=True)
            expected = [(i + len(prompt)) % 2 for i in range(output["tool_mask"].size(1))]
            assert output["tool_mask"][row][:length].tolist() == expected[:length]


def test_a_same_call_round_asks_the_rollout_func_for_the_candidates_with_the_policys_rows(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    calls = []
    trainer = armor_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path,
                            tracing_rollout(tiny_tokenizer, calls), max_steps=1, anchor_same_call=True)
    rounds = capture_rounds(trainer)
    trainer.train()
    # π_ref holds the policy's weights at step 0: one call, 3 on-policy rows and 4 candidates per group
    assert [(by_reference, len(prompts)) for by_reference, prompts in calls] == [(False, 14)]
    assert logged(trainer, "armor/anchor_same_call") == [1.0]
    assert rounds[0]["armor_is_anchor"].any()


def test_a_rollout_func_with_its_own_server_is_told_which_anchors_it_can_use(tiny_model_path, tiny_tokenizer,
                                                                              prompt_dataset, tmp_path):
    def own_server(prompts, trainer):  # never touches the trainer's model
        ids = [tiny_tokenizer(prompt)["input_ids"] for prompt in prompts]
        return {"prompt_ids": ids, "completion_ids": [[7, 8, tiny_tokenizer.eos_token_id]] * len(prompts),
                "logprobs": None}

    trainer = armor_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, own_server,
                            reward_funcs=has_digit_reward, max_steps=1)
    with pytest.raises(ValueError, match="own server can only train with anchors that need no generation: "
                                         "anchor_source='column'"):
        trainer.train()


def test_a_rollout_func_with_its_own_server_trains_with_column_anchors(tiny_model_path, tiny_tokenizer, tmp_path):
    from datasets import Dataset

    def own_server(prompts, trainer):
        ids = [tiny_tokenizer(prompt)["input_ids"] for prompt in prompts]
        return {"prompt_ids": ids, "completion_ids": [[7, 8, tiny_tokenizer.eos_token_id]] * len(prompts),
                "logprobs": None}

    numbers = range(16)
    dataset = Dataset.from_dict({"prompt": [f"{n}+{n + 1}=" for n in numbers],
                                 "anchors": [[f"{2 * n + 1}"] for n in numbers]})
    trainer = armor_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path, own_server,
                            reward_funcs=has_digit_reward, max_steps=2, anchor_source="column", anchor_reward_threshold=1.0)
    rounds = capture_rounds(trainer)
    trainer.train()
    for output in rounds:
        anchors = output["completion_ids"][output["armor_is_anchor"]]
        assert len(anchors) == 2 and all(7 not in ids.tolist() for ids in anchors)  # the column's, not the server's


def test_a_rollout_func_breaking_the_one_completion_per_prompt_contract_is_named(tiny_model_path, tiny_tokenizer,
                                                                                 prompt_dataset, tmp_path):
    def per_group(prompts, trainer):  # returns one row per distinct prompt
        unique = list(dict.fromkeys(prompts))
        ids = [tiny_tokenizer(prompt)["input_ids"] for prompt in unique]
        return {"prompt_ids": ids, "completion_ids": generate_completions(trainer, ids), "logprobs": None}

    trainer = armor_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, per_group,
                            reward_funcs=has_digit_reward, max_steps=1)
    with pytest.raises(ValueError, match="it was given 6 prompts and returned 'prompt_ids' with 2"):
        trainer.train()


def test_with_vllm_online_anchors_through_a_rollout_func_are_refused_naming_what_works(tiny_model_path, tiny_tokenizer,
                                                                                       prompt_dataset, tmp_path):
    with pytest.raises(ValueError, match="rollout_func and use_vllm=True.*use_vllm=False.*anchor_source='column'"):
        armor_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, tracing_rollout(tiny_tokenizer, []),
                      use_vllm=True)


def test_with_both_switches_off_a_rollout_func_trains_as_in_grpo_trainer(tiny_model_path, tiny_tokenizer,
                                                                         prompt_dataset, tmp_path):
    common = cpu_args(max_steps=2, num_iterations=2, epsilon_high=0.28)  # (ArmorConfig's epsilon_high)
    grpo_calls, armor_calls = [], []
    grpo = GRPOTrainer(model=tiny_model_path, reward_funcs=origin_checked_reward,
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo"), **common), train_dataset=prompt_dataset,
                       processing_class=tiny_tokenizer, rollout_func=tracing_rollout(tiny_tokenizer, grpo_calls))
    grpo.train()
    armor = ArmorGRPOTrainer(model=tiny_model_path, reward_funcs=origin_checked_reward,
                             args=ArmorConfig(output_dir=str(tmp_path / "armor"), use_anchors=False,
                                              use_mixed_ratio=False, **common),
                             train_dataset=prompt_dataset, processing_class=tiny_tokenizer,
                             rollout_func=tracing_rollout(tiny_tokenizer, armor_calls))
    armor.train()
    assert grpo_calls == armor_calls
    for (name, p), q in zip(grpo.model.named_parameters(), armor.model.parameters()):
        assert torch.equal(p, q), name
    assert logged(grpo, "loss") == logged(armor, "loss")


def run(tiny_model_path, tiny_tokenizer, dataset, output_dir, stop_at=None, resume=None):
    trainer = armor_trainer(tiny_model_path, tiny_tokenizer, dataset, output_dir, tracing_rollout(tiny_tokenizer, []),
                            ref_reset_steps=2, max_steps=4, save_strategy="steps", save_steps=2, anchor_cache=True)
    if stop_at is not None:
        trainer.add_callback(StopAt(stop_at))
    trainer.train(resume_from_checkpoint=resume)
    reference = [p.detach().clone() for p in trainer.reference.parameters_of(trainer.unwrapped_policy())]
    return trainer, reference, {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_resume_with_a_rollout_func_continues_the_run_exactly(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    check_exact_resume(run, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path)


# --- dynamic sampling: on-policy rows scored before the candidates (anchor_eligible_only) --------------------------
def env_score_rollout(tokenizer):
    """A rollout_func whose environment scores each row itself (an extra field, as an environment's reward is
    returned), and one extra field a reward function never asks for."""

    def rollout_func(prompts, trainer):
        prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts]
        completion_ids = generate_completions(trainer, prompt_ids)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None,
                "env_score": [float(any(ch.isdigit() for ch in text)) for text in texts],
                "env_text": texts}

    return rollout_func


def env_score_reward(seen):
    """The environment's score, read from the extra field it requires (no default: a missing field is a crash)."""

    def env_reward(completions, env_score, env_text, **kwargs):
        seen.append([(text, score, completion if isinstance(completion, str) else completion[0]["content"])
                     for text, score, completion in zip(env_text, env_score, completions)])
        return env_score

    return env_reward


@pytest.mark.parametrize("sampling", ["eager", "lazy"])
def test_on_policy_rows_scored_before_the_candidates_see_the_rollout_funcs_extra_fields(
        tiny_model_path, tiny_tokenizer, tmp_path, sampling):
    # Eligible-only scores the on-policy rows inside generation, before TRL copies the rollout_func's extra fields into
    # the inputs: each row must be scored with its own fields, and TRL's scoring reuses those rewards (no second run)
    from testing import numbers_dataset

    runs = {}
    for eligible_only in (False, True):
        seen = []
        trainer = armor_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(range(32)),
                                tmp_path / str(eligible_only), env_score_rollout(tiny_tokenizer),
                                reward_funcs=env_score_reward(seen), max_steps=2, dynamic_sampling=True,
                                anchor_reward_threshold=1.0, anchor_eligible_only=eligible_only,
                                anchor_sampling=sampling, anchor_fail_after_rounds=0, seed=3)
        rewards = []
        original = trainer._calculate_rewards
        trainer._calculate_rewards = lambda *a: rewards.append(original(*a).clone()) or rewards[-1]
        trainer.train()
        for call in seen:  # every row the reward function saw carried its own row's field
            assert all(text is not None and text == completion for text, _, completion in call)
        runs[eligible_only] = (rewards, trainer, sum(len(call) for call in seen))
    (paper, _, _), (eligible, trainer, calls) = runs[False], runs[True]
    # the first round's on-policy rows (the same draws on both paths, before the candidates' draws part the random
    # streams) get the same rewards: the environment's scores, none missing
    policy = [row for row in range(8) if row not in anchor_rows(8, 4)]
    assert eligible[0][policy].tolist() == paper[0][policy].tolist()
    assert not eligible[0][policy].isnan().any()
    assert not any(v == 1.0 for v in logged(trainer, "armor/dropped_all_wrong_frac"))
    counts = trainer.anchor_rollout.counts  # scored once: TRL's scoring reused the early scores of the on-policy rows
    assert calls == counts["rounds"] * 2 * 3 + counts["candidates_scored"]
