"""A group's environments start alike (docs/anchors.md, "Tools and environments", "Reproducible resets").

An anchor compares trajectories from one initial state, but an environment's ``reset`` may draw hidden random state
(a secret drawn, the observation unchanged), which comparing the prompts after reset cannot see. In an anchored round
with ``environment_factory``, every reset of a group, the policy's G (TRL's, in row order) and π_ref's K candidates'
(ARMOR's), starts from the same state of the process's global random generators: Python's ``random``, NumPy's global
generator and torch's (CPU, and CUDA where initialised), the state they held before the group's first reset. After the
group the generators continue from where its first reset left them, so the next group draws anew, and a candidate's
reset leaves them as it found them. A reset that draws from a generator of its own (``random.Random()`` seeded from
the clock or ``os.urandom``, ``secrets``, a service) is not covered: put the task or a seed in a dataset column.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from armor_trl.integration import trl_generation


def rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def set_rng_state(state: tuple) -> None:
    python, numpy_state, torch_state, cuda = state
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class GroupResets:
    """The random state each group's resets start from, in the round being generated."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.rows, self.group_size, self.seen = 0, 1, 0
        self.starts: dict = {}  # per group of the round (by index): the generators' state before its first reset
        self._after_first = None
        trl_generation.wrap_environment_resets(trainer, self._reset)

    def start_round(self, rows: int, group_size: int) -> None:
        """TRL's resets of the policy's ``rows`` (groups of ``group_size`` in row order) come next."""
        self.rows, self.group_size, self.seen, self.starts = rows, group_size, 0, {}

    def _row(self, instance) -> int | None:
        """The round's row whose environment ``instance`` is (TRL's list of the round's instances), else None."""
        return next((row for row, environment in enumerate(self.trainer.environments or [])
                     if environment is instance), None)

    def _reset(self, instance, reset, **kwargs):
        row = self._row(instance) if self.seen < self.rows else None
        if row is None:  # not one of TRL's resets of the round's rows: a candidate's, or outside a round
            return reset(**kwargs)
        # grouped by the row's own index, so nothing else TRL resets (or does not) can shift a group onto another
        self.seen += 1
        group, member = divmod(row, self.group_size)
        if member == 0:
            self.starts[group] = rng_state()
            observation = reset(**kwargs)
            self._after_first = rng_state()
            return observation
        set_rng_state(self.starts[group])
        try:
            return reset(**kwargs)
        finally:
            set_rng_state(self._after_first)

    @contextlib.contextmanager
    def as_group(self, group: int):
        """Within the block (a candidate's reset) the generators hold group ``group``'s starting state; afterwards
        they are as they were found. A no-op for a group whose resets were not seen (outside an anchored round)."""
        if group not in self.starts:
            yield
            return
        found = rng_state()
        set_rng_state(self.starts[group])
        try:
            yield
        finally:
            set_rng_state(found)
