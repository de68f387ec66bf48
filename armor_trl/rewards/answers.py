r"""Reading answers: the text of a completion (:func:`completion_text`), the gold answer of a row
(:func:`gold_answer`), the final answer of a completion under the row's ``answer_format`` (:func:`final_answer`), and
math-verify's judgement of the two (:func:`judge`, which the worker processes of :mod:`armor_trl.rewards.verifier`
run). It imports only the standard library; math-verify is imported by :func:`judge` when it runs.

Gold answers (:func:`gold_answer`): a missing one, a NaN (a JSON ``NaN`` read by pandas or Arrow), or the strings
``"nan"``, ``"None"`` and ``"<NA>"`` (what ``str()`` makes of those) are "no answer": the reward does not apply
(``None``) and :func:`armor_trl.rewards.missing_gold_answers` counts it; they are never a string to match. A gold
answer holding ``####`` is a GSM8K worked solution (the raw ``answer`` column of ``openai/gsm8k``): its ``#### N``
line is the answer, read as :mod:`armor_trl.data.datasets` reads it.

Final-answer rules of :func:`armor_trl.rewards.math_verify_reward` (docs/verifiers.md has the full table). The rule
of a row is its ``answer_format`` column, which :func:`armor_trl.data.datasets.load_rlvr_dataset` writes per schema;
without the column the rule is ``auto``:

* ``boxed`` (MATH, AIME): the last ``\boxed{...}``; without one, math-verify's own extraction of the text.
* ``gsm8k``: the last ``#### ...`` line; without one, as ``boxed``.
* ``dapo`` (DAPO-Math-17k's "Answer: $Answer" instruction): the last ``Answer: ...``; without one the
  completion scores 0, as DAPO's own checker does.
* ``auto``: whichever of those markers comes last; without any, math-verify's own extraction.

Gold answers are read as LaTeX: wrapped in ``$...$`` unless they already hold ``$`` or ``\boxed`` (a full
solution works: its boxed answer is used).
"""

from __future__ import annotations

import functools
import math
import re

ANSWER_FORMATS = ("auto", "boxed", "gsm8k", "dapo")

_THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?")
_NO_ANSWER = frozenset({"", "nan", "none", "<na>"})  # lower-cased: what str() makes of None, NaN and pandas.NA


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # multimodal content parts: [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text") or "" if isinstance(part, dict) else _content_text(part) for part in content)
    try:
        return str(content)
    except Exception:  # e.g. an int past Python's integer-string limit: no text
        return ""


