"""Shared fixtures: offline environment, a tiny local model, small datasets.

Helpers (reward functions, trainer factories, recorders) live in testing.py; no test module imports conftest.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from armor_trl.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


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
