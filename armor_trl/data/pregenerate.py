"""Pre-generated anchors, the library behind ``armor-trl anchors`` (:mod:`armor_trl.app.cli`): sample anchor candidates
from the reference once, in bulk, before training.

With a static reference a verified anchor of a prompt never goes stale, so the K reference samples per prompt
that online Anchor Rollout draws at every step can be drawn once at full generation throughput. This module
samples ``num_candidates`` completions per training prompt from the reference, scores them with the recipe's
reward functions, and writes the prompts with an ``anchors`` column (up to ``max_anchors_per_prompt`` verified
completion texts) for training with ``anchor_source='column'``.

Output folder::

    settings.json         what the samples depend on; a resumed run must match it
    shards/shard-NNNNN.parquet   ``shard_size`` prompts each, written atomically (finished shards are skipped)
    anchors.parquet       all shards in dataset order (``datasets.load_dataset("parquet", data_files=...)``)
    metadata.json         settings + counts: prompts, share with >= 1 anchor, prompts/s

Under ``accelerate launch`` process r of W takes shards r, r+W, ... Each shard is sampled with its own seed
(``seed + shard``), so an interrupted and resumed run writes the same shards as an uninterrupted one.
Generation: batched ``transformers`` ``generate``; vLLM offline batch generation when ``vllm`` is importable and
a GPU is present (that path is untested here: no GPU in CI).
"""

from __future__ import annotations

import asyncio
import glob
import hashlib
import inspect
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from armor_trl.rollout.anchors import verified_mask

SHARD_DIR, MERGED_FILE, SETTINGS_FILE, METADATA_FILE = "shards", "anchors.parquet", "settings.json", "metadata.json"
BACKENDS = ("auto", "transformers", "vllm")


@dataclass
class AnchorSettings:
    """Everything the pre-generated anchors depend on (compared on resume, written to metadata.json)."""

    reference: str
    num_candidates: int = 8
    max_anchors_per_prompt: int = 4
    threshold: float = 1.0
    reward_funcs: list[str] = field(default_factory=list)
    reward_weights: list[float] | None = None
    anchor_reward_funcs: list[str] | None = None
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    shard_size: int = 64
    anchor_column: str = "anchors"
    reference_fingerprint: str | None = None
    dataset_fingerprint: str | None = None

    def check(self) -> None:
        for name in ("num_candidates", "max_anchors_per_prompt", "shard_size", "max_completion_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)}.")


def weight_fingerprint(path: str) -> str | None:
    """A short hash of a saved model's weight files (names, sizes, first and last MiB); None if not a local folder."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.bin")))
    if not files:
        return None
    digest = hashlib.sha256()
    for name in files:
        size = os.path.getsize(name)
        digest.update(f"{os.path.basename(name)}:{size}".encode())
        with open(name, "rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(size - (1 << 20), 0))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


def dataset_fingerprint(dataset) -> str:
    digest = hashlib.sha256()
    for prompt in dataset["prompt"]:
        digest.update(json.dumps(prompt, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def _call_reward(func, **kwargs) -> list:
    if inspect.iscoroutinefunction(func):
        return asyncio.run(func(**kwargs))
    return func(**kwargs)


def score(reward_funcs, rows: list[dict], completions: list, completion_ids: list) -> torch.Tensor:
    """(rows, functions) rewards, called like GRPOTrainer calls them (other columns as keyword lists); None = NaN."""
    if any(isinstance(func, torch.nn.Module) for func in reward_funcs):
        raise ValueError("armor-trl anchors scores with reward functions; reward models are not supported yet.")
    columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion", "completion_ids")}
    rewards = torch.full((len(rows), len(reward_funcs)), float("nan"))
    for j, func in enumerate(reward_funcs):
        values = _call_reward(
            func, prompts=[row["prompt"] for row in rows], completions=completions, completion_ids=completion_ids,
            trainer_state=None, log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None, **columns,
        )
        rewards[:, j] = torch.tensor([math.nan if v is None else float(v) for v in values])
    return rewards


def _conversational(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def tokenize_prompts(tokenizer, prompts: list, chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Prompt ids as GRPOTrainer makes them (chat template with the generation prompt, or plain tokenization)."""
    if _conversational(prompts[0]):
        return tokenizer.apply_chat_template(
            prompts, add_generation_prompt=True, tokenize=True, return_dict=True, **(chat_template_kwargs or {})
        )["input_ids"]
    return tokenizer(text=prompts)["input_ids"]


