"""RLVR datasets as ``prompt`` + ``answer`` + ``answer_format`` columns, and the synthetic arithmetic task of the demo.

:func:`load_rlvr_dataset` maps a dataset to the columns the trainers and :mod:`armor_trl.rewards` use:
``prompt`` (a string, or chat messages with ``chat=True``), ``answer`` (the ground truth as a string) and
``answer_format`` (how ``math_verify`` finds the final answer of a completion: ``gsm8k``, ``boxed`` or
``dapo``; see docs/verifiers.md). It loads by registry name (``gsm8k``, ``math``, ``math500``, ``dapo``,
``aime24``, ``aime25``: hub ids in :data:`DATASETS`, needs the hub), by any hub id, or from a local
``.json``/``.jsonl``/``.parquet``/``.csv`` file or folder of the same schema. The schema (:data:`SCHEMAS`) is
the registry's, given, or detected from the column names and first rows.
"""

from __future__ import annotations

import logging
import os
import random
import re
from dataclasses import dataclass

from datasets import Dataset, Features, Value, load_dataset

from armor_trl.rewards import gsm8k_answer, is_no_answer
from armor_trl.rewards.modes import has_carry

logger = logging.getLogger(__name__)

# Instruction appended to math problems when ``instruction="default"``.
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# DAPO-Math-17k's instruction around each problem (``instruction="dapo"``): the answer goes on an "Answer:" line.
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
_DAPO_INSTRUCTED = re.compile(r'"Answer:"|of the form Answer:')


def _gsm8k(row: dict) -> dict:
    """openai/gsm8k: ``question``; ``answer`` is a worked solution ending in ``#### 72``."""
    solution = str(row["answer"])
    if "####" not in solution:
        raise ValueError(f"GSM8K schema: the 'answer' field has no '#### <answer>' line: {solution[-80:]!r}. "
                         "Is this a GSM8K file? Pass schema='math' (dataset_schema) for other question/answer files.")
    # "1,234" -> "1234"; anything else is left as written (the same rule reads a raw solution given as a gold)
    return {"problem": row["question"], "answer": gsm8k_answer(solution)}


def _answer_text(value) -> str | None:
    """A ground truth as text; None where it is "no answer" (missing, NaN, "nan", "None": never a string to
    match, see :func:`armor_trl.rewards.is_no_answer`)."""
    if is_no_answer(value):
        return None
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)  # 72.0 -> "72"


def _math(row: dict) -> dict:
    """MATH / MATH-500 / AIME: ``problem`` (else ``question``) and ``answer``, else the full ``solution``
    (math-verify reads its \\boxed{})."""
    answer = _answer_text(row.get("answer"))
    if answer is None:
        answer = _answer_text(row.get("solution"))
    problem = row["problem"] if row.get("problem") is not None else row.get("question")
    return {"problem": problem, "answer": answer}


def _dapo(row: dict) -> dict:
    """DAPO-Math-17k: ``prompt`` is a chat (one user message holding its own instruction);
    the ground truth is ``reward_model["ground_truth"]``."""
    prompt = row["prompt"]
    if not isinstance(prompt, str):
        prompt = next((m["content"] for m in prompt if m["role"] == "user"), prompt[-1]["content"])
    return {"problem": prompt, "answer": _answer_text(row["reward_model"]["ground_truth"])}


def _prompt_answer(row: dict) -> dict:
    """Already in this project's format: ``prompt`` (string) and ``answer``."""
    return {"problem": row["prompt"], "answer": _answer_text(row["answer"])}


IMAGE_COLUMNS = ("image", "images")  # a vision-language dataset's pictures, kept as they are (TRL reads these names)
SCHEMAS = {"gsm8k": _gsm8k, "math": _math, "aime": _math, "dapo": _dapo, "prompt_answer": _prompt_answer}
# The final-answer rule of math_verify (armor_trl.rewards) for each schema's own answers.
ANSWER_FORMATS = {"gsm8k": "gsm8k", "math": "boxed", "aime": "boxed", "dapo": "dapo", "prompt_answer": "auto"}


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


