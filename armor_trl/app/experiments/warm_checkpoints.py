"""A study's warm checkpoints, kept in its folder with their weights' hashes, so that its runs train from the same
weights on every machine.

A warm-up follows the float path of the CPU it runs on: the same seed builds other weights on another CPU model, and a
study resumed there would pair new runs with old ones from other starting weights, silently. So a study stores each
warm checkpoint it trains from (``<folder>/warm/warm<seed>/``, a few hundred kB for the tiny model) and records its
weights' SHA-256 in ``study.json`` (``warm_checkpoints``). A later start restores the stored copy instead of building
it again (:func:`.runner.cached_warm_checkpoint`), and refuses a checkpoint whose weights differ from the record.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

RECORD_KEY = "warm_checkpoints"  # in study.json: {"<warm-up seed>": "<sha256 of the weights>"}


def stored_copy(out: Path, seed) -> Path:
    """Where the study folder ``out`` keeps the warm checkpoint of warm-up seed ``seed``."""
    return Path(out) / "warm" / f"warm{seed}"


def copy_folder(source: str | os.PathLike, target: Path) -> None:
    """Copy a checkpoint folder so that ``target`` appears whole or not at all (another process may look meanwhile)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.copytree(source, tmp)
    os.replace(tmp, target)


def weights_hash(folder: str | os.PathLike) -> str:
    """SHA-256 of a checkpoint's weight files (``*.safetensors``, by name then bytes): the weights, not the folder."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors weights to hash.")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def pin_warm_checkpoints(out: Path, models: dict) -> dict:
    """Check each warm checkpoint (warm-up seed → model folder) against the hash ``out/study.json`` recorded for its
    seed, record the hashes of new ones and store a copy of each in ``out``; return {seed: hash}. A ValueError names
    the seed and both hashes when the weights differ (built on another CPU, or changed) or the stored copy does."""
    record_file = Path(out) / "study.json"
    record = json.loads(record_file.read_text())
    recorded = record.setdefault(RECORD_KEY, {})
    hashes = {}
    for seed, model in models.items():
        digest = weights_hash(model)
        stored = stored_copy(out, seed)
        for what, expected in (("recorded in study.json", recorded.get(str(seed))),
                               (f"of the stored copy {stored}", weights_hash(stored) if stored.is_dir() else None)):
            if expected is not None and expected != digest:
                raise ValueError(
                    f"{out}: the warm checkpoint of warm-up seed {seed} ({model}) has weights sha256 {digest}, but the "
                    f"hash {what} is {expected}: this study's runs trained from other weights (a warm-up built on "
                    f"another CPU model, or a changed file). Delete {model} so that the stored copy is restored, or "
                    "use another study folder.")
        if not stored.is_dir():
            copy_folder(model, stored)
        recorded[str(seed)] = hashes[seed] = digest
    record_file.write_text(json.dumps(record, indent=2))
    return hashes
