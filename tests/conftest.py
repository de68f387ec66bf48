"""Shared fixtures: offline environment, a tiny local model, small datasets and trainer factories."""

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


def has_digit_reward(completions, **kwargs):
    """1.0 when the completion contains a digit: random tiny models hit it about half the time."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(any(ch.isdigit() for ch in text)) for text in texts]


def cpu_args(**overrides) -> dict:
    """Arguments for a fast, deterministic CPU run of a few steps."""
    args = dict(
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=1e-2,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=42,
        disable_tqdm=True,
    )
    args.update(overrides)
    return args


def digit_share_reward(completions, **kwargs):
    """Share of digits in the completion: a graded reward, so groups almost never have zero variance."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]