def completion_text(completion) -> str:
    """The text of a completion: the string itself, or the content of the last message of a chat completion.

    Total: ``None``, an empty message list, a message without content or multimodal content parts give their
    text (or ``""``), never an error.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        return completion_text(completion[-1]) if completion else ""
    return _content_text(completion)


def gsm8k_answer(solution: str) -> str | None:
    """The answer of a GSM8K worked solution: what follows its last ``####``, with a thousands separator
    dropped (``1,234`` → ``1234``; anything else as written); None when nothing follows.

    :mod:`armor_trl.data.datasets` reads the ``answer`` column of GSM8K with it, and :func:`gold_answer` a raw GSM8K
    solution passed as the gold answer.
    """
    final = solution.rsplit("####", 1)[-1].strip()
    if _THOUSANDS.fullmatch(final):
        final = final.replace(",", "")
    return final or None


def is_no_answer(value) -> bool:
    """Whether a gold answer is "no answer": None, a NaN, or a string that is empty, ``nan``, ``None`` or
    ``<NA>`` (any case, surrounding whitespace aside)."""
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # an object whose str() fails cannot be a gold answer
        return True
    return len(text) <= 16 and text.strip().lower() in _NO_ANSWER


def gold_answer(truth) -> str | None:
    """A ground-truth value as the gold answer the verifiers compare with, or None for "no answer".

    None, NaN, ``"nan"``, ``"None"``, ``"<NA>"`` and empty strings are no answer (:func:`is_no_answer`); a float
    that is a whole number is written without ``.0`` (a column of integers with a missing value becomes floats);
    a text holding ``####`` is a GSM8K worked solution and its ``#### N`` line is the answer
    (:func:`gsm8k_answer`); anything else is its text.
    """
    if is_no_answer(truth):
        return None
    if isinstance(truth, float) and truth.is_integer():
        return str(int(truth))
    text = str(truth).strip()
    if "####" in text:
        return gsm8k_answer(text)
    return text


# --- reading final answers -------------------------------------------------------------------------------------
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_UNESCAPED_PERCENT = re.compile(r"(?<!\\)%")
_GSM8K_LINE = re.compile(r"^[ \t]*####[ \t]*([^\n]+)", re.MULTILINE)
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)  # DAPO's checker: anywhere, last match
_NUMBER_WITH_WORDS = re.compile(r"([+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?:\s+[A-Za-z][A-Za-z .]*)?")
_LATEX_MARK = re.compile(r"[\\^_{}$]")
_PROSE = re.compile(r"(?<![A-Za-z])[A-Za-z]{2,}\s+[A-Za-z]{2,}")  # starts at a word only: linear


def as_latex(answer: str) -> str:
    r"""``answer`` as math-verify expects a reference answer: inside ``$...$``, unless it holds ``$`` or ``\boxed``.

    Raw, ``3\sqrt{13}`` parses as 3 and ``(15,-29)`` not at all; ``$3\sqrt{13}$`` and ``$(15,-29)$`` parse whole.
    """
    if "\\boxed" in answer or _UNESCAPED_DOLLAR.search(answer):
        return answer
    return "$" + _UNESCAPED_PERCENT.sub(r"\\%", answer.strip()) + "$"


_BOXED_OPEN = re.compile(r"\\boxed\{")
_BRACE = re.compile(r"[{}]")


def _last_boxed(text: str) -> tuple[int, str] | None:
    r"""(position, ``\boxed{...}``) of the last boxed answer, braces balanced; None if there is none.

    Linear in the length of ``text``: a ``\boxed{`` that does not close before the next one starts cannot
    close at all once the later one has not, so each stretch of the text is scanned once.
    """
    starts = [match.start() for match in _BOXED_OPEN.finditer(text)]
    limit = len(text)
    for start in reversed(starts):
        depth = 0
        for brace in _BRACE.finditer(text, start + len("\\boxed"), limit):
            depth += 1 if brace.group() == "{" else -1
            if depth == 0:
                return start, text[start : brace.end()]
        limit = start
    return None


def _line_answer(content: str) -> str:
    """What math-verify should parse of the text after ``####`` or ``Answer:``."""
    content = content.strip().strip("*").strip().rstrip(".").strip()
    number = _NUMBER_WITH_WORDS.fullmatch(content)
    if number:  # "1,234" or "541 dollars": the number
        return number.group(1)
    if not _LATEX_MARK.search(content) and _PROSE.search(content):  # "The final answer is 5": math-verify finds it
        return content
    return as_latex(content)  # "3\sqrt{13}", "(15,-29)", "2k+2"; kept as is when it holds $ or \boxed


def _last_line(pattern: re.Pattern, text: str) -> tuple[int, str] | None:
    matches = list(pattern.finditer(text))
    return (matches[-1].start(), _line_answer(matches[-1].group(1))) if matches else None


_MARKERS = {"boxed": ("boxed",), "gsm8k": ("gsm8k",), "dapo": ("dapo",), "auto": ("gsm8k", "dapo", "boxed")}


def final_answer(text: str, answer_format: str = "auto") -> str | None:
    """The part of ``text`` math-verify should read as the final answer under ``answer_format``.

    The last marker of the format (see the module docstring); ``text`` itself when there is none, so that
    math-verify extracts the last expression, except for ``dapo``, where no ``Answer:`` line means no
    answer (``None``).
    """
    if answer_format not in _MARKERS:
        raise ValueError(f"answer_format must be one of {list(ANSWER_FORMATS)}, got {answer_format!r}.")
    finders = {"boxed": _last_boxed, "gsm8k": functools.partial(_last_line, _GSM8K_LINE),
               "dapo": functools.partial(_last_line, _ANSWER_LINE)}
    found = [hit for hit in (finders[marker](text) for marker in _MARKERS[answer_format]) if hit is not None]
    if found:
        return max(found)[1]
    if answer_format == "gsm8k":
        return final_answer(text, "boxed")
    return None if answer_format == "dapo" else text


# --- judging (runs in the worker processes) --------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str):
    from math_verify import parse

    return parse(as_latex(gold), parsing_timeout=None)


def judge(text: str, gold, answer_format: str = "auto") -> float | None:
    """1.0/0.0: does the final answer of ``text`` equal ``gold``; None if ``gold`` is missing or unparseable.

    Unbounded in time: :func:`armor_trl.rewards.math_verify_reward` calls it in worker processes with a hard timeout.
    """
    from math_verify import parse, verify

    gold = gold_answer(gold)
    if gold is None:
        return None
    parsed_gold = _parse_gold(gold)
    if not parsed_gold:
        return None
    answer = final_answer(text, answer_format or "auto")
    if answer is None:
        return 0.0
    predicted = parse(answer, parsing_timeout=None)
    return float(bool(predicted) and verify(parsed_gold, predicted, timeout_seconds=None))
