"""avg@k / pass@k: the estimator against brute force, evaluate() against a scripted model, and the training callback."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from armor_trl.integration import trl_generation
from armor_trl.callbacks.evaluation import (
    NothingJudgedError, completion_logps, evaluate, evaluate_with_trainer, pass_at_k, pass_curve, sample_completions,
    shard,
)
from armor_trl.callbacks.validation import ValidationCallback
from armor_trl.rewards import exact_integer_reward
from testing import cpu_args, has_digit_reward


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_brute_force_enumeration(n):
    """pass@k = P(a uniformly drawn k-subset of the n samples holds a correct one), enumerated exactly."""
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_edges():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 6, 5) == 1.0  # n - c < k: every k-subset holds a correct sample
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the plain accuracy
    assert pass_at_k(100, 10, 10) == pytest.approx(1 - math.comb(90, 10) / math.comb(100, 10))
    for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


class ScriptedModel(torch.nn.Module):
    """A 'model' whose generate answers problem i correctly in exactly CORRECT[i] of its n samples."""

    def __init__(self, tokenizer, correct: dict[str, int]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.correct = tokenizer, correct
        self.calls = []

    def generate(self, input_ids, attention_mask, max_new_tokens, num_return_sequences, **kwargs):
        self.calls.append({"rows": len(input_ids), "n": num_return_sequences, "training": self.training, **kwargs})
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = self.tokenizer.decode([t for t, m in zip(ids, mask) if m])
            a, b = prompt.rstrip("=").split("+")
            for sample in range(num_return_sequences):
                answer = str(int(a) + int(b) + (0 if sample < self.correct[prompt] else 1))
                completion = self.tokenizer(answer)["input_ids"] + [self.tokenizer.eos_token_id]
                rows.append(ids + completion + [self.tokenizer.pad_token_id] * (4 - len(completion)))
        return torch.tensor(rows)


def test_evaluate_counts_exactly(tiny_tokenizer):
    prompts = ["12+35=", "40+2=", "99+1=", "7+8="]
    dataset = Dataset.from_dict({"prompt": prompts, "answer": ["47", "42", "100", "15"]})
    correct = dict(zip(prompts, [0, 1, 3, 4]))
    model = ScriptedModel(tiny_tokenizer, correct)
    model.train()
    result = evaluate(model, tiny_tokenizer, dataset, exact_integer_reward, k=2, num_samples=4, batch_size=8)
    assert result["correct_counts"] == [0, 1, 3, 4]
    assert result["avg@4"] == pytest.approx((0 + 1 + 3 + 4) / 16)
    assert result["pass@2"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in [0, 1, 3, 4]) / 4)
    assert result["num_problems"] == 4 and result["num_unjudged"] == 0
    assert [call["rows"] for call in model.calls] == [2, 2]  # batch_size counts sequences: 8 // 4 prompts per call
    assert all(call["do_sample"] and not call["training"] for call in model.calls)
    assert model.training  # mode restored


def test_evaluate_skips_unjudgeable_problems_and_says_which_and_why(tiny_tokenizer):
    prompts = ["1+1=", "2+2=", "3+3=", "4+4="]
    # a missing answer, an answer the verifier cannot read (not an integer), and a verifier that gives up on one sample
    dataset = Dataset.from_dict({"prompt": prompts, "answer": ["2", None, "six", "8"]})
    model = ScriptedModel(tiny_tokenizer, dict.fromkeys(prompts, 1))

    def flaky_on_the_last(completions, **kwargs):
        rewards = exact_integer_reward(completions, **kwargs)
        return rewards if kwargs["prompts"][0] != "4+4=" else rewards[:-1] + [None]

    result = evaluate(model, tiny_tokenizer, dataset, flaky_on_the_last, k=1, num_samples=2)
    assert result["correct_counts"] == [1, None, None, None]
    assert result["avg@2"] == 0.5
    assert (result["num_problems"], result["num_total"], result["num_unjudged"]) == (1, 4, 3)
    assert result["unjudged_reasons"] == {"no_ground_truth": 1, "verifier_cannot_judge": 1,
                                          "verifier_cannot_judge_some": 1}
    assert result["unjudged"] == [
        {"index": 1, "reason": "no_ground_truth", "ground_truth": None},
        {"index": 2, "reason": "verifier_cannot_judge", "ground_truth": "six"},
        {"index": 3, "reason": "verifier_cannot_judge_some", "ground_truth": "8"},
    ]
    with pytest.raises(NothingJudgedError, match="could judge none of the 1 problems .1 no ground truth"):
        evaluate(model, tiny_tokenizer, dataset.select([1]), exact_integer_reward, k=1)


def test_fewer_samples_than_k_is_refused_before_generating(tiny_tokenizer):
    dataset = Dataset.from_dict({"prompt": ["1+1="], "answer": ["2"]})
    model = ScriptedModel(tiny_tokenizer, {"1+1=": 1})
    with pytest.raises(ValueError, match=r"num_samples \(2\) must be >= k \(4\)"):
        evaluate(model, tiny_tokenizer, dataset, exact_integer_reward, k=4, num_samples=2)
    assert model.calls == []
    with pytest.raises(ValueError, match=r"num_samples \(2\) must be >= k \(4\)"):
        ValidationCallback(dataset, exact_integer_reward, every_steps=1, k=4, num_samples=2)


def test_an_unknown_sampling_setting_is_refused_naming_the_settings(tiny_tokenizer):
    dataset = Dataset.from_dict({"prompt": ["1+1="], "answer": ["2"]})
    model = ScriptedModel(tiny_tokenizer, {"1+1=": 1})
    message = r"unknown sampling settings \['max_tokens'\]: the settings are \['batch_size', 'max_new_tokens', " \
              r"'temperature', 'top_p'\]"
    with pytest.raises(TypeError, match=message):
        evaluate(model, tiny_tokenizer, dataset, exact_integer_reward, k=1, max_tokens=4)
    assert model.calls == []
    with pytest.raises(TypeError, match=message):
        evaluate_with_trainer(None, dataset, exact_integer_reward, k=1, max_tokens=4)  # before the trainer is used


def test_sampling_with_a_real_model_is_reproducible(tiny_model_path, tiny_tokenizer, chat_dataset):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    data = chat_dataset.select(range(6))
    first = evaluate(model, tiny_tokenizer, data, has_digit_reward, k=2, num_samples=3, max_new_tokens=4, seed=7)
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    second = evaluate(model, tiny_tokenizer, data, has_digit_reward, k=2, num_samples=3, max_new_tokens=4, seed=7)
    assert torch.equal(state, torch.random.get_rng_state())  # the training RNG is left alone
    assert first["correct_counts"] == second["correct_counts"] and first["samples"] == second["samples"]
    assert 0.0 <= first["avg@3"] <= first["pass@2"] <= 1.0
    greedy = sample_completions(model, tiny_tokenizer, ["1+2=", "3+4="], 3, max_new_tokens=4, temperature=0)
    assert all(len(set(group)) == 1 and len(group) == 3 for group in greedy)


def _train_with_validation(tiny_model_path, prompt_dataset, tmp_path, attach=True, **overrides):
    held_out = prompt_dataset.select(range(8))
    jsonl = tmp_path / "val.jsonl"
    callback = ValidationCallback(held_out, has_digit_reward, every_steps=1, k=2, num_samples=2, max_new_tokens=4,
                                  jsonl_path=str(jsonl), run_name="unit")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **cpu_args(max_steps=2, **overrides))
    trainer = GRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, args=args,
                          train_dataset=prompt_dataset, callbacks=None if attach else [callback])
    if attach:
        assert callback.attach(trainer) is callback
    trainer.train()
    return trainer, callback, [json.loads(line) for line in jsonl.read_text().splitlines()]


def test_validation_callback_logs_through_the_trainer(tiny_model_path, prompt_dataset, tmp_path):
    trainer, callback, records = _train_with_validation(tiny_model_path, prompt_dataset, tmp_path)
    history = trainer.state.log_history
    logged = [entry for entry in history if "val/avg@2" in entry]
    assert [entry["step"] for entry in logged] == [1, 2]  # once per evaluation, in its own entry
    for entry in logged:
        training = [e for e in history if e["step"] == entry["step"] and "reward" in e]
        assert len(training) == 1 and "val/avg@2" not in training[0]
        assert history.index(training[0]) < history.index(entry)  # after the step's own training log
        assert 0.0 <= entry["val/pass@2"] <= 1.0
        assert entry["val/reward_gap"] == pytest.approx(training[0]["reward"] - entry["val/avg@2"])
    # TRL's per-step metrics are still averaged into the step's training log, not swallowed by the validation log
    assert all("reward" in e and "completions/mean_length" in e for e in history if "loss" in e)
    assert [r["step"] for r in records] == [0, 1, 2] and all(r["run"] == "unit" for r in records)
    step_one_reward = next(e["reward"] for e in history if e["step"] == 1 and "reward" in e)
    assert "train_reward" not in records[0] and records[1]["train_reward"] == step_one_reward
    assert callback.history == records
    assert [{k: v for k, v in r.items() if k.startswith("val/")} for r in records[1:]] == [
        {k: v for k, v in e.items() if k.startswith("val/")} for e in logged]


def test_validation_metrics_reach_tensorboard(tiny_model_path, prompt_dataset, tmp_path):
    """Read the event files back: the reporter got val/* at the steps they were measured, once each."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, _, records = _train_with_validation(tiny_model_path, prompt_dataset, tmp_path, report_to="tensorboard")
    event_dirs = {path.parent for path in (tmp_path / "out").rglob("events.out.tfevents.*")}
    assert len(event_dirs) == 1
    events = EventAccumulator(str(event_dirs.pop()))
    events.Reload()
    tags = events.Tags()["scalars"]
    val_tags = [tag for tag in tags if tag.endswith("val/avg@2")]  # transformers writes it as train/val/avg@2
    assert len(val_tags) == 1, f"val/avg@2 did not reach tensorboard; its scalars: {tags}"
    scalars = events.Scalars(val_tags[0])
    assert [s.step for s in scalars] == [1, 2]
    assert [s.value for s in scalars] == pytest.approx([r["val/avg@2"] for r in records[1:]])
    assert any(tag.endswith("val/pass@2") for tag in tags) and any(tag.endswith("val/reward_gap") for tag in tags)
    assert any(tag.endswith("/reward") for tag in tags)  # TRL's own metrics still reach it


def test_validation_callback_without_its_trainer_still_records(tiny_model_path, prompt_dataset, tmp_path):
    """Passed in callbacks=[...] (no trainer to log through): the values are merged into the step's entry."""
    trainer, callback, records = _train_with_validation(tiny_model_path, prompt_dataset, tmp_path, attach=False)
    logged = [entry for entry in trainer.state.log_history if "val/avg@2" in entry]
    assert [entry["step"] for entry in logged] == [1, 2]
    for entry in logged:
        assert entry["val/reward_gap"] == pytest.approx(entry["reward"] - entry["val/avg@2"])
    assert [r["step"] for r in records] == [0, 1, 2] and callback.history == records


def test_validation_callback_refuses_zero3_instead_of_hanging():
    from types import SimpleNamespace

    from armor_trl.callbacks.validation import ValidationCallback

    callback = ValidationCallback(eval_dataset=None, verifier=lambda **kw: [], every_steps=1)
    args = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3))
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    with pytest.raises(ValueError, match="ZeRO-3"):
        callback.on_train_begin(args, state, None)


def test_several_validation_sets_are_logged_under_their_names(tiny_model_path, prompt_dataset, tmp_path):
    sets = {"low": prompt_dataset.select(range(4)), "high": prompt_dataset.select(range(28, 32))}
    callback = ValidationCallback(sets, has_digit_reward, every_steps=1, k=2, num_samples=2, max_new_tokens=4)
    trainer = GRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, train_dataset=prompt_dataset,
                          args=GRPOConfig(output_dir=str(tmp_path), **cpu_args(max_steps=1)))
    callback.attach(trainer)
    trainer.train()
    entry = next(e for e in trainer.state.log_history if any(k.startswith("val/") for k in e))
    keys = {k for k in entry if k.startswith("val/")}
    # pass@1 too: the pass@k curve at every power of two up to k
    assert keys == {f"val/{name}/{what}" for name in sets for what in ("avg@2", "pass@1", "pass@2", "reward_gap")}
    reward = next(e["reward"] for e in trainer.state.log_history if "reward" in e)
    for name in sets:
        assert entry[f"val/{name}/reward_gap"] == pytest.approx(reward - entry[f"val/{name}/avg@2"])
    with pytest.raises(ValueError, match="names must be non-empty strings without '/'"):
        ValidationCallback({"a/b": sets["low"]}, has_digit_reward, every_steps=1)


def test_load_best_model_at_end_picks_the_best_validation(tiny_model_path, prompt_dataset, tmp_path):
    """save_strategy='best' + metric_for_best_model='val/avg@2': validation decides which checkpoint is best."""
    from safetensors.torch import load_file

    script = {0: 0.0, 1: 0.2, 2: 0.6, 3: 0.4, 4: 0.5}
    args = GRPOConfig(output_dir=str(tmp_path), **cpu_args(max_steps=4, save_strategy="best",
                      metric_for_best_model="val/avg@2", load_best_model_at_end=True))
    trainer = GRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, train_dataset=prompt_dataset, args=args)
    callback = ValidationCallback(None, None, every_steps=1, k=2, num_samples=2).attach(trainer)
    callback._evaluate = lambda state, model, tokenizer: {"val/avg@2": script[state.global_step], "val/pass@2": 0.0}
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    assert trainer.state.best_metric == 0.6
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]  # new bests only
    best = load_file(str(tmp_path / "checkpoint-2" / "model.safetensors"))
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(best[name], params[name].detach()) for name in best)  # loaded back at the end
    last = load_file(str(tmp_path / "checkpoint-1" / "model.safetensors"))
    assert any(not torch.equal(last[name], best[name]) for name in best)


def test_shards_cover_every_problem_once_and_are_padded_to_equal_length():
    for problems in range(1, 12):
        for world in range(1, 5):
            shards = [shard(problems, rank, world) for rank in range(world)]
            assert len({len(indices) for indices, _ in shards}) == 1  # same number of generation calls everywhere
            real = [i for indices, count in shards for i in indices[:count]]
            assert real == list(range(problems))
            assert all(0 <= i < problems for indices, _ in shards for i in indices)


def _grpo_trainer(tiny_model_path, prompt_dataset, tmp_path, **overrides):
    args = GRPOConfig(output_dir=str(tmp_path), **cpu_args(**{"temperature": 0.7, **overrides}))
    return GRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, args=args, train_dataset=prompt_dataset)


def test_sampling_with_sets_validation_settings_for_the_block_and_restores_training_ones(
    tiny_model_path, prompt_dataset, tmp_path
):
    trainer = _grpo_trainer(tiny_model_path, prompt_dataset, tmp_path)
    config, kwargs = trainer.generation_config, trainer.generation_kwargs
    with trl_generation.sampling_with(trainer, temperature=1.3, top_p=0.6, max_tokens=3):
        inside = trainer.generation_config
        assert (inside.temperature, inside.top_p, inside.max_new_tokens, inside.do_sample) == (1.3, 0.6, 3, True)
        assert (trainer.temperature, trainer.top_p, trainer.max_completion_length) == (1.3, 0.6, 3)
        assert inside.eos_token_id == config.eos_token_id and inside.pad_token_id == config.pad_token_id
    with trl_generation.sampling_with(trainer, temperature=0, top_p=1.0, max_tokens=5):
        assert not trainer.generation_config.do_sample and trainer.generation_config.max_new_tokens == 5
    assert trainer.generation_config is config and trainer.generation_kwargs is kwargs
    assert (trainer.temperature, trainer.top_p, trainer.max_completion_length) == (0.7, 1.0, 8)
    with pytest.raises(ValueError, match="top_p"), trl_generation.sampling_with(trainer, 1.0, 0.0, 4):
        pass
    # vLLM: the engine wrapper's attributes are what TRL reads; its generation_kwargs must not override them
    engine = SimpleNamespace(temperature=0.7, top_p=1.0, max_completion_length=8,
                             generation_kwargs={"temperature": 0.7, "max_tokens": 8, "seed": 1})
    fake = SimpleNamespace(use_vllm=True, temperature=0.7, top_p=1.0, max_completion_length=8, vllm_generation=engine)
    with trl_generation.sampling_with(fake, temperature=1.0, top_p=0.7, max_tokens=4):
        assert (engine.temperature, engine.top_p, engine.max_completion_length) == (1.0, 0.7, 4)
        assert engine.generation_kwargs == {"seed": 1}
    assert (engine.temperature, engine.top_p, engine.max_completion_length) == (0.7, 1.0, 8)
    assert engine.generation_kwargs == {"temperature": 0.7, "max_tokens": 8, "seed": 1}


def test_evaluate_with_trainer_uses_its_generation_path_with_validation_settings(
    tiny_model_path, prompt_dataset, tmp_path, monkeypatch
):
    trainer = _grpo_trainer(tiny_model_path, prompt_dataset, tmp_path)
    held_out = prompt_dataset.select(range(5))
    seen = []
    original = GRPOTrainer._generate_single_turn

    def spy(self, prompt_ids, *args, **kwargs):
        config = self.generation_config
        seen.append((len(prompt_ids), config.temperature, config.top_p, config.max_new_tokens, self.model.training))
        return original(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", spy)
    trainer.model.train()
    rng = torch.random.get_rng_state()
    kwargs = dict(k=2, num_samples=3, max_new_tokens=3, temperature=1.2, top_p=0.8, batch_size=6)
    first = evaluate_with_trainer(trainer, held_out, has_digit_reward, seed=4, **kwargs)
    assert seen == [(6, 1.2, 0.8, 3, False)] * 2 + [(3, 1.2, 0.8, 3, False)]  # 2 problems x 3 samples per call
    assert trainer.model.training and torch.equal(rng, torch.random.get_rng_state())
    assert all(len(s) <= 3 for group in first["samples"] for s in group)  # max_new_tokens: 3 one-character tokens
    again = evaluate_with_trainer(trainer, held_out, has_digit_reward, seed=4, **kwargs)
    other = evaluate_with_trainer(trainer, held_out, has_digit_reward, seed=5, **kwargs)
    assert again["correct_counts"] == first["correct_counts"] and again["samples"] == first["samples"]
    assert other["samples"] != first["samples"]
    assert first["avg@3"] == pytest.approx(sum(first["correct_counts"]) / 15)
    assert first["pass@2"] == pytest.approx(sum(pass_at_k(3, c, 2) for c in first["correct_counts"]) / 5)
    # greedy: one completion per problem, repeated; the same completions as transformers generate on the model
    seen.clear()
    greedy = evaluate_with_trainer(trainer, held_out, has_digit_reward, k=2, num_samples=3, max_new_tokens=4,
                                   temperature=0, batch_size=1)
    assert [rows for rows, *_ in seen] == [1] * 5
    direct = evaluate(trainer.model, trainer.processing_class, held_out, has_digit_reward, k=2, num_samples=3,
                      max_new_tokens=4, temperature=0, batch_size=1)
    assert greedy["correct_counts"] == direct["correct_counts"] and greedy["samples"] == direct["samples"]


def test_attached_callback_validates_through_the_trainer(tiny_model_path, prompt_dataset, tmp_path, monkeypatch):
    calls = []
    generate = trl_generation.generate
    monkeypatch.setattr(trl_generation, "generate",
                        lambda trainer, ids, n: calls.append(len(ids)) or generate(trainer, ids, n))
    trainer = _grpo_trainer(tiny_model_path, prompt_dataset, tmp_path, max_steps=1)
    callback = ValidationCallback(prompt_dataset.select(range(3)), has_digit_reward, every_steps=1, k=2,
                                  num_samples=2, max_new_tokens=4, batch_size=2).attach(trainer)
    assert callback.on_every_process
    trainer.train()
    assert calls == [2] * 6  # steps 0 and 1, one problem x 2 samples per call
    assert [r["step"] for r in callback.history] == [0, 1]
    assert any("val/avg@2" in e for e in trainer.state.log_history)


class ModeScriptedModel(torch.nn.Module):
    """A 'model' whose generate writes problem p's samples from the list TEXTS[p] (cycled)."""

    def __init__(self, tokenizer, texts: dict[str, list[str]]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.texts = tokenizer, texts

    def generate(self, input_ids, attention_mask, max_new_tokens, num_return_sequences, **kwargs):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = self.tokenizer.decode([t for t, m in zip(ids, mask) if m])
            for sample in range(num_return_sequences):
                text = self.texts[prompt][sample % len(self.texts[prompt])]
                completion = self.tokenizer(text)["input_ids"] + [self.tokenizer.eos_token_id]
                rows.append(ids + completion + [self.tokenizer.pad_token_id] * (max_new_tokens - len(completion)))
        return torch.tensor(rows)


def test_validation_logs_each_modes_share_of_the_sampled_completions(tiny_tokenizer):
    from armor_trl.rewards.modes import classify
    from armor_trl.rewards import final_integer_reward

    texts = {"12+35=": ["2+5=7,1+3=4#47", "#47", "#47", "47"], "18+35=": ["8+5=13,1+3+1=5#53"] * 3 + ["#43"],
             "40+2=": ["#42", "#42", "0+2=2,4+0=4#42", "0+2=2,4+0=4#"]}
    dataset = Dataset.from_dict({"prompt": list(texts), "answer": ["47", "53", "42"]})
    sets = {"held": dataset, "first": dataset.select([0])}
    callback = ValidationCallback(sets, final_integer_reward, every_steps=1, k=2, num_samples=4, max_new_tokens=20,
                                  mode_classifier=classify)
    values = callback._evaluate(SimpleNamespace(global_step=0), ModeScriptedModel(tiny_tokenizer, texts),
                                tiny_tokenizer)
    everything = [classify(t) for samples in texts.values() for t in samples]
    for mode in ("worked", "direct", "other"):  # the share is the direct count over all 12 samples
        assert values[f"val/held/mode/{mode}"] == pytest.approx(everything.count(mode) / 12)
        assert values[f"val/first/mode/{mode}"] == pytest.approx([classify(t) for t in texts["12+35="]].count(mode) / 4)
    assert values["val/held/avg@4"] == pytest.approx((3 + 3 + 3) / 12)
    plain = ValidationCallback(sets, final_integer_reward, every_steps=1, k=2, num_samples=4, max_new_tokens=20)
    assert not any("/mode/" in key for key in plain._evaluate(
        SimpleNamespace(global_step=0), ModeScriptedModel(tiny_tokenizer, texts), tiny_tokenizer))


def test_mode_shares_through_the_trainers_generation_path(tiny_model_path, prompt_dataset, tmp_path):
    seen = []

    def first_character(text):  # records what it is shown: the shares must be the counts of these
        seen.append(text)
        return text[:1] or "empty"

    trainer = _grpo_trainer(tiny_model_path, prompt_dataset, tmp_path)
    result = evaluate_with_trainer(trainer, prompt_dataset.select(range(5)), has_digit_reward, k=2, num_samples=3,
                                   max_new_tokens=3, batch_size=6, seed=1, classify=first_character)
    assert len(seen) == 15 and sum(result["mode_shares"].values()) == pytest.approx(1.0)
    assert result["mode_shares"] == {label: pytest.approx(sum(t[:1] == label or (not t and label == "empty")
                                                              for t in seen) / 15) for label in set(result["mode_shares"])}


# --- the pass@k curve and the KL to the start model ---------------------------------------------------------------
def test_pass_curve_has_every_power_of_two_up_to_k():
    counts = [0, 3, 16, None, 9]  # None: not judged, left out
    curve = pass_curve(counts, 16, 16)
    assert list(curve) == [1, 2, 4, 8, 16]
    for k, value in curve.items():
        assert value == sum(pass_at_k(16, c, k) for c in (0, 3, 16, 9)) / 4
    assert list(pass_curve(counts, 16, 6)) == [1, 2, 4]


def test_completion_logps_do_not_depend_on_padding(tiny_model_path, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    prompts = [tiny_tokenizer("12+3=")["input_ids"], tiny_tokenizer("7=")["input_ids"]]
    completions = [[5, 6, 7], [8]]
    batched, mask = completion_logps(model, prompts, completions, 0.7, tiny_tokenizer.pad_token_id)
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / 0.7
        direct = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        torch.testing.assert_close(batched[row, : len(completion)], direct, rtol=1e-5, atol=1e-5)


def _train_with_kl(tiny_model_path, prompt_dataset, tmp_path, kl_prompts):
    callback = ValidationCallback(prompt_dataset.select(range(8)), has_digit_reward, every_steps=1, k=4, num_samples=4,
                                  max_new_tokens=4, temperature=1.0, kl_prompts=kl_prompts, kl_samples=4)
    args = GRPOConfig(output_dir=str(tmp_path / f"kl{kl_prompts}"), **cpu_args(max_steps=2, learning_rate=0.05))
    trainer = GRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, args=args,
                          train_dataset=prompt_dataset)
    callback.attach(trainer)
    trainer.train()
    return trainer, callback


def test_kl_to_the_start_model_is_zero_at_the_start_and_positive_once_the_policy_moved(
    tiny_model_path, prompt_dataset, tmp_path
):
    trainer, callback = _train_with_kl(tiny_model_path, prompt_dataset, tmp_path, kl_prompts=3)
    start, *later = callback.history
    # step 0: the policy is the start model, same weights and (same seed) same samples: exactly zero
    assert start["val/kl_reverse_start"] == 0.0 and start["val/kl_forward_start"] == 0.0
    assert later[-1]["val/kl_reverse_start"] > 0 and later[-1]["val/kl_forward_start"] > 0
    for record in callback.history:
        assert [key for key in record if key.startswith("val/pass@")] == ["val/pass@4", "val/pass@1", "val/pass@2"]
        assert record["val/pass@1"] == pytest.approx(record["val/avg@4"])  # pass@1 is the mean accuracy
    # measuring only observes: training and validation are as without it
    plain, plain_callback = _train_with_kl(tiny_model_path, prompt_dataset, tmp_path, kl_prompts=0)
    assert [e.get("loss") for e in trainer.state.log_history] == [e.get("loss") for e in plain.state.log_history]
    assert [{k: v for k, v in r.items() if "kl_" not in k} for r in callback.history] == plain_callback.history
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), plain.model.parameters()))


def test_kl_needs_sampling_and_the_trainer(prompt_dataset):
    with pytest.raises(ValueError, match="temperature > 0"):
        ValidationCallback(prompt_dataset, has_digit_reward, every_steps=1, temperature=0.0, kl_prompts=2)
    with pytest.raises(ValueError, match="kl_prompts >= 0"):
        ValidationCallback(prompt_dataset, has_digit_reward, every_steps=1, kl_prompts=-1)
    callback = ValidationCallback(prompt_dataset, has_digit_reward, every_steps=1, kl_prompts=2)
    with pytest.raises(ValueError, match="attached to a GRPOTrainer"):
        callback.on_train_begin(SimpleNamespace(report_to=[]), SimpleNamespace(global_step=0), None)
