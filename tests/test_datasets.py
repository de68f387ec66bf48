"""Dataset adapters on small local files of each schema, the hub registry (mocked), and the synthetic task."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from datasets import Dataset

import armor_trl.data.datasets as ds
from armor_trl import rewards
from armor_trl.data.datasets import (
    BOXED_INSTRUCTION,
    DAPO_PREFIX,
    DAPO_SUFFIX,
    arithmetic_problems,
    arithmetic_splits,
    detect_schema,
    format_prompt,
    load_rlvr_dataset,
)
from armor_trl.rewards import math_verify_reward
from testing import GSM8K_ROWS, write_parquet

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
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
AIME_ROWS = [{"id": 60, "problem": "Find the remainder when $2^{10}$ is divided by $1000$.", "answer": 24, "year": 2024}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_gsm8k_local_jsonl(tmp_path):
    data = load_rlvr_dataset(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS))
    assert data.column_names == ["prompt", "answer", "answer_format"]
    assert data["answer_format"] == ["gsm8k", "gsm8k"]
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
    assert sorted(data.column_names) == ["answer", "answer_format", "prompt", "solution"]
    assert data[0]["answer_format"] == "boxed"


def test_dapo_parquet(tmp_path):
    data = load_rlvr_dataset(write_parquet(tmp_path / "dapo.parquet", DAPO_ROWS))
    assert data.column_names == ["prompt", "answer", "answer_format"]
    assert data[0]["answer_format"] == "dapo"
    assert data[0]["prompt"] == DAPO_ROWS[0]["prompt"][0]["content"]
    assert data[0]["answer"] == "42"
    assert math_verify_reward(["6*7 = 42\nAnswer: 42"], answer=data["answer"]) == [1.0]


def test_aime_json_with_integer_answers(tmp_path):
    path = tmp_path / "aime.json"
    path.write_text(json.dumps(AIME_ROWS))
    data = load_rlvr_dataset(str(path), schema="aime")
    assert data[0] == {"prompt": AIME_ROWS[0]["problem"], "answer": "24", "answer_format": "boxed"}


def test_schema_detection_and_errors(tmp_path):
    assert detect_schema(["question", "answer"], GSM8K_ROWS) == "gsm8k"
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


# --- issue 9, item 2: GSM8K is told by its "#### N" answers; only numbers lose their thousands separators ---------
def test_question_answer_files_are_gsm8k_only_with_hash_answers(tmp_path):
    assert detect_schema(["question", "answer"], GSM8K_ROWS) == "gsm8k"
    pairs = [{"question": "Solve $x+y=-14$, $x-y=44$ for $(x, y)$.", "answer": "(15,-29)"},
             {"question": "How many?", "answer": "1,234"}]
    assert detect_schema(["question", "answer"], pairs) == "math"
    assert detect_schema(["question", "answer"]) == "math"  # no rows to look at: not GSM8K
    data = load_rlvr_dataset(write_jsonl(tmp_path / "qa.jsonl", pairs))
    assert data["answer"] == ["(15,-29)", "1,234"]  # never rewritten (math-verify reads "1,234" as 1234 anyway)
    assert data["prompt"] == [row["question"] for row in pairs]
    assert data["answer_format"] == ["boxed", "boxed"]


def test_aime24_copy_with_a_question_column_is_math():
    """MobileLLM/BudgetThinker evaluation/data/aime24/test.jsonl (rows 1 and 8): id, problem, solution, answer ("025"),
    url and a question column equal to the problem."""
    path = os.path.join(FIXTURES, "aime24_with_question_column.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    assert detect_schema(rows[0].keys(), rows) == "math"
    data = load_rlvr_dataset(path)
    assert data["answer"] == ["204", "025"]  # as written: the leading zero is not stripped
    assert data["prompt"] == [row["problem"] for row in rows]
    assert math_verify_reward([r"\boxed{25}", r"\boxed{205}"], answer=["025", "025"],
                              answer_format=data["answer_format"]) == [1.0, 0.0]


def test_gsm8k_strips_thousands_separators_from_numbers_only(tmp_path):
    rows = [{"question": "q1", "answer": "work\n#### 1,234,567"}, {"question": "q2", "answer": "work\n#### -1,000.5"},
            {"question": "q3", "answer": "work\n#### (15,-29)"}, {"question": "q4", "answer": "work\n#### 12,34"}]
    data = load_rlvr_dataset(write_jsonl(tmp_path / "g.jsonl", rows))
    assert data["answer"] == ["1234567", "-1000.5", "(15,-29)", "12,34"]


def test_gsm8k_schema_on_a_file_without_hash_answers_names_the_field(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "(15,-29)"}])
    with pytest.raises(ValueError, match="GSM8K schema: the 'answer' field has no '#### <answer>' line"):
        load_rlvr_dataset(path, schema="gsm8k")


# --- items 4 and 7: the final-answer rule per row, and DAPO's instruction ------------------------------------------
def dapo_aime_rows():
    """Two rows of the DAPO authors' AIME 2024 file (BytedTsinghua-SIA/DAPO, eval/aime-2024.parquet, the
    DAPO-Math-17k schema), as JSON lines."""
    return os.path.join(FIXTURES, "dapo_aime2024_rows.jsonl")


def test_dapo_template_is_dapos_own():
    with open(dapo_aime_rows()) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        assert format_prompt(row["extra_info"]["raw_problem"], instruction="dapo") == row["prompt"][0]["content"]


@pytest.mark.parametrize("instruction", [None, "default", "dapo"])
def test_dapo_prompts_get_no_second_instruction(instruction):
    data = load_rlvr_dataset(dapo_aime_rows(), chat=True, instruction=instruction)
    assert data["answer"] == ["540", "113"]
    assert data["answer_format"] == ["dapo", "dapo"]
    for prompt in data["prompt"]:
        content = prompt[-1]["content"]
        assert content.startswith(DAPO_PREFIX) and content.endswith(DAPO_SUFFIX)
        assert content.count("Answer:") == 2 and "boxed" not in content
    answers = ["The maximum is $\\boxed{540}$ ... recheck: 541.\nAnswer: 541", "so it is 113.\nAnswer: 113"]
    assert math_verify_reward(answers, answer=data["answer"], answer_format=data["answer_format"]) == [0.0, 1.0]


def test_bare_problems_validate_with_dapos_instruction():
    """An AIME file used as the held-out set of a DAPO run: the training prompt format and the "Answer:" rule."""
    data = load_rlvr_dataset(os.path.join(FIXTURES, "aime24_with_question_column.jsonl"), chat=True, instruction="dapo")
    assert data["answer_format"] == ["dapo", "dapo"]
    with open(os.path.join(FIXTURES, "aime24_with_question_column.jsonl")) as f:
        problem = json.loads(f.readline())["problem"]
    assert data[0]["prompt"][0]["content"] == DAPO_PREFIX + problem + DAPO_SUFFIX


def test_answer_format_by_schema_and_override(tmp_path):
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    assert load_rlvr_dataset(gsm8k, instruction="default")["answer_format"] == ["gsm8k", "gsm8k"]
    assert load_rlvr_dataset(gsm8k, answer_format="boxed")["answer_format"] == ["boxed", "boxed"]
    pairs = write_jsonl(tmp_path / "pa.jsonl", [{"prompt": "1+1?", "answer": "2"}])
    assert load_rlvr_dataset(pairs)["answer_format"] == ["auto"]
    with pytest.raises(ValueError, match="Unknown answer_format 'latex'"):
        load_rlvr_dataset(pairs, answer_format="latex")


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("blank.jsonl", "\n \n"), ("empty.json", "[]"),
                                           ("empty.csv", ""), ("header_only.csv", "question,answer\n")])
def test_an_empty_file_is_an_error_naming_it(tmp_path, name, content):
    """An empty .jsonl gave a bare StopIteration from datasets' JSON reader; an empty .csv or '[]' another
    message that named no file."""
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=f"Dataset file '{path}' is empty: it has no rows"):
        load_rlvr_dataset(str(path))


def test_an_empty_parquet_file_is_an_error_naming_it(tmp_path):
    path = str(tmp_path / "empty.parquet")
    Dataset.from_dict({"problem": [], "answer": []}).to_parquet(path)
    with pytest.raises(ValueError, match=f"Dataset file '{path}' is empty"):
        load_rlvr_dataset(path)


def test_a_file_that_is_not_what_its_name_says_is_an_error_naming_it(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(ValueError, match=f"Dataset file '{path}' cannot be read as .parquet"):
        load_rlvr_dataset(str(path))


def test_nan_and_none_answers_are_no_answer(tmp_path, caplog):
    """A JSON NaN answer became the gold string 'nan' (and \\boxed{nan} scored 1.0); 'None' the same. They are
    None now: the rewards do not apply to those rows, and loading says how many there are."""
    rows = [{"problem": "p1", "answer": float("nan")}, {"problem": "p2", "answer": "None"},
            {"problem": "p3", "answer": 5}, {"problem": "p4", "answer": "nan"}]
    path = tmp_path / "nan.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))  # json writes the first answer as NaN
    assert "NaN" in path.read_text()
    with caplog.at_level("WARNING", logger="armor_trl.data.datasets"):
        data = load_rlvr_dataset(str(path))
    assert data["answer"] == [None, None, "5", None]
    assert "3 of 4 rows" in caplog.text and str(path) in caplog.text
    completions = [r"\boxed{nan}", r"\boxed{None}", r"\boxed{5}", r"n\cdot a\cdot n"]
    assert math_verify_reward(completions, answer=data["answer"]) == [None, None, 1.0, None]


def test_a_file_without_any_answer_is_refused(tmp_path):
    rows = [{"prompt": "1+1?", "answer": "None"}, {"prompt": "2+2?", "answer": None}]
    path = write_jsonl(tmp_path / "none.jsonl", rows)
    with pytest.raises(ValueError, match="No row of .*none.jsonl' has a ground-truth answer"):
        load_rlvr_dataset(path)


def test_raw_gsm8k_answers_as_gold_match_what_the_gsm8k_schema_reads(tmp_path):
    """The GSM8K schema and a raw GSM8K solution passed as the gold answer read the same '#### N' line."""
    rows = [{"prompt": row["question"], "answer": row["answer"]} for row in GSM8K_ROWS]
    raw = write_jsonl(tmp_path / "raw.jsonl", rows)
    data = load_rlvr_dataset(raw)  # prompt/answer: the answers stay the full worked solutions
    assert data["answer"] == [row["answer"] for row in GSM8K_ROWS]
    schema = load_rlvr_dataset(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS))
    assert [rewards.gold_answer(answer) for answer in data["answer"]] == schema["answer"] == ["72", "1234"]
    assert math_verify_reward([r"\boxed{72}", r"\boxed{1234}"], answer=data["answer"]) == [1.0, 1.0]


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


def test_arithmetic_train_filter_restricts_training_problems_only():
    from armor_trl.data.datasets import has_carry

    assert not has_carry(12, 35) and has_carry(18, 35) and has_carry(52, 61) and not has_carry(0, 0)
    _, plain_held_out = arithmetic_splits(16, 40, seed=1)
    train, held_out = arithmetic_splits(64, 40, seed=1, train_filter="no_carry")
    assert held_out["prompt"] == plain_held_out["prompt"]  # never filtered
    assert not set(train["prompt"]) & set(held_out["prompt"]) and len(set(train["prompt"])) == 64
    for prompt, answer in zip(train["prompt"], train["answer"]):
        a, b = map(int, prompt.rstrip("=").split("+"))
        assert not has_carry(a, b) and a + b == int(answer) < 100
    assert any(has_carry(*map(int, p.rstrip("=").split("+"))) for p in held_out["prompt"])
    units, _ = arithmetic_splits(64, 40, seed=1, train_filter="no_units_carry")
    pairs = [tuple(map(int, p.rstrip("=").split("+"))) for p in units["prompt"]]
    assert all(a % 10 + b % 10 < 10 for a, b in pairs) and any(a + b >= 100 for a, b in pairs)
    with pytest.raises(ValueError, match="arithmetic_train_filter"):
        arithmetic_splits(4, 4, train_filter="even")
    with pytest.raises(ValueError, match="distinct"):  # 1-digit pairs without a carry: 55
        arithmetic_problems(56, digits=1, keep=lambda a, b: not has_carry(a, b))


def test_arithmetic_train_filter_from_a_recipe(tiny_model_path):
    from armor_trl.app.recipe.build import train_datasets
    from armor_trl.app.recipe.parsing import parse_train_args

    config = Path(__file__).resolve().parent.parent / "configs" / "collapse_testbed.yaml"
    script_args, _, _, _ = parse_train_args(["--config", str(config), "--model_name_or_path", tiny_model_path,
                                             "--arithmetic_train_filter", "no_carry"])
    train, held_out = train_datasets(script_args)
    assert len(train) == 128 and len(held_out) == 1000
    assert all(int(answer) < 100 for answer in train["answer"])


# --- the carry-mix variant (arithmetic_train_carry_share) --------------------------------------------------------
def test_carry_share_mixes_that_many_carry_problems_from_fixed_pools():
    from armor_trl.data.datasets import arithmetic_prompt_has_carry, arithmetic_splits

    plain, held_out = arithmetic_splits(64, 100, seed=1, digits=3, train_filter="no_carry", eval_filter="carry")
    sets = {}
    for share in (0.0, 0.05, 0.2, 0.3):
        train, mixed_held_out = arithmetic_splits(64, 100, seed=1, digits=3, train_filter="no_carry",
                                                  eval_filter="carry", train_carry_share=share)
        assert mixed_held_out["prompt"] == held_out["prompt"]  # the held-out set does not move
        carry = [p for p in train["prompt"] if arithmetic_prompt_has_carry(p)]
        assert len(train) == 64 and len(set(train["prompt"])) == 64
        assert len(carry) == round(share * 64)
        assert not set(train["prompt"]) & set(held_out["prompt"])
        sets[share] = (set(carry), set(train["prompt"]) - set(carry))
    assert sets[0.0][1] == set(plain["prompt"])  # share 0 is the plain no-carry training set
    # a larger share extends a smaller one's carry problems and keeps a prefix of its no-carry ones
    assert sets[0.05][0] <= sets[0.2][0] <= sets[0.3][0]
    assert sets[0.3][1] <= sets[0.2][1] <= sets[0.05][1]
    # interleaved: any prefix keeps about the share
    train, _ = arithmetic_splits(64, 100, seed=1, digits=3, train_filter="no_carry", eval_filter="carry",
                                 train_carry_share=0.25)
    assert sum(arithmetic_prompt_has_carry(p) for p in train["prompt"][:32]) == 8


def test_carry_share_rejects_bad_values():
    from armor_trl.data.datasets import arithmetic_splits

    with pytest.raises(ValueError, match=r"arithmetic_train_carry_share must lie in \[0, 1\]"):
        arithmetic_splits(64, 10, digits=3, train_filter="no_carry", train_carry_share=1.5)
    with pytest.raises(ValueError, match="not 'carry'"):
        arithmetic_splits(64, 10, digits=3, train_filter="carry", train_carry_share=0.2)


def test_train_carry_validation_source_holds_the_training_carry_problems():
    from armor_trl.data.datasets import arithmetic_prompt_has_carry
    from armor_trl.app.recipe.build import load_datasets
    from armor_trl.app.recipe.fields import DataArguments

    args = DataArguments(arithmetic_digits=3, arithmetic_train_size=64,
                         arithmetic_eval_size=20, arithmetic_train_filter="no_carry", arithmetic_eval_filter="carry",
                         arithmetic_train_carry_share=0.2)
    train, _ = load_datasets(args, "arithmetic", None, "train", None)
    _, carry = load_datasets(args, None, "arithmetic:train_carry", "train", None)
    assert set(carry["prompt"]) == {p for p in train["prompt"] if arithmetic_prompt_has_carry(p)}
    assert len(carry) == 13
    args.arithmetic_train_carry_share = 0.0
    with pytest.raises(ValueError, match="no training problem needs a carry"):
        load_datasets(args, None, "arithmetic:train_carry", "train", None)