def detect_schema(columns, rows=()) -> str:
    """The schema of a dataset with ``columns``, whose first ``rows`` (dicts) tell GSM8K apart.

    DAPO first (it also has a ``prompt`` column); ``problem`` + ``answer``/``solution`` is MATH/AIME even when
    a ``question`` column is there too (AIME 2024 copies); ``question`` + ``answer`` is GSM8K only when the
    answers are worked solutions ending in ``#### N``, else MATH-like with ``question`` as the problem.
    """
    columns = set(columns)
    if {"prompt", "reward_model"} <= columns:
        return "dapo"
    if "problem" in columns and columns & {"answer", "solution"}:
        return "math"
    if {"question", "answer"} <= columns:
        rows = list(rows)
        return "gsm8k" if rows and all("####" in str(row["answer"]) for row in rows) else "math"
    if {"prompt", "answer"} <= columns:
        return "prompt_answer"
    raise ValueError(
        f"Cannot tell the schema of a dataset with columns {sorted(columns)}: expected question/answer (GSM8K), "
        "problem/answer or problem/solution (MATH, AIME), prompt/reward_model (DAPO-Math-17k) or prompt/answer."
    )


def has_dapo_instruction(problem: str) -> bool:
    """Whether a problem already carries DAPO's "Answer:" instruction (DAPO-Math-17k's prompts do)."""
    return bool(_DAPO_INSTRUCTED.search(problem))


def format_prompt(problem: str, chat: bool = False, system_prompt: str | None = None, instruction: str | None = None):
    """The prompt for one problem, with ``chat=True`` a message list with an optional system message.

    ``instruction``: ``"default"`` appends :data:`BOXED_INSTRUCTION`, ``"dapo"`` wraps the problem in DAPO-Math-17k's
    template (:data:`DAPO_PREFIX`, :data:`DAPO_SUFFIX`), other text is appended as is. A problem that already carries
    DAPO's instruction gets neither ``"default"`` nor ``"dapo"``.
    """
    if instruction in ("default", "dapo") and has_dapo_instruction(problem):
        pass
    elif instruction == "dapo":
        problem = f"{DAPO_PREFIX}{problem}{DAPO_SUFFIX}"
    elif instruction:
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
        if _is_blank(source):
            raise ValueError(f"Dataset file {source!r} is empty: it has no rows.")
        try:
            data = load_dataset(builder, data_files=source, split="train")
        except Exception as error:  # datasets' own errors (a bare StopIteration for some) do not name the file
            cause = error.__cause__ or error
            if "corresponds to no data" in str(cause):  # what datasets says of a file without rows
                raise ValueError(f"Dataset file {source!r} is empty: it has no rows.") from error
            raise ValueError(f"Dataset file {source!r} cannot be read as {os.path.splitext(source)[1]}: "
                             f"{type(cause).__name__}: {cause}".rstrip(": ")) from error
        if len(data) == 0:
            raise ValueError(f"Dataset file {source!r} is empty: it has no rows.")
        return data, None
    return load_dataset(source, name=name, split=split or "train"), None


