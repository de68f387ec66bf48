"""avg@k / pass@k: the estimator against brute force, evaluate() against a scripted model, and the training callback."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from armor_trl.evaluation import ValidationCallback, evaluate, pass_at_k, sample_completions
from armor_trl.rewards import exact_integer_reward
from conftest import cpu_args, has_digit_reward


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


def test_evaluate_skips_unjudgeable_problems(tiny_tokenizer):
    dataset = Dataset.from_dict({"prompt": ["1+1=", "2+2="], "answer": ["2", None]})
    model = ScriptedModel(tiny_tokenizer, {"1+1=": 1, "2+2=": 1})
    result = evaluate(model, tiny_tokenizer, dataset, exact_integer_reward, k=1, num_samples=2)
    assert result["correct_counts"] == [1, None]
    assert result["avg@2"] == 0.5 and result["num_unjudged"] == 1
    with pytest.raises(ValueError, match="judge none"):
        evaluate(model, tiny_tokenizer, dataset.select([1]), exact_integer_reward, k=1)


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


def test_validation_callback_logs_through_the_trainer(tiny_model_path, prompt_dataset, tmp_path):
    held_out = prompt_dataset.select(range(8))
    jsonl = tmp_path / "val.jsonl"
    callback = ValidationCallback(held_out, has_digit_reward, every_steps=1, k=2, num_samples=2, max_new_tokens=4,
                                  jsonl_path=str(jsonl), run_name="unit")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **cpu_args(max_steps=2))
    trainer = GRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, args=args,
                          train_dataset=prompt_dataset, callbacks=[callback])
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "val/avg@2" in entry]
    assert [entry["step"] for entry in logged] == [1, 2]
    for entry in logged:
        assert 0.0 <= entry["val/pass@2"] <= 1.0
        assert entry["val/reward_gap"] == pytest.approx(entry["reward"] - entry["val/avg@2"])
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and all(r["run"] == "unit" for r in records)
    assert "train_reward" not in records[0] and records[1]["train_reward"] == logged[0]["reward"]
    assert callback.history == records


def test_validation_callback_refuses_zero3_instead_of_hanging():
    from types import SimpleNamespace

    from armor_trl.evaluation import ValidationCallback

    callback = ValidationCallback(eval_dataset=None, verifier=lambda **kw: [], every_steps=1)
    args = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3))
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    with pytest.raises(ValueError, match="ZeRO-3"):
        callback.on_train_begin(args, state, None)
