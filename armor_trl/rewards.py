r"""Verifiable reward functions for RLVR, in TRL's reward-function signature.

Every function here is ``f(completions, **kwargs) -> list[float | None]``: ``completions`` are strings or
chat message lists (``[{"role": "assistant", "content": ...}]``), dataset columns arrive as keyword
arguments (the ground truth in ``answer``, or ``solution`` as a fallback), and ``None`` means "cannot judge"
(no or unparseable ground truth, or a verifier call that timed out), which TRL leaves out of the reward
statistics and ARMOR never counts as a verified anchor.

Final-answer rules of :func:`math_verify_reward` (docs/verifiers.md has the full table). The rule of a row is
its ``answer_format`` column, which :func:`armor_trl.datasets.load_rlvr_dataset` writes per schema; without
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
completion, default 10) and ``ARMOR_VERIFIER_WORKERS`` (processes, default min(4, CPUs)).

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
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

RewardFunc = Callable[..., list]
ANSWER_FORMATS = ("auto", "boxed", "gsm8k", "dapo")

logger = logging.getLogger(__name__)
_INTEGER = re.compile(r"\s*([+-]?\d+)\s*")


def completion_text(completion) -> str:
    """The text of a completion: the string itself, or the content of the last message of a chat completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    return str(completion[-1]["content"]) if completion else ""


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
_PROSE = re.compile(r"[A-Za-z]{2,}\s+[A-Za-z]{2,}")


def as_latex(answer: str) -> str:
    r"""``answer`` as math-verify expects a reference answer: inside ``$...$``, unless it holds ``$`` or ``\boxed``.

    Raw, ``3\sqrt{13}`` parses as 3 and ``(15,-29)`` not at all; ``$3\sqrt{13}$`` and ``$(15,-29)$`` parse whole.
    """
    if "\\boxed" in answer or _UNESCAPED_DOLLAR.search(answer):
        return answer
    return "$" + _UNESCAPED_PERCENT.sub(r"\\%", answer.strip()) + "$"


def _last_boxed(text: str) -> tuple[int, str] | None:
    r"""(position, ``\boxed{...}``) of the last boxed answer, braces balanced; None if there is none."""
    start = text.rfind("\\boxed")
    while start != -1:
        open_brace = start + len("\\boxed")
        if text.startswith("{", open_brace):
            depth = 0
            for end in range(open_brace, len(text)):
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                if depth == 0:
                    return start, text[start : end + 1]
        start = text.rfind("\\boxed", 0, start)
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

    if gold is None or not str(gold).strip():
        return None
    parsed_gold = _parse_gold(str(gold))
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
_WORKER_CODE = "from armor_trl.rewards import _serve; _serve()"


class _Worker:
    def __init__(self, startup_timeout: float):
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CODE],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        self.buffer = b""
        self.ready = False
        self.pending: deque[int] = deque()
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
    """Worker processes that run :func:`judge` with a hard timeout per item.

    A call splits its items across the workers, sends each worker its share as one message and reads results
    as they come; a worker that takes longer than ``timeout`` seconds on one item (or dies) is killed and
    replaced, that item gets ``None``, and the rest of its share goes to the new worker. Calls from several
    threads are serialised.
    """

    def __init__(self, workers: int, timeout: float, startup_timeout: float = 120.0):
        self.size, self.timeout, self.startup_timeout = max(1, workers), timeout, startup_timeout
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
        try:
            worker.send(items)
        except BrokenPipeError:  # died since the poll: a new worker takes the items
            worker.kill()
            worker = self._start(index)
            worker.send(items)
        worker.pending.extend(item[0] for item in items)
        if worker.ready:
            worker.deadline = time.monotonic() + self.timeout

    def run(self, items: list[tuple[str, str | None, str]]) -> list[float | None]:
        """Rewards for ``(text, gold, answer_format)`` items, in order."""
        results: list[float | None] = [None] * len(items)
        if not items:
            return results
        with self.lock:
            self.items = [[i, *item] for i, item in enumerate(items)]
            shares = [self.items[w :: self.size] for w in range(min(self.size, len(items)))]
            for index, share in enumerate(shares):
                self._give(index, share)
            active = list(range(len(shares)))
            with selectors.DefaultSelector() as selector:
                while active:
                    for index in active:
                        selector.register(self.workers[index].process.stdout, selectors.EVENT_READ, index)
                    wait = max(0.0, min(self.workers[i].deadline for i in active) - time.monotonic())
                    readable = {key.data for key, _ in selector.select(wait)}
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
                            else:
                                results[message[0]] = message[1]
                                self.workers[index].pending.popleft()  # a worker judges its items in order
                            self.workers[index].deadline = time.monotonic() + self.timeout
                        if not self.workers[index].pending:
                            active.remove(index)
        return results

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