def _is_blank(path: str) -> bool:
    """Whether a file holds nothing but whitespace (read only as far as the first other byte)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def load_rlvr_dataset(
    source: str,
    split: str | None = None,
    name: str | None = None,
    schema: str | None = None,
    chat: bool = False,
    system_prompt: str | None = None,
    instruction: str | None = None,
    limit: int | None = None,
    answer_format: str | None = None,
) -> Dataset:
    """Load ``source`` (registry name, hub id, local file or folder) as ``prompt``, ``answer``, ``answer_format``.

    Args:
        source: a key of :data:`DATASETS`, a hub id, or a local path (``.json``/``.jsonl``/``.parquet``/``.csv``).
        split: split to load (default: the registry's, else ``train``; a local file is one split).
        name: dataset configuration name (e.g. ``main`` for GSM8K).
        schema: one of :data:`SCHEMAS`; ``None`` = the registry's or detected from the columns.
        chat, system_prompt, instruction: how prompts are written (see :func:`format_prompt`).
        limit: keep only the first ``limit`` rows.
        answer_format: the final-answer rule math_verify applies to completions (``boxed``, ``gsm8k``, ``dapo``,
            ``auto``). Default: ``dapo`` for prompts carrying DAPO's instruction (``instruction="dapo"``, DAPO-Math-17k),
            else the schema's (:data:`ANSWER_FORMATS`).
    Other columns are dropped, except that a dataset's own ``solution`` is kept, and its ``image`` / ``images``
    (TRL puts them into chat prompts for a vision-language model; they need ``chat=True``). Answers that are missing, NaN (a
    JSON ``NaN``), ``"nan"`` or ``"None"`` load as None, "no answer" (the rewards do not apply to those rows), with a
    warning that counts them; a dataset with no answer at all, and an empty or unreadable local file, are a
    ``ValueError`` naming the source.
    """
    if source == "arithmetic":
        raise ValueError("Use arithmetic_dataset() (or dataset_name 'arithmetic' in a recipe) for the synthetic task.")
    raw, registry_schema = _load_raw(source, split, name)
    schema = schema or registry_schema or detect_schema(raw.column_names, raw.select(range(min(5, len(raw)))))
    if schema not in SCHEMAS:
        raise ValueError(f"Unknown schema {schema!r}: expected one of {sorted(SCHEMAS)}.")
    if answer_format not in (None, "auto", "boxed", "gsm8k", "dapo"):
        raise ValueError(f"Unknown answer_format {answer_format!r}: expected auto, boxed, gsm8k or dapo.")
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    adapter = SCHEMAS[schema]

    def convert(row):
        mapped = adapter(row)
        dapo = instruction == "dapo" or has_dapo_instruction(mapped["problem"])
        return {"prompt": format_prompt(mapped["problem"], chat, system_prompt, instruction), "answer": mapped["answer"],
                "answer_format": answer_format or ("dapo" if dapo else ANSWER_FORMATS[schema])}

    keep = [c for c in ("solution", *IMAGE_COLUMNS) if c in raw.column_names]
    text = Value("string")
    features = Features({"prompt": [{"role": text, "content": text}] if chat else text, "answer": text,
                         "answer_format": text, **{c: raw.features[c] for c in keep}})
    data = raw.map(convert, remove_columns=[c for c in raw.column_names if c not in keep], features=features)
    missing = sum(answer is None for answer in data["answer"])
    if missing == len(data) and len(data):
        raise ValueError(f"No row of {source!r} has a ground-truth answer (every one is missing, NaN, 'nan' or "
                         "'None'): the rewards cannot judge any completion. Check the answer column.")
    if missing:
        logger.warning(f"{missing} of {len(data)} rows of {source!r} have no ground-truth answer (missing, NaN, 'nan' "
                       "or 'None'); the rewards do not apply to their completions (None, counted by "
                       "armor_trl.rewards.missing_gold_answers).")
    return data


# --- the synthetic task ------------------------------------------------------------------------------------------
# Restrictions of the training problems (``arithmetic_train_filter``) or of the held-out ones
# (``arithmetic_eval_filter``); by default neither set is filtered.
# "no_carry" gives training a shortcut the held-out set punishes: every training answer is the column-wise digit
# sum, so a policy that stops carrying loses no training reward, while most held-out problems need a carry.
# "no_units_carry" is a milder one: only the ones column never carries (the tens column may, into a hundreds digit).
# "carry" (some column carries) is for the held-out set (``arithmetic_eval_filter``): the mode testbed's held-out
# problems, which only a method that carries gets right.
ARITHMETIC_FILTERS = {"no_carry": lambda a, b: not has_carry(a, b),
                      "no_units_carry": lambda a, b: a % 10 + b % 10 < 10,
                      "carry": has_carry}


def arithmetic_problems(n: int, seed: int | str = 0, digits: int = 2, exclude: set[str] | None = None,
                        keep=None) -> list[tuple[str, str]]:
    """``n`` distinct problems ``"a+b="`` → ``"a+b"`` with ``digits``-digit operands, deterministic for ``seed``;
    only pairs for which ``keep(a, b)`` is true when ``keep`` is given."""
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    pool = (high - low + 1) ** 2
    if keep is not None and pool <= 10**6:  # counting the kept pairs of 4+ digits would take minutes
        pool = sum(keep(a, b) for a in range(low, high + 1) for b in range(low, high + 1))
    def drawable(prompt: str) -> bool:  # an excluded problem takes a place in the pool only if it could be drawn
        match = re.fullmatch(r"(\d+)\+(\d+)=", prompt)
        if match is None:
            return False
        a, b = int(match.group(1)), int(match.group(2))
        return low <= a <= high and low <= b <= high and (keep is None or keep(a, b))

    if n > pool - sum(map(drawable, exclude or ())):
        raise ValueError(f"cannot draw {n} distinct {digits}-digit problems")
    seen, problems = set(exclude or ()), []
    while len(problems) < n:
        a, b = rng.randint(low, high), rng.randint(low, high)
        prompt = f"{a}+{b}="
        if prompt not in seen and (keep is None or keep(a, b)):
            seen.add(prompt)
            problems.append((prompt, str(a + b)))
    return problems


def arithmetic_splits(
    train_size: int, eval_size: int, seed: int = 0, digits: int = 2, chat: bool = False, system_prompt: str | None = None,
    train_filter: str | None = None, eval_filter: str | None = None, train_carry_share: float | None = None,
    eval_digits: int | None = None,
) -> tuple[Dataset, Dataset]:
    """Disjoint train and held-out sets of the synthetic addition task, as ``prompt``/``answer`` datasets.

    The held-out set depends only on (``eval_size``, ``seed``, ``digits``, ``eval_filter``): changing the training
    set's size keeps the same held-out problems (and a larger training set extends a smaller one). ``train_filter``
    and ``eval_filter`` (keys of :data:`ARITHMETIC_FILTERS`) restrict the training and the held-out problems;
    ``eval_digits`` (default ``digits``) sets the held-out problems' digits per operand.
    """
    for name, value in (("arithmetic_train_filter", train_filter), ("arithmetic_eval_filter", eval_filter)):
        if value is not None and value not in ARITHMETIC_FILTERS:
            raise ValueError(f"Unknown {name} {value!r}: expected one of {sorted(ARITHMETIC_FILTERS)}.")
    held_out = arithmetic_problems(eval_size, seed, digits if eval_digits is None else eval_digits,
                                   keep=ARITHMETIC_FILTERS.get(eval_filter))
    train = arithmetic_train_problems(train_size, seed, digits, held_out, train_filter, train_carry_share)

    def to_dataset(rows):
        return Dataset.from_dict(
            {"prompt": [format_prompt(p, chat, system_prompt) for p, _ in rows], "answer": [a for _, a in rows]}
        )

    return to_dataset(train), to_dataset(held_out)


def arithmetic_train_problems(train_size: int, seed: int, digits: int, held_out, train_filter: str | None = None,
                              carry_share: float | None = None) -> list[tuple[str, str]]:
    """The training problems of :func:`arithmetic_splits` (disjoint from ``held_out``).

    With ``carry_share`` (the mode testbed's carry-mix variant) round(share × size) of them need a carry and the
    rest pass ``train_filter``; each part is the prefix of its own fixed pool of ``train_size`` problems
    (:func:`arithmetic_carry_mix_pools`), so every share draws from the same problems and a warm-up that reserves
    both pools serves every share."""
    if carry_share is None:
        return arithmetic_problems(train_size, f"{seed}-train", digits, exclude={p for p, _ in held_out},
                                   keep=ARITHMETIC_FILTERS.get(train_filter))
    if not 0.0 <= carry_share <= 1.0:
        raise ValueError(f"arithmetic_train_carry_share must lie in [0, 1], got {carry_share!r}.")
    if train_filter == "carry":
        raise ValueError("arithmetic_train_carry_share mixes carry problems into training problems of another kind: "
                         "give arithmetic_train_filter 'no_carry' or 'no_units_carry' (or none), not 'carry'.")
    rest, carry = arithmetic_carry_mix_pools(train_size, seed, digits, held_out, train_filter)
    n_carry = round(carry_share * train_size)
    # interleaved so that any prefix (max_train_samples) keeps about the share
    mixed = sorted([((i + 0.5) / n_carry, 0, row) for i, row in enumerate(carry[:n_carry])]
                   + [((i + 0.5) / (train_size - n_carry), 1, row) for i, row in enumerate(rest[: train_size - n_carry])])
    return [row for *_, row in mixed]


def arithmetic_prompt_has_carry(prompt) -> bool:
    """Whether the addition problem ``a+b=`` in a prompt (text or chat messages, as :func:`format_prompt` writes it)
    needs a carry."""
    text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
    match = re.search(r"(\d+)\+(\d+)=", text)
    if match is None:
        raise ValueError(f"not an addition prompt 'a+b=': {text!r}")
    return has_carry(int(match.group(1)), int(match.group(2)))


def arithmetic_carry_mix_pools(train_size: int, seed: int, digits: int, held_out, train_filter: str | None = None):
    """(problems passing ``train_filter``, problems with a carry): ``train_size`` each, disjoint from each other and
    from ``held_out``, deterministic for ``seed``."""
    exclude = {p for p, _ in held_out}
    rest = arithmetic_problems(train_size, f"{seed}-train", digits, exclude=exclude,
                               keep=ARITHMETIC_FILTERS.get(train_filter))
    carry = arithmetic_problems(train_size, f"{seed}-train-carry", digits, exclude=exclude | {p for p, _ in rest},
                                keep=has_carry)
    return rest, carry
