"""RLVR datasets as ``prompt`` + ``answer`` columns, and the synthetic arithmetic task of the demo.

:func:`load_rlvr_dataset` maps a dataset to the two columns the trainers and :mod:`armor_trl.rewards` use:
``prompt`` (a string, or chat messages with ``chat=True``) and ``answer`` (the ground truth as a string).
It loads by registry name (``gsm8k``, ``math``, ``math500``, ``dapo``, ``aime24``, ``aime25``: hub ids in
:data:`DATASETS`, needs the hub), by any hub id, or from a local ``.json``/``.jsonl``/``.parquet``/``.csv``
file or folder of the same schema. The schema (:data:`SCHEMAS`) is the registry's, given, or detected from
the column names.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from datasets import Dataset, Features, Value, load_dataset

# Instruction appended to math problems when ``instruction="default"``.
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def _gsm8k(row: dict) -> dict:
    """openai/gsm8k: ``question``; ``answer`` is a worked solution ending in ``#### 72``."""
    return {"problem": row["question"], "answer": row["answer"].split("####")[-1].strip().replace(",", "")}


def _math(row: dict) -> dict:
    """MATH / MATH-500 / AIME: ``problem`` and ``answer``, else the full ``solution`` (math-verify reads its \\boxed{})."""
    answer = row.get("answer")
    if answer is None or str(answer).strip() == "":
        answer = row.get("solution")
    return {"problem": row["problem"], "answer": None if answer is None else str(answer)}


def _dapo(row: dict) -> dict:
    """DAPO-Math-17k: ``prompt`` is a chat (one user message holding its own instruction);
    the ground truth is ``reward_model["ground_truth"]``."""
    prompt = row["prompt"]
    if not isinstance(prompt, str):
        prompt = next((m["content"] for m in prompt if m["role"] == "user"), prompt[-1]["content"])
    return {"problem": prompt, "answer": str(row["reward_model"]["ground_truth"])}


def _prompt_answer(row: dict) -> dict:
    """Already in this project's format: ``prompt`` (string) and ``answer``."""
    return {"problem": row["prompt"], "answer": None if row["answer"] is None else str(row["answer"])}


SCHEMAS = {"gsm8k": _gsm8k, "math": _math, "aime": _math, "dapo": _dapo, "prompt_answer": _prompt_answer}


@dataclass(frozen=True)
class HubDataset:
    """Where a known dataset lives on the hub and which schema it has."""

    path: str
    schema: str
    name: str | None = None
    split: str = "train"


DATASETS = {
    "gsm8k": HubDataset("openai/gsm8k", "gsm8k", name="main", split="train"),
    "math": HubDataset("DigitalLearningGmbH/MATH-lighteval", "math", split="train"),
    "math500": HubDataset("HuggingFaceH4/MATH-500", "math", split="test"),
    "dapo": HubDataset("BytedTsinghua-SIA/DAPO-Math-17k", "dapo", split="train"),
    "aime24": HubDataset("HuggingFaceH4/aime_2024", "aime", split="train"),
    "aime25": HubDataset("math-ai/aime25", "aime", split="test"),
}
_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def detect_schema(columns) -> str:
    """The schema whose columns ``columns`` has (DAPO first: it also has a ``prompt`` column)."""
    columns = set(columns)
    if {"prompt", "reward_model"} <= columns:
        return "dapo"
    if {"question", "answer"} <= columns:
        return "gsm8k"
    if "problem" in columns and columns & {"answer", "solution"}:
        return "math"
    if {"prompt", "answer"} <= columns:
        return "prompt_answer"
    raise ValueError(
        f"Cannot tell the schema of a dataset with columns {sorted(columns)}: expected question/answer (GSM8K), "
        "problem/answer or problem/solution (MATH, AIME), prompt/reward_model (DAPO-Math-17k) or prompt/answer."
    )


def format_prompt(problem: str, chat: bool = False, system_prompt: str | None = None, instruction: str | None = None):
    """The prompt for one problem: ``instruction`` appended (``"default"`` = :data:`BOXED_INSTRUCTION`);
    with ``chat=True`` a message list with an optional system message."""
    if instruction:
        problem = f"{problem}\n\n{BOXED_INSTRUCTION if instruction == 'default' else instruction}"
    if not chat:
        return problem if system_prompt is None else f"{system_prompt}\n\n{problem}"
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": problem}]


