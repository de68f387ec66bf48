"""Moved to :mod:`armor_trl.experiments.demo`; this name stays importable for earlier code."""

from .experiments.demo import *  # noqa: F401,F403
from .experiments.demo import aggregate, format_table, fresh_run_dir, run_demo, summarize_run  # noqa: F401
