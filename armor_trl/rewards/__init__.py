r"""Verifiable reward functions for RLVR, in TRL's reward-function signature.

Every function here is ``f(completions, **kwargs) -> list[float | None]``: ``completions`` are strings or
chat message lists (``[{"role": "assistant", "content": ...}]``), dataset columns arrive as keyword
arguments (the ground truth in ``answer``, or ``solution`` as a fallback), and ``None`` means "cannot judge"
(no or unparseable ground truth, or a verifier call that timed out), which TRL leaves out of the reward
statistics and ARMOR never counts as a verified anchor.

Gold answers (:func:`gold_answer`): a missing one, a NaN (a JSON ``NaN`` read by pandas or Arrow), or the strings
``"nan"``, ``"None"`` and ``"<NA>"`` (what ``str()`` makes of those) are "no answer": the reward does not apply
(``None``) and :func:`missing_gold_answers` counts it; they are never a string to match. A gold answer holding
``####`` is a GSM8K worked solution (the raw ``answer`` column of ``openai/gsm8k``): its ``#### N`` line is the
answer, read as :mod:`armor_trl.data.datasets` reads it.

Bounds. No completion or gold answer of any length or content raises out of a reward function. The in-process
rewards (:func:`exact_integer_reward`, :func:`boxed_format_reward`, and :func:`math_verify_reward`'s own part) are
linear in the completion's length: integers of any number of digits are compared as digit strings, never with
``int()``. math-verify runs in worker processes with a hard timeout per completion and a budget per call:
once a call has run ``ARMOR_VERIFIER_BATCH_TIMEOUT`` seconds (default 60) from the moment its workers were
ready, every completion still waiting scores ``None`` (counted by :func:`verifier_timeouts`) and the busy
workers are replaced. Measured on 2 CPU cores with 64 completions of the worst kinds (``\boxed{9^{9^{9^9}}}``,
``\boxed{(10^{7})!}``, 5,000 nested braces, 150,000 and 224,000 × ``\boxed{``, 1 M characters, 5,000-digit
integers, cycled): ``math_verify`` took 60.9 s with the default settings (3.6 s with a 1 s timeout and a 3 s
budget: the budget plus about 0.6 s to hand 64 MB to the workers), ``format`` 0.13 s and ``exact_integer`` 0.04 s
for the whole batch; the call after a cut-short one first waits for its replaced workers to start (about 2 s).

Final-answer rules of :func:`math_verify_reward` (docs/verifiers.md has the full table). The rule of a row is
its ``answer_format`` column, which :func:`armor_trl.data.datasets.load_rlvr_dataset` writes per schema; without
the column the rule is ``auto``:

* ``boxed`` (MATH, AIME): the last ``\boxed{...}``; without one, math-verify's own extraction of the text.
* ``gsm8k``: the last ``#### ...`` line; without one, as ``boxed``.
* ``dapo`` (DAPO-Math-17k's "Answer: $Answer" instruction): the last ``Answer: ...``; without one the
  completion scores 0, as DAPO's own checker does.
* ``auto``: whichever of those markers comes last; without any, math-verify's own extraction.

Gold answers are read as LaTeX: wrapped in ``$...$`` unless they already hold ``$`` or ``\boxed`` (a full
solution works: its boxed answer is used).

math-verify's own timeouts use ``signal.alarm`` and work only in a main thread, so every judgement runs in
a small pool of worker processes (:class:`VerifierPool`) with a hard timeout per completion: a worker that
is stuck is killed and replaced, the completion gets ``None`` and :func:`verifier_timeouts` counts it.
Settings: :func:`configure_verifier`, or the environment variables ``ARMOR_VERIFIER_TIMEOUT`` (seconds per
completion, default 10), ``ARMOR_VERIFIER_BATCH_TIMEOUT`` (seconds per call, default 60) and
``ARMOR_VERIFIER_WORKERS`` (processes, default min(4, CPUs)). They are read and checked when the first
completion is judged (:func:`verifier_settings`); a value that is not a positive, finite number (a positive
integer for the workers) is a ``ValueError`` naming the variable.

This module imports only the standard library (math-verify is imported in the workers), so it is cheap to
import anywhere. Built-in names (:data:`REWARD_FUNCS`) and TRL's reward names (``accuracy_reward``,
``think_format_reward``, ... from ``trl.rewards``) resolve with :func:`resolve_reward`, as do import paths
``pkg.mod:func`` or ``pkg.mod.func``.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import logging
import math
import os
import re
import selectors
import subprocess
import sys
import threading
import time
import unicodedata
from collections import Counter, deque
from collections.abc import Callable, Sequence

RewardFunc = Callable[..., list]
ANSWER_FORMATS = ("auto", "boxed", "gsm8k", "dapo")

logger = logging.getLogger(__name__)
_INTEGER = re.compile(r"([+-]?)(\d+)")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?")
_NO_ANSWER = frozenset({"", "nan", "none", "<na>"})  # lower-cased: what str() makes of None, NaN and pandas.NA
_counts: Counter = Counter()  # "missing_gold": completions whose gold answer was missing (see missing_gold_answers)
_warned: set = set()


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


def _gold_answers(n: int, answer, solution, function: str) -> list[str | None]:
    """The gold answer per completion; the ones that are missing are counted (and warned about once)."""
    golds = [gold_answer(truth) for truth in _ground_truths(n, answer, solution)]
    missing = golds.count(None)
    if missing:
        _counts["missing_gold"] += missing
        if function not in _warned:
            _warned.add(function)
            logger.warning(f"{function}: {missing} of {n} completions have no gold answer (missing, NaN, 'nan' or "
                           "'None'); the reward does not apply to them (None). missing_gold_answers() counts them.")
    return golds


def missing_gold_answers() -> int:
    """How many completions got ``None`` from a reward of this module because their gold answer was missing
    (None, NaN, ``"nan"``, ``"None"``, empty) in this process."""
    return _counts["missing_gold"]


def _per_row(n: int, values, name: str) -> list:
    if values is None or isinstance(values, (str, int, float)):  # one value for every completion
        return [values] * n
    if len(values) != n:
        raise ValueError(f"got {n} completions but {len(values)} {name}")
    return list(values)


def _ground_truths(n: int, answer, solution) -> list:
    return _per_row(n, answer if answer is not None else solution, "ground truths")


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

    Unbounded in time: :func:`math_verify_reward` calls it in worker processes with a hard timeout.
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


def _serve() -> None:
    """Worker process: read batches ``[[i, text, gold, format], ...]`` (one JSON line each) and write
    ``[i, reward]`` per item as soon as it is judged; ``"ready"`` once math-verify is imported."""
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the protocol
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401  (import before saying ready)

    protocol.write('"ready"\n')
    protocol.flush()
    for line in sys.stdin:
        for i, text, gold, answer_format in json.loads(line):
            try:
                reward = judge(text, gold, answer_format)
            except Exception:  # a verifier bug must not kill the run: cannot judge
                reward = None
            protocol.write(json.dumps([i, reward]) + "\n")
            protocol.flush()


# --- the worker pool -------------------------------------------------------------------------------------------
# A worker ignores SIGINT from its first line: Ctrl-C in a terminal, or a notebook kernel interrupted or shut down,
# signals the whole process group, and the workers printed a KeyboardInterrupt traceback each. The process that owns
# the pool handles the interrupt and ends its workers (VerifierPool.close, at exit; a worker also ends when its stdin
# closes).
_WORKER_CODE = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "from armor_trl.rewards import _serve; _serve()")


class _Worker:
    def __init__(self, startup_timeout: float):
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        self.buffer = b""
        self.ready = False
        self.pending: deque[int] = deque()
        self.queued: list = []  # items given before the worker was ready: sent when it says "ready"
        self.deadline = time.monotonic() + startup_timeout

    def send(self, items: list) -> None:
        self.process.stdin.write((json.dumps(items) + "\n").encode())
        self.process.stdin.flush()  # BrokenPipeError if the worker has died

    def read(self) -> list | None:
        """Messages that arrived (the caller knows there is data); None when the worker has died."""
        data = os.read(self.process.stdout.fileno(), 1 << 16)
        if not data:
            return None
        lines = (self.buffer + data).split(b"\n")
        self.buffer = lines.pop()
        return [json.loads(line) for line in lines]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


class VerifierPool:
    """Worker processes that run :func:`judge` with a hard timeout per item and a budget per call.

    A call splits its items across the workers, sends each worker its share as one message and reads results
    as they come; a worker that takes longer than ``timeout`` seconds on one item (or dies) is killed and
    replaced, that item gets ``None``, and the rest of its share goes to the new worker. A worker's share that
    is not done ``batch_timeout`` seconds after the call started (or after the worker became ready, for a worker
    still starting) is cut short: its items still waiting get ``None`` and the worker is replaced, so a call
    never takes much longer than ``batch_timeout`` once its workers are up. Calls from several threads are
    serialised.
    """

    def __init__(self, workers: int, timeout: float, startup_timeout: float = 120.0,
                 batch_timeout: float = float("inf")):
        self.size, self.timeout, self.startup_timeout = max(1, workers), timeout, startup_timeout
        self.batch_timeout = batch_timeout
        self.workers: list[_Worker] = []
        self.timeouts = 0
        self.items: list = []  # the items of the call in progress, numbered
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def _start(self, index: int) -> _Worker:
        worker = _Worker(self.startup_timeout)
        if index < len(self.workers):
            self.workers[index] = worker
        else:
            self.workers.append(worker)
        return worker

    def _give(self, index: int, items: list) -> None:
        worker = self.workers[index] if index < len(self.workers) else self._start(index)
        if worker.process.poll() is not None:
            worker = self._start(index)
        if worker.ready:
            try:
                worker.send(items)
            except BrokenPipeError:  # died since the poll: a new worker takes the items
                worker.kill()
                worker = self._start(index)
        if not worker.ready:  # a worker still importing math-verify does not read yet: writing would block
            worker.queued.extend(items)
        worker.pending.extend(item[0] for item in items)
        if worker.ready:
            worker.deadline = time.monotonic() + self.timeout

    def run(self, items: list[tuple[str, str | None, str]]) -> list[float | None]:
        """Rewards for ``(text, gold, answer_format)`` items, in order."""
        results: list[float | None] = [None] * len(items)
        if not items:
            return results
        with self.lock:
            try:
                return self._run(items, results)
            except BaseException:  # e.g. KeyboardInterrupt: the workers hold the call's items; the next call starts anew
                self.close()
                raise

    def _run(self, items: list, results: list) -> list[float | None]:
        self.items = [[i, *item] for i, item in enumerate(items)]
        shares = [self.items[w :: self.size] for w in range(min(self.size, len(items)))]
        for index, share in enumerate(shares):
            self._give(index, share)
        active = list(range(len(shares)))
        # the budget of each worker's share: from now, or from when a worker that is still starting is ready
        budget = {i: time.monotonic() + self.batch_timeout for i in active if self.workers[i].ready}
        cut_short = 0
        with selectors.DefaultSelector() as selector:
            while active:
                for index in active:
                    selector.register(self.workers[index].process.stdout, selectors.EVENT_READ, index)
                soonest = min(min(self.workers[i].deadline, budget.get(i, math.inf)) for i in active)
                readable = {key.data for key, _ in selector.select(max(0.0, soonest - time.monotonic()))}
                for index in list(active):
                    worker = self.workers[index]
                    selector.unregister(worker.process.stdout)
                    messages = worker.read() if index in readable else []
                    if messages is None or (index not in readable and time.monotonic() > worker.deadline):
                        self._replace(index, results, died=messages is None)
                        messages = []
                    for message in messages:
                        if message == "ready":
                            self.workers[index].ready = True
                            budget.setdefault(index, time.monotonic() + self.batch_timeout)
                            queued, self.workers[index].queued = self.workers[index].queued, []
                            try:
                                self.workers[index].send(queued)
                            except BrokenPipeError:  # it died: its output ends and _replace takes over
                                pass
                        else:
                            results[message[0]] = message[1]
                            self.workers[index].pending.popleft()  # a worker judges its items in order
                        self.workers[index].deadline = time.monotonic() + self.timeout
                    if self.workers[index].pending and time.monotonic() > budget.get(index, math.inf):
                        cut_short += self._cut_short(index)
                    if not self.workers[index].pending:
                        active.remove(index)
        if cut_short:
            logger.warning(f"math_verify: {cut_short} of {len(items)} completions were still waiting when the call "
                           f"had used its budget of {self.batch_timeout:g} s (ARMOR_VERIFIER_BATCH_TIMEOUT); they "
                           "count as 'cannot judge' (None) and the busy workers were replaced.")
        return results

    def _cut_short(self, index: int) -> int:
        """The call's budget is spent: the items still waiting on worker ``index`` stay None (counted as
        timeouts), and the worker is replaced by a fresh one. Returns how many items were cut."""
        worker = self.workers[index]
        cut = len(worker.pending)
        self.timeouts += cut
        worker.pending.clear()
        worker.queued.clear()
        worker.kill()
        self._start(index)
        return cut

    def _replace(self, index: int, results: list, died: bool) -> None:
        """Kill a stuck (or dead) worker: its current item cannot be judged; the rest goes to a new worker."""
        worker = self.workers[index]
        if not worker.ready:  # it never started: replacing it would not help
            worker.kill()
            raise RuntimeError(f"math_verify: the verifier worker process {'exited' if died else 'did not start'} "
                               f"({sys.executable} -c {_WORKER_CODE!r}); its error output is above.")
        stuck = worker.pending.popleft()
        results[stuck] = None
        self.timeouts += 1
        logger.warning(f"math_verify: a verifier worker {'died' if died else f'took over {self.timeout:g} s'} on "
                       "one completion; it counts as 'cannot judge' (None) and the worker was replaced.")
        worker.kill()
        remaining = list(worker.pending)
        self._start(index)
        if remaining:
            self._give(index, [self.items[i] for i in remaining])

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []


# name -> (environment variable, kind, default); a value set by configure_verifier overrides the variable
_SETTINGS = {
    "timeout": ("ARMOR_VERIFIER_TIMEOUT", "seconds", lambda: 10.0),
    "batch_timeout": ("ARMOR_VERIFIER_BATCH_TIMEOUT", "seconds", lambda: 60.0),
    "workers": ("ARMOR_VERIFIER_WORKERS", "count", lambda: min(4, os.cpu_count() or 1)),
}
_settings: dict = {}  # the values given to configure_verifier
_pool: VerifierPool | None = None
_pool_lock = threading.Lock()
_closed_timeouts = 0  # timeouts of pools replaced by configure_verifier


def _checked_setting(name: str, value, source: str):
    """``value`` of setting ``name`` as a float of seconds (positive, finite) or a count (integer >= 1);
    a ``ValueError`` naming ``source`` (the argument or the environment variable) otherwise."""
    kind = _SETTINGS[name][1]
    allowed = "a positive, finite number of seconds" if kind == "seconds" else "a whole number >= 1"
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
        if kind == "count":
            number = int(str(value).strip()) if isinstance(value, str) else int(value)
            if number != float(value):
                raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{source} must be {allowed}; got {value!r}.") from None
    if not math.isfinite(number) or number <= 0 or (kind == "count" and number < 1):
        raise ValueError(f"{source} must be {allowed}; got {value!r}.")
    return number


def verifier_settings() -> dict:
    """The settings math_verify's workers use: ``timeout`` and ``batch_timeout`` (seconds) and ``workers``.

    Each is the value given to :func:`configure_verifier`, else its environment variable
    (``ARMOR_VERIFIER_TIMEOUT``, ``ARMOR_VERIFIER_BATCH_TIMEOUT``, ``ARMOR_VERIFIER_WORKERS``; unset or empty:
    the default), checked here: a value that is not a positive, finite number of seconds (an integer >= 1 for
    the workers), such as ``0``, ``-1``, ``nan``, ``inf`` or ``abc``, is a ``ValueError`` naming the variable.
    """
    values = {}
    for name, (variable, _, default) in _SETTINGS.items():
        if name in _settings:
            values[name] = _settings[name]
            continue
        raw = os.environ.get(variable, "")
        values[name] = _checked_setting(name, raw, f"The environment variable {variable}") if raw.strip() else default()
    return values


def _get_pool() -> VerifierPool:
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():  # a forked child starts its own workers
            settings = verifier_settings()
            _pool = VerifierPool(settings["workers"], settings["timeout"], batch_timeout=settings["batch_timeout"])
        return _pool


def configure_verifier(timeout: float | None = None, workers: int | None = None,
                       batch_timeout: float | None = None) -> None:
    """Set the hard timeout per completion (seconds), the budget per call (seconds; see :class:`VerifierPool`)
    and the number of worker processes of math_verify. ``None`` leaves a setting as it is."""
    global _pool, _closed_timeouts
    with _pool_lock:
        given = {"timeout": timeout, "batch_timeout": batch_timeout, "workers": workers}
        checked = {name: _checked_setting(name, value, name) for name, value in given.items() if value is not None}
        _settings.update(checked)
        if _pool is not None:
            _closed_timeouts += _pool.timeouts
            _pool.close()
            _pool = None


def verifier_timeouts() -> int:
    """How many completions math_verify could not judge in time (or whose worker died) in this process.

    The trainer can log it as the metric ``rewards/verifier_timeouts``.
    """
    return _closed_timeouts + (_pool.timeouts if _pool is not None else 0)


@atexit.register
def _close_pool() -> None:
    if _pool is not None and _pool.pid == os.getpid():
        _pool.close()


# --- reward functions ------------------------------------------------------------------------------------------
def math_verify_reward(completions: Sequence, answer=None, solution=None, answer_format=None,
                       **kwargs) -> list[float | None]:
    r"""1.0 when math-verify judges the completion's final answer equal to the ground truth, else 0.0.

    The final answer is read by the row's ``answer_format`` (``auto``, ``boxed``, ``gsm8k`` or ``dapo``; see
    the module docstring) and compared with ``math_verify.verify`` (symbolic equivalence: ``\frac12`` =
    ``0.5``, ``1,234`` = ``1234``). The ground truth comes from the ``answer`` column, else ``solution``
    (see :func:`gold_answer`: a GSM8K worked solution counts by its ``#### N`` line).
    ``None`` where the ground truth is missing (None, NaN, ``"nan"``, ``"None"``; counted by
    :func:`missing_gold_answers`) or unparseable, or the judgement timed out (counted by
    :func:`verifier_timeouts`). A call takes at most about ``ARMOR_VERIFIER_BATCH_TIMEOUT`` seconds (default 60)
    once the workers are up, whatever the completions hold (see the module docstring for measured times).
    """
    n = len(completions)
    formats = ["auto" if f is None else str(f) for f in _per_row(n, answer_format, "answer_format values")]
    unknown = sorted(set(formats) - set(ANSWER_FORMATS))
    if unknown:
        raise ValueError(f"answer_format column: unknown value(s) {unknown}; expected one of {list(ANSWER_FORMATS)}.")
    golds = _gold_answers(n, answer, solution, "math_verify")
    items = [(completion_text(completion), gold, answer_format)
             for completion, gold, answer_format in zip(completions, golds, formats)]
    judged = [i for i, item in enumerate(items) if item[1] is not None]
    rewards: list[float | None] = [None] * n
    for i, reward in zip(judged, _get_pool().run([items[i] for i in judged])):
        rewards[i] = reward
    return rewards


def exact_integer_reward(completions: Sequence, answer=None, **kwargs) -> list[float | None]:
    """1.0 when the whole completion (whitespace aside) is exactly the integer ground truth, else 0.0.

    The verifier of the synthetic arithmetic task (``12+35=`` → ``47``): strict on purpose, so trailing text is
    wrong. ``None`` where the ground truth is missing (counted by :func:`missing_gold_answers`) or not an integer.
    Integers of any length are compared as digit strings (sign and leading zeros aside), never with ``int()``,
    so no number of digits raises; linear in the completion's length.
    """
    rewards: list[float | None] = []
    for completion, gold in zip(completions, _gold_answers(len(completions), answer, None, "exact_integer")):
        expected = _integer_digits(gold) if gold is not None else None
        if expected is None:
            rewards.append(None)
            continue
        rewards.append(float(_integer_digits(completion_text(completion)) == expected))
    return rewards


def final_integer_reward(completions: Sequence, answer=None, **kwargs) -> list[float | None]:
    """1.0 when the text after the completion's last ``#`` (whitespace aside) is exactly the integer ground truth,
    else 0.0 (also without a ``#``).

    The verifier of the mode testbed (:mod:`armor_trl.rewards.modes`): a worked ``"5+7=12,2+0+1=3,1+3=4#432"`` and a direct
    ``"#432"`` are judged by their final answer alone. ``None`` where the ground truth is missing or not an integer;
    integers compared as digit strings, as :func:`exact_integer_reward` does.
    """
    rewards: list[float | None] = []
    for completion, gold in zip(completions, _gold_answers(len(completions), answer, None, "final_integer")):
        expected = _integer_digits(gold) if gold is not None else None
        if expected is None:
            rewards.append(None)
            continue
        text = completion_text(completion)
        mark = text.rfind("#")
        rewards.append(float(mark != -1 and _integer_digits(text[mark + 1:]) == expected))
    return rewards


def _integer_digits(text: str) -> tuple[str, str] | None:
    """(sign, digits) of an integer written as ``text`` (whitespace around it aside), with leading zeros and the
    sign of zero dropped and any Unicode decimal digits written as ASCII; None if ``text`` is not an integer."""
    match = _INTEGER.fullmatch(text.strip())
    if match is None:
        return None
    digits = match.group(2)
    if not digits.isascii():  # \d (like int()) also takes other scripts' decimal digits
        digits = "".join(str(unicodedata.decimal(digit)) for digit in digits)
    digits = digits.lstrip("0") or "0"
    return ("-" if match.group(1) == "-" and digits != "0" else "", digits)


_BOXED_CONTENT = "\\boxed{"


def boxed_format_reward(completions: Sequence, **kwargs) -> list[float]:
    r"""1.0 when the completion states a final answer in a form the verifiers read first (``\boxed{...}`` with
    something inside, or a ``#### x`` line), else 0.0.

    Linear in the completion's length (a megabyte of ``\boxed{`` takes milliseconds).
    """
    return [float(_has_final_answer_form(completion_text(c))) for c in completions]


def _has_final_answer_form(text: str) -> bool:
    # "\boxed{", at least one character, then a "}": the first "\boxed{" has the most room for both
    start = text.find(_BOXED_CONTENT)
    if start != -1 and text.find("}", start + len(_BOXED_CONTENT) + 1) != -1:
        return True
    return _GSM8K_MARK.search(text) is not None


_GSM8K_MARK = re.compile(r"^####\s*\S", re.MULTILINE)  # each "####" scans only the whitespace after it


math_verify_reward.__name__ = "math_verify"
exact_integer_reward.__name__ = "exact_integer"
final_integer_reward.__name__ = "final_integer"
boxed_format_reward.__name__ = "format"

REWARD_FUNCS: dict[str, RewardFunc] = {
    "math_verify": math_verify_reward,
    "exact_integer": exact_integer_reward,
    "final_integer": final_integer_reward,
    "format": boxed_format_reward,
}
# trl.rewards names that are factories: they need parameters, so a recipe cannot name them directly.
_TRL_FACTORIES = ("get_cosine_scaled_reward", "get_repetition_penalty_reward", "get_soft_overlong_punishment")


def _trl_reward(name: str) -> RewardFunc | None:
    """``trl.rewards.<name>`` (imported only now), None if TRL has no such reward."""
    trl_rewards = importlib.import_module("trl.rewards")
    if name not in getattr(trl_rewards, "__all__", ()) or name.endswith("_rewards"):
        return None
    if name in _TRL_FACTORIES:
        raise ValueError(
            f"trl.rewards.{name} builds a reward function from parameters, so a recipe cannot name it directly: put "
            f"e.g. `my_reward = {name}(...)` in a my_rewards.py next to the recipe and list 'my_rewards:my_reward'."
        )
    return getattr(trl_rewards, name)


def resolve_reward(name: str) -> RewardFunc:
    """A reward function from a built-in name (:data:`REWARD_FUNCS`), a reward of ``trl.rewards``
    (``accuracy_reward``, ``reasoning_accuracy_reward``, ``think_format_reward``), or an import path
    ``pkg.mod:func`` / ``pkg.mod.func``.

    Like ``trl grpo``, the current directory is importable, so a ``my_rewards.py`` next to the recipe works.
    """
    if name in REWARD_FUNCS:
        return REWARD_FUNCS[name]
    if ":" in name:
        module_name, attr = name.split(":", 1)
    elif "." in name:
        module_name, attr = name.rsplit(".", 1)
    else:
        function = _trl_reward(name) if re.fullmatch(r"[A-Za-z_]\w*", name) else None
        if function is None:
            raise ValueError(f"Unknown reward function {name!r}: expected one of {sorted(REWARD_FUNCS)}, a reward of "
                             "trl.rewards (accuracy_reward, reasoning_accuracy_reward, think_format_reward) or an "
                             "import path 'pkg.module:function'.")
        return function
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Could not load reward function {name!r}: {error}") from error
    if not callable(function):
        raise ValueError(f"Reward function {name!r} is not callable.")
    return function


def resolve_rewards(names: Sequence[str] | str) -> list[RewardFunc]:
    """:func:`resolve_reward` for each name (a single name or comma-separated names are accepted too)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    return [resolve_reward(name) for name in names]
