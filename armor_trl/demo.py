"""Moved to :mod:`armor_trl.experiments.demo`; this name stays importable for earlier code."""

from .experiments.demo import format_demo, run_demo  # noqa: F401