_settings = {"timeout": float(os.environ.get("ARMOR_VERIFIER_TIMEOUT", 10)),
             "workers": int(os.environ.get("ARMOR_VERIFIER_WORKERS", min(4, os.cpu_count() or 1)))}
_pool: VerifierPool | None = None
_pool_lock = threading.Lock()
_closed_timeouts = 0  # timeouts of pools replaced by configure_verifier


def _get_pool() -> VerifierPool:
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():  # a forked child starts its own workers
            _pool = VerifierPool(_settings["workers"], _settings["timeout"])
        return _pool


def configure_verifier(timeout: float | None = None, workers: int | None = None) -> None:
    """Set the hard timeout per completion (seconds) and the number of worker processes of math_verify."""
    global _pool, _closed_timeouts
    with _pool_lock:
        if timeout is not None:
            if timeout <= 0:
                raise ValueError(f"timeout must be > 0 seconds, got {timeout}.")
            _settings["timeout"] = float(timeout)
        if workers is not None:
            if workers < 1:
                raise ValueError(f"workers must be >= 1, got {workers}.")
            _settings["workers"] = int(workers)
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
    ``0.5``, ``1,234`` = ``1234``). The ground truth comes from the ``answer`` column, else ``solution``.
    ``None`` where the ground truth is missing or unparseable, or the judgement timed out.
    """
    n = len(completions)
    formats = ["auto" if f is None else str(f) for f in _per_row(n, answer_format, "answer_format values")]
    unknown = sorted(set(formats) - set(ANSWER_FORMATS))
    if unknown:
        raise ValueError(f"answer_format column: unknown value(s) {unknown}; expected one of {list(ANSWER_FORMATS)}.")
    items = []
    for completion, truth, answer_format in zip(completions, _ground_truths(n, answer, solution), formats):
        gold = None if truth is None or not str(truth).strip() else str(truth)
        items.append((completion_text(completion), gold, answer_format))
    judged = [i for i, item in enumerate(items) if item[1] is not None]
    rewards: list[float | None] = [None] * n
    for i, reward in zip(judged, _get_pool().run([items[i] for i in judged])):
        rewards[i] = reward
    return rewards


def exact_integer_reward(completions: Sequence, answer=None, **kwargs) -> list[float | None]:
    """1.0 when the whole completion (whitespace aside) is exactly the integer ground truth, else 0.0.

    The verifier of the synthetic arithmetic task (``12+35=`` → ``47``): strict on purpose, so trailing text is
    wrong. ``None`` where the ground truth is missing or not an integer.
    """
    rewards: list[float | None] = []
    for completion, truth in zip(completions, _ground_truths(len(completions), answer, None)):
        gold = _INTEGER.fullmatch(str(truth)) if truth is not None else None
        if gold is None:
            rewards.append(None)
            continue
        predicted = _INTEGER.fullmatch(completion_text(completion))
        rewards.append(float(predicted is not None and int(predicted.group(1)) == int(gold.group(1))))
    return rewards


def boxed_format_reward(completions: Sequence, **kwargs) -> list[float]:
    r"""1.0 when the completion states a final answer in a form the verifiers read first (``\boxed{...}`` or ``#### x``)."""
    pattern = re.compile(r"\\boxed\{.+\}|^####\s*\S", re.MULTILINE | re.DOTALL)
    return [float(pattern.search(completion_text(c)) is not None) for c in completions]


math_verify_reward.__name__ = "math_verify"
exact_integer_reward.__name__ = "exact_integer"
boxed_format_reward.__name__ = "format"

REWARD_FUNCS: dict[str, RewardFunc] = {
    "math_verify": math_verify_reward,
    "exact_integer": exact_integer_reward,
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
