r"""The math-verify verifier's worker processes: :func:`_serve` (the worker's loop), :class:`VerifierPool` (the
workers, with a hard timeout per completion and a budget per call), the process's one pool and its settings
(:func:`configure_verifier`, :func:`verifier_settings`, :func:`verifier_pool`) and the count of completions not
judged in time (:func:`verifier_timeouts`). It imports only the standard library; math-verify is imported in the
workers.

math-verify's own timeouts use ``signal.alarm`` and work only in a main thread, so every judgement runs in
a small pool of worker processes (:class:`VerifierPool`) with a hard timeout per completion: a worker that
is stuck is killed and replaced, the completion gets ``None`` and :func:`verifier_timeouts` counts it.
Settings: :func:`configure_verifier`, or the environment variables ``ARMOR_VERIFIER_TIMEOUT`` (seconds per
completion, default 10), ``ARMOR_VERIFIER_BATCH_TIMEOUT`` (seconds per call, default 60) and
``ARMOR_VERIFIER_WORKERS`` (processes, default min(4, CPUs)). They are read and checked when the first
completion is judged (:func:`verifier_settings`); a value that is not a positive, finite number (a positive
integer for the workers) is a ``ValueError`` naming the variable.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import selectors
import subprocess
import sys
import threading
import time
from collections import deque

from armor_trl.rewards.answers import judge

logger = logging.getLogger(__name__)


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
                "from armor_trl.rewards.verifier import _serve; _serve()")


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


def verifier_pool() -> VerifierPool:
    """The process's :class:`VerifierPool`, started with :func:`verifier_settings` on first use (a forked child
    starts its own)."""
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
