"""Shared fixtures: offline environment, a tiny local model, small datasets; how the suite shares the cores.

Helpers (reward functions, trainer factories, recorders) live in testing.py; no test module imports conftest.

Under pytest-xdist (``make test`` runs ``-n auto --dist loadgroup``) the slow tests, those that launch several
processes (torchrun, accelerate launch, DeepSpeed), form two xdist groups (LAUNCH_GROUPS): the tests of a group run
one after another on one worker, so at most two launches share the cores, their ports never clash (the CLI's
accelerate launches use the default port) and the module-scoped runs of test_multiprocess.py are made once. The
tests that load the real model form a third group (test_real_model.py). xdist sends the groups out first, then the
other tests fill in. tests/test_layout.py checks that the installed pytest and pytest-xdist really group (pytest 9.2
with pytest-xdist 3.8 silently does not: pytest-xdist#1386). Each worker keeps torch to its share of the cores and,
once the tests are collected, freezes the imported modules' objects out of the garbage collector.
Every test still gets its own tmp_path.
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from armor_trl.app.tiny import build_tiny_model

# xdist groups of the slow tests (those that launch several processes), by module; the rest join "launch-other".
# Measured: with all of them in one group, that group alone was the whole run's critical path.
LAUNCH_GROUPS = {"test_multiprocess.py": "launch-training"}  # DDP / ZeRO-2 / ZeRO-3 training runs, their resumes


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:  # an xdist worker: its share of the cores, for torch here and for the processes it starts
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_collection_finish(session):
    # Every test module is imported now, with torch, transformers, TRL and PEFT: some 400k objects that live as long
    # as the process. Frozen, they stay out of every full garbage collection: each Trainer.train starts with one
    # (accelerate's free_memory), 0.2 s over this heap, and building models triggers more. Measured on six trainer
    # test modules (98 tests, 2 workers): 32.5 s -> 17.9 s. Objects the tests create are collected as before.
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group(LAUNCH_GROUPS.get(item.path.name, "launch-other")))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> str:
    """The tiny model with a tool-calling chat template (armor_trl.app.tiny.build_tool_tokenizer)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tool-model"), tools=True)


@pytest.fixture(scope="session")
def tool_tokenizer(tool_model):
    return AutoTokenizer.from_pretrained(tool_model)


@pytest.fixture
def prompt_dataset() -> Dataset:
    return Dataset.from_dict(
        {"prompt": [f"{i}+{i + 1}=" for i in range(32)], "answer": [str(2 * i + 1) for i in range(32)]}
    )


@pytest.fixture
def chat_dataset() -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{i}+{i + 1}="}] for i in range(32)],
            "answer": [str(2 * i + 1) for i in range(32)],
        }
    )