class TransformersSampler:
    """Batched sampling with ``model.generate`` (left padding; completions cut after the first EOS, kept)."""

    def __init__(self, path: str, settings: AnchorSettings, tokenizer, device, batch_size: int, dtype="auto"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self.tokenizer, self.settings, self.device, self.batch_size = tokenizer, settings, device, batch_size
        eos = self.model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos = [tokenizer.eos_token_id] + [e for e in eos if e != tokenizer.eos_token_id]

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], seed: int) -> list[list[list[int]]]:
        s, pad = self.settings, self.tokenizer.pad_token_id
        torch.manual_seed(seed)
        out = []
        for start in range(0, len(prompt_ids), self.batch_size):
            batch = prompt_ids[start : start + self.batch_size]
            width = max(len(ids) for ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch], device=self.device)
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=self.device)
            generated = self.model.generate(
                input_ids=input_ids, attention_mask=mask, do_sample=True, num_return_sequences=s.num_candidates,
                max_new_tokens=s.max_completion_length, temperature=s.temperature, top_p=s.top_p,
                top_k=s.top_k or None, pad_token_id=pad, eos_token_id=self.eos,
            )[:, width:].tolist()
            for i in range(len(batch)):
                out.append([self._cut(ids) for ids in generated[i * s.num_candidates : (i + 1) * s.num_candidates]])
        return out

    def _cut(self, ids: list[int]) -> list[int]:
        for position, token in enumerate(ids):
            if token in self.eos:
                return ids[: position + 1]
        return ids


class VLLMSampler:
    """Offline batch sampling with vLLM (untested here: needs vllm and a GPU)."""

    def __init__(self, path: str, settings: AnchorSettings):
        from vllm import LLM

        self.llm, self.settings = LLM(model=path, seed=settings.seed), settings

    def sample(self, prompt_ids: list[list[int]], seed: int) -> list[list[list[int]]]:
        from vllm import SamplingParams

        s = self.settings
        params = SamplingParams(n=s.num_candidates, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or -1,
                                max_tokens=s.max_completion_length, seed=seed)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        return [[list(c.token_ids) for c in output.outputs] for output in outputs]


def _shard_path(output: str, shard: int) -> str:
    return os.path.join(output, SHARD_DIR, f"shard-{shard:05d}.parquet")


def _write_shard(rows: list[dict], path: str) -> None:
    """Write a shard atomically: a killed run leaves either the whole file or none (only a .tmp)."""
    from datasets import Dataset

    temporary = path + ".tmp"
    Dataset.from_list(rows).to_parquet(temporary)
    os.replace(temporary, path)


def prepare_output(output: str, settings: AnchorSettings, is_main: bool) -> None:
    """Create the folder and settings.json, or check that a resumed run uses the same settings."""
    os.makedirs(os.path.join(output, SHARD_DIR), exist_ok=True)
    path = os.path.join(output, SETTINGS_FILE)
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        differing = {k: (saved.get(k), v) for k, v in asdict(settings).items() if saved.get(k) != v}
        if differing:
            details = ", ".join(f"{k}: {old!r} there vs {new!r} now" for k, (old, new) in differing.items())
            raise ValueError(
                f"{output} holds anchors generated with other settings ({details}). Use another --output_dir, or the same "
                "settings to resume."
            )
    elif is_main:
        with open(path + ".tmp", "w") as f:
            json.dump(asdict(settings), f, indent=2)
        os.replace(path + ".tmp", path)


def generate_shards(dataset, settings: AnchorSettings, reward_funcs, tokenizer, sampler, output: str, rank: int = 0,
                    world: int = 1, chat_template_kwargs: dict | None = None, progress: bool = True) -> dict:
    """Sample, score and write this process's unfinished shards. Returns counts of this call."""
    from tqdm.auto import tqdm

    shards = math.ceil(len(dataset) / settings.shard_size)
    mine = [shard for shard in range(rank, shards, world) if not os.path.exists(_shard_path(output, shard))]
    weights = torch.tensor(settings.reward_weights or [1.0] * len(reward_funcs), dtype=torch.float)
    names = [getattr(func, "__name__", str(func)) for func in reward_funcs]
    use_funcs = None
    if settings.anchor_reward_funcs is not None:
        use_funcs = torch.tensor([name in settings.anchor_reward_funcs for name in names])
    k, started, prompts_done = settings.num_candidates, time.perf_counter(), 0
    bar = tqdm(total=sum(min(settings.shard_size, len(dataset) - s * settings.shard_size) for s in mine),
               desc=f"anchors (process {rank})" if world > 1 else "anchors", unit="prompt", disable=not progress)
    for shard in mine:
        rows = dataset.select(range(shard * settings.shard_size, min((shard + 1) * settings.shard_size, len(dataset))))
        rows = rows.to_list()
        prompt_ids = tokenize_prompts(tokenizer, [row["prompt"] for row in rows], chat_template_kwargs)
        candidates = sampler.sample(prompt_ids, settings.seed + shard)
        flat_rows = [row for row in rows for _ in range(k)]
        flat_ids = [ids for group in candidates for ids in group]
        texts = tokenizer.batch_decode(flat_ids, skip_special_tokens=True)
        conversational = _conversational(rows[0]["prompt"])
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        rewards = score(reward_funcs, flat_rows, completions, flat_ids)
        verified = verified_mask(rewards, weights, settings.threshold, use_funcs).view(-1, k)
        for i, row in enumerate(rows):
            kept = []
            for j in verified[i].nonzero().flatten().tolist():
                if texts[i * k + j] not in kept:
                    kept.append(texts[i * k + j])
            row[settings.anchor_column] = kept[: settings.max_anchors_per_prompt]
            row["num_verified"] = int(verified[i].sum())
        _write_shard(rows, _shard_path(output, shard))
        prompts_done += len(rows)
        bar.update(len(rows))
    bar.close()
    return {"prompts": prompts_done, "seconds": time.perf_counter() - started, "shards_written": len(mine),
            "shards_total": shards}