def _load_raw(source: str, split: str | None, name: str | None) -> tuple[Dataset, str | None]:
    if source in DATASETS:
        entry = DATASETS[source]
        return load_dataset(entry.path, name=name or entry.name, split=split or entry.split), entry.schema
    if os.path.isfile(source):
        builder = _LOCAL_BUILDERS.get(os.path.splitext(source)[1].lower())
        if builder is None:
            raise ValueError(f"Unsupported file type {source!r}: use one of {sorted(_LOCAL_BUILDERS)}.")
        return load_dataset(builder, data_files=source, split="train"), None
    return load_dataset(source, name=name, split=split or "train"), None


def load_rlvr_dataset(
    source: str,
    split: str | None = None,
    name: str | None = None,
    schema: str | None = None,
    chat: bool = False,
    system_prompt: str | None = None,
    instruction: str | None = None,
    limit: int | None = None,
) -> Dataset:
    """Load ``source`` (registry name, hub id, local file or folder) as a dataset with ``prompt`` and ``answer``.

    Args:
        source: a key of :data:`DATASETS`, a hub id, or a local path (``.json``/``.jsonl``/``.parquet``/``.csv``).
        split: split to load (default: the registry's, else ``train``; a local file is one split).
        name: dataset configuration name (e.g. ``main`` for GSM8K).
        schema: one of :data:`SCHEMAS`; ``None`` = the registry's or detected from the columns.
        chat, system_prompt, instruction: how prompts are written (see :func:`format_prompt`).
        limit: keep only the first ``limit`` rows.
    Other columns are dropped, except that a dataset's own ``solution`` is kept.
    """
    if source == "arithmetic":
        raise ValueError("Use arithmetic_dataset() (or dataset_name 'arithmetic' in a recipe) for the synthetic task.")
    raw, registry_schema = _load_raw(source, split, name)
    schema = schema or registry_schema or detect_schema(raw.column_names)
    if schema not in SCHEMAS:
        raise ValueError(f"Unknown schema {schema!r}: expected one of {sorted(SCHEMAS)}.")
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    adapter = SCHEMAS[schema]

    def convert(row):
        mapped = adapter(row)
        return {"prompt": format_prompt(mapped["problem"], chat, system_prompt, instruction), "answer": mapped["answer"]}

    keep = [c for c in ("solution",) if c in raw.column_names]
    text = Value("string")
    features = Features({"prompt": [{"role": text, "content": text}] if chat else text, "answer": text,
                         **{c: raw.features[c] for c in keep}})
    return raw.map(convert, remove_columns=[c for c in raw.column_names if c not in keep], features=features)


# --- the synthetic task ------------------------------------------------------------------------------------------
def arithmetic_problems(n: int, seed: int | str = 0, digits: int = 2, exclude: set[str] | None = None) -> list[tuple[str, str]]:
    """``n`` distinct problems ``"a+b="`` → ``"a+b"`` with ``digits``-digit operands, deterministic for ``seed``."""
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    if n > (high - low + 1) ** 2 - len(exclude or ()):
        raise ValueError(f"cannot draw {n} distinct {digits}-digit problems")
    seen, problems = set(exclude or ()), []
    while len(problems) < n:
        a, b = rng.randint(low, high), rng.randint(low, high)
        prompt = f"{a}+{b}="
        if prompt not in seen:
            seen.add(prompt)
            problems.append((prompt, str(a + b)))
    return problems


def arithmetic_splits(
    train_size: int, eval_size: int, seed: int = 0, digits: int = 2, chat: bool = False, system_prompt: str | None = None
) -> tuple[Dataset, Dataset]:
    """Disjoint train and held-out sets of the synthetic addition task, as ``prompt``/``answer`` datasets.

    The held-out set depends only on (``eval_size``, ``seed``, ``digits``): changing the training set's size
    keeps the same held-out problems (and a larger training set extends a smaller one).
    """
    held_out = arithmetic_problems(eval_size, seed, digits)
    train = arithmetic_problems(train_size, f"{seed}-train", digits, exclude={p for p, _ in held_out})

    def to_dataset(rows):
        return Dataset.from_dict(
            {"prompt": [format_prompt(p, chat, system_prompt) for p, _ in rows], "answer": [a for _, a in rows]}
        )

    return to_dataset(train), to_dataset(held_out)
