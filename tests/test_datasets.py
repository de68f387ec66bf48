"""Dataset adapters on small local files of each schema, the hub registry (mocked), and the synthetic task."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset

import armor_trl.datasets as ds
from armor_trl.datasets import (
    BOXED_INSTRUCTION,
    arithmetic_problems,
    arithmetic_splits,
    detect_schema,
    format_prompt,
    load_rlvr_dataset,
)
from armor_trl.rewards import math_verify_reward

GSM8K_ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24.\nIn total 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A farm has 1,200 hens and buys 34 more. How many now?", "answer": "1200+34=1234\n#### 1,234"},
]
MATH_ROWS = [  # hendrycks MATH: the answer only inside the solution's \boxed{}
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "level": "Level 1",
     "solution": "We get $\\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$."},
]
MATH500_ROWS = [{"problem": "Compute $3^2$.", "solution": "$3^2 = 9$, so $\\boxed{9}$.", "answer": "9", "unique_id": "x"}]
DAPO_ROWS = [
    {"data_source": "math_dapo",
     "prompt": [{"content": "Solve the following math problem step by step. What is 6*7?\n\nRemember to put your "
                            "answer on its own line after \"Answer:\".", "role": "user"}],
     "ability": "MATH", "reward_model": {"ground_truth": "42", "style": "rule-lighteval/MATH_v2"},
     "extra_info": {"index": "a1"}},
]
AIME_ROWS = [{"id": 60, "problem": "Find the remainder when $2^{10}$ is divided by $1000$.", "answer": 24, "year": 2024}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_parquet(path, rows):
    Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def test_gsm8k_local_jsonl(tmp_path):
    data = load_rlvr_dataset(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS))
    assert data.column_names == ["prompt", "answer"]
    assert data["prompt"] == [row["question"] for row in GSM8K_ROWS]
    assert data["answer"] == ["72", "1234"]
    assert math_verify_reward(["so 72 clips\n#### 72", r"\boxed{1234}"], answer=data["answer"]) == [1.0, 1.0]


def test_math_solution_only_parquet(tmp_path):
    data = load_rlvr_dataset(write_parquet(tmp_path / "math.parquet", MATH_ROWS))
    assert data[0]["prompt"] == MATH_ROWS[0]["problem"]
    assert data[0]["answer"] == MATH_ROWS[0]["solution"]  # math-verify reads the boxed answer of the solution
    assert data[0]["solution"] == MATH_ROWS[0]["solution"]
    assert math_verify_reward([r"\boxed{0.75}", r"\boxed{\frac{1}{2}}"], answer=[data[0]["answer"]] * 2) == [1.0, 0.0]


def test_math500_prefers_the_answer_column(tmp_path):
    data = load_rlvr_dataset(write_parquet(tmp_path / "math500.parquet", MATH500_ROWS))
    assert data[0]["answer"] == "9"
    assert sorted(data.column_names) == ["answer", "prompt", "solution"]


def test_dapo_parquet(tmp_path):
    data = load_rlvr_dataset(write_parquet(tmp_path / "dapo.parquet", DAPO_ROWS))
    assert data.column_names == ["prompt", "answer"]
    assert data[0]["prompt"] == DAPO_ROWS[0]["prompt"][0]["content"]
    assert data[0]["answer"] == "42"
    assert math_verify_reward(["6*7 = 42\nAnswer: 42"], answer=data["answer"]) == [1.0]


def test_aime_json_with_integer_answers(tmp_path):
    path = tmp_path / "aime.json"
    path.write_text(json.dumps(AIME_ROWS))
    data = load_rlvr_dataset(str(path), schema="aime")
    assert data[0] == {"prompt": AIME_ROWS[0]["problem"], "answer": "24"}


def test_schema_detection_and_errors(tmp_path):
    assert detect_schema(["question", "answer"]) == "gsm8k"
    assert detect_schema(["problem", "solution", "level"]) == "math"
    assert detect_schema(["prompt", "reward_model", "ability"]) == "dapo"
    assert detect_schema(["prompt", "answer"]) == "prompt_answer"
    with pytest.raises(ValueError, match="Cannot tell the schema"):
        detect_schema(["text", "label"])
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS)
    with pytest.raises(ValueError, match="Unknown schema"):
        load_rlvr_dataset(path, schema="nope")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match="Unsupported file type"):
        load_rlvr_dataset(str(tmp_path / "data.txt"))


def test_chat_prompts_system_and_instruction(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    data = load_rlvr_dataset(path, chat=True, system_prompt="You are careful.", instruction="default", limit=1)
    assert len(data) == 1
    assert data[0]["prompt"] == [
        {"role": "system", "content": "You are careful."},
        {"role": "user", "content": f"{GSM8K_ROWS[0]['question']}\n\n{BOXED_INSTRUCTION}"},
    ]
    assert format_prompt("1+1=", chat=True) == [{"role": "user", "content": "1+1="}]
    assert format_prompt("1+1=", instruction="Answer only.") == "1+1=\n\nAnswer only."


def test_registry_names_load_from_the_hub(monkeypatch):
    """Registry names go to datasets.load_dataset with the right id, config and split, then through the adapter."""
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        rows = {"openai/gsm8k": GSM8K_ROWS, "BytedTsinghua-SIA/DAPO-Math-17k": DAPO_ROWS}.get(path, MATH500_ROWS)
        return Dataset.from_list(rows)

    monkeypatch.setattr(ds, "load_dataset", fake_load_dataset)
    assert load_rlvr_dataset("gsm8k")["answer"] == ["72", "1234"]
    assert load_rlvr_dataset("gsm8k", split="test")
    assert load_rlvr_dataset("dapo")["answer"] == ["42"]
    assert load_rlvr_dataset("math500")["answer"] == ["9"]
    assert load_rlvr_dataset("someone/custom-math", split="validation")["answer"] == ["9"]
    assert calls == [
        ("openai/gsm8k", "main", "train"),
        ("openai/gsm8k", "main", "test"),
        ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"),
        ("HuggingFaceH4/MATH-500", None, "test"),
        ("someone/custom-math", None, "validation"),
    ]


def test_arithmetic_task_is_deterministic_correct_and_disjoint():
    problems = arithmetic_problems(50, seed=3)
    assert problems == arithmetic_problems(50, seed=3)
    assert problems != arithmetic_problems(50, seed=4)
    for prompt, answer in problems:
        a, b = prompt.rstrip("=").split("+")
        assert len(a) == len(b) == 2 and int(a) + int(b) == int(answer)
    assert len({p for p, _ in problems}) == 50
    train, held_out = arithmetic_splits(16, 40, seed=1)
    assert (len(train), len(held_out)) == (16, 40)
    assert not set(train["prompt"]) & set(held_out["prompt"])
    bigger_train, same_held_out = arithmetic_splits(32, 40, seed=1)
    assert same_held_out["prompt"] == held_out["prompt"]  # the held-out set does not move with the train size
    assert bigger_train["prompt"][:16] == train["prompt"]
    excluded = arithmetic_problems(100, seed=0, exclude=set(train["prompt"]))
    assert not {p for p, _ in excluded} & set(train["prompt"])
    chat_train, _ = arithmetic_splits(2, 2, seed=1, chat=True)
    assert chat_train[0]["prompt"] == [{"role": "user", "content": train[0]["prompt"]}]
    with pytest.raises(ValueError, match="distinct"):
        arithmetic_problems(200, digits=1)