def finalize(output: str, settings: AnchorSettings, num_rows: int, rate: float | None = None) -> dict | None:
    """Merge the shards into anchors.parquet and write metadata.json; None while shards are missing."""
    from datasets import concatenate_datasets, load_dataset

    shards = math.ceil(num_rows / settings.shard_size)
    paths = [_shard_path(output, shard) for shard in range(shards)]
    if not all(os.path.exists(path) for path in paths):
        return None
    merged = concatenate_datasets([load_dataset("parquet", data_files=path, split="train") for path in paths])
    merged.to_parquet(os.path.join(output, MERGED_FILE) + ".tmp")
    os.replace(os.path.join(output, MERGED_FILE) + ".tmp", os.path.join(output, MERGED_FILE))
    with_anchor = sum(1 for anchors in merged[settings.anchor_column] if anchors)
    metadata = {
        **asdict(settings),
        "prompts": len(merged),
        "prompts_with_anchor": with_anchor,
        "share_with_anchor": with_anchor / len(merged) if len(merged) else math.nan,
        "prompts_per_second": rate,
        "file": MERGED_FILE,
    }
    with open(os.path.join(output, METADATA_FILE), "w") as f:
        json.dump(metadata, f, indent=2)
    return metadata


def anchor_file(path: str) -> str:
    """The anchors.parquet of ``path`` (an `armor-trl anchors` output folder, or the file itself)."""
    return os.path.join(path, MERGED_FILE) if os.path.isdir(path) else path


def _arrow_type_ok(arrow_type, what: str) -> bool:
    import pyarrow as pa

    text = lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)  # noqa: E731
    listed = lambda t: pa.types.is_list(t) or pa.types.is_large_list(t)  # noqa: E731
    if what == "anchors":  # a completion text or a list of them per row (all-empty lists are list<null>)
        return text(arrow_type) or pa.types.is_null(arrow_type) or listed(arrow_type) and (
            text(arrow_type.value_type) or pa.types.is_null(arrow_type.value_type))
    if what == "prompt":  # a text, or a list of {role, content} messages
        if text(arrow_type):
            return True
        return listed(arrow_type) and pa.types.is_struct(arrow_type.value_type) and \
            {"role", "content"} <= {f.name for f in arrow_type.value_type}
    return pa.types.is_integer(arrow_type)  # num_verified


def load_anchors(path: str, column: str = "anchors"):
    """The pre-generated dataset at ``path`` (the output folder or its anchors.parquet), checked at load: a missing,
    truncated or unreadable file, a file without rows, and a missing or wrong-typed ``prompt`` / ``column`` /
    ``num_verified`` column are each a one-line ValueError naming the file and what is wrong."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    file = anchor_file(path)
    if not os.path.isfile(file):
        where = f"no {MERGED_FILE} in the folder {path}" if os.path.isdir(path) else "no such file"
        raise ValueError(f"anchors_dataset {file}: {where} (run `armor-trl anchors` to the end first).")
    try:
        table = pq.read_table(file)
    except (pa.ArrowException, OSError) as error:
        reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise ValueError(f"anchors_dataset {file}: not a readable parquet file, truncated or corrupt ({reason}); "
                         "run `armor-trl anchors` again into a new folder.") from None
    if table.num_rows == 0:
        raise ValueError(f"anchors_dataset {file}: the file has 0 rows (no prompt, no anchor); run `armor-trl anchors` "
                         "on the training set.")
    for name, allowed in (("prompt", "a text or a list of {role, content} messages"),
                          (column, "a completion text or a list of them"), ("num_verified", "an integer")):
        if name not in table.column_names:
            if name == "num_verified":
                continue
            raise ValueError(f"anchors_dataset {file}: no column {name!r} (it has {table.column_names}).")
        arrow_type = table.schema.field(name).type
        if not _arrow_type_ok(arrow_type, "anchors" if name == column else name):
            raise ValueError(f"anchors_dataset {file}: column {name!r} has type {arrow_type}; it must hold {allowed}.")
    return Dataset(table)


def read_anchor_metadata(path: str) -> dict | None:
    """metadata.json next to the anchor set (None when there is none); a ValueError naming it when corrupt."""
    file = os.path.join(os.path.dirname(os.path.abspath(anchor_file(path))), METADATA_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            metadata = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"anchors_dataset {file}: not valid JSON ({error}); the file is corrupt.") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"anchors_dataset {file}: expected a JSON object, got {type(metadata).__name__}.")
    return metadata


OVERRIDE_FIELD = "anchor_set_allow_other_reference"


def check_anchor_reference(path: str, reference: str, allow_other: bool = False) -> str | None:
    """Refuse an anchor set sampled from another model than the run's ``reference``: the weight fingerprints written to
    its metadata.json are compared (the reference names where either is not a local folder). A ValueError naming both
    unless ``allow_other``; then the mismatch is returned as a note (None when they match)."""
    metadata = read_anchor_metadata(path)
    file = os.path.join(os.path.dirname(os.path.abspath(anchor_file(path))), METADATA_FILE)
    if metadata is None:
        problem = f"no {METADATA_FILE} next to it, so the model its anchors come from is unknown"
    else:
        theirs, ours = metadata.get("reference_fingerprint"), weight_fingerprint(reference)
        if theirs and ours:
            if theirs == ours:
                return None
            problem = (f"its anchors come from {metadata.get('reference')!r} (weights fingerprint {theirs}), but this "
                       f"run's reference is {reference!r} (fingerprint {ours})")
        elif metadata.get("reference") == reference:
            return None
        else:
            problem = (f"its anchors come from {metadata.get('reference')!r} (fingerprint {theirs}), but this run's "
                       f"reference is {reference!r} (fingerprint {ours})")
    if allow_other:
        return f"anchors_dataset {path}: {problem}; accepted ({OVERRIDE_FIELD} true)."
    raise ValueError(f"anchors_dataset {path}: {problem} ({file}). Anchors must be the reference's own verified "
                     f"samples: run `armor-trl anchors` with this recipe, or set {OVERRIDE_FIELD}: true to accept them.")


def attach_anchors(train, path: str, column: str = "anchors", reference: str | None = None,
                   allow_other_reference: bool = False):
    """Add the pre-generated ``column`` to the training set, matched by prompt; every prompt must have a row.

    ``reference``: the run's reference model; the anchor set must come from it (:func:`check_anchor_reference`,
    ``allow_other_reference`` accepts another). A prompt may appear in the anchor set as often as in the training set
    (`armor-trl anchors` writes one row per training row); the anchors of its rows are then pooled, in file order.
    More rows for a prompt than the training set has is a ValueError naming the prompt."""
    if reference is not None:
        note = check_anchor_reference(path, reference, allow_other_reference)
        if note:
            import warnings

            warnings.warn(note, stacklevel=2)
    anchors = load_anchors(path, column)
    keys = [json.dumps(p, sort_keys=True) for p in train["prompt"]]
    by_prompt, rows_of, wanted = {}, {}, {}
    for key in keys:
        wanted[key] = wanted.get(key, 0) + 1
    for row, (prompt, texts) in enumerate(zip(anchors["prompt"], anchors[column])):
        key = json.dumps(prompt, sort_keys=True)
        rows_of.setdefault(key, []).append(row)
        if len(rows_of[key]) > max(wanted.get(key, 0), 1):
            shown = repr(prompt) if len(repr(prompt)) <= 80 else repr(prompt)[:77] + "..."
            raise ValueError(
                f"anchors_dataset {anchor_file(path)}: the prompt {shown} is present {len(rows_of[key])} times (rows "
                f"{', '.join(map(str, rows_of[key]))}) but {wanted.get(key, 0)} time(s) in the training set; give each "
                "prompt as often as the training set does (rerun `armor-trl anchors` on it).")
        pooled = by_prompt.setdefault(key, [])
        pooled += [text for text in ([texts] if isinstance(texts, str) else texts or []) if text not in pooled]
    missing = sum(key not in by_prompt for key in keys)
    if missing:
        raise ValueError(
            f"anchors_dataset {path!r} has no row for {missing} of the {len(keys)} training prompts: it was generated "
            "for another dataset or prompt format. Run `armor-trl anchors` with this recipe."
        )
    if column in train.column_names:
        train = train.remove_columns(column)
    return train.add_column(column, [by_prompt[key] for key in keys])
