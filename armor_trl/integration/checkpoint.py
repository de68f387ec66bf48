"""One checkpoint path for everything ARMOR adds to a run.

Every piece of state (the reference's counters and weights, the α / reset schedule, the anchor cache, the column
rotation, the refill sampler, the collapse guard) registers a ``state_dict`` / ``load_state_dict`` pair with
:class:`ArmorState` (and, for tensors, a pair that writes / reads files). After transformers has written its part of a
checkpoint, :meth:`ArmorState.save` writes the files, then ``armor_state.json`` last and atomically: its presence marks
a complete checkpoint, on every path (ARMOR on or off). It also holds the run's fingerprint (the settings the state
depends on), which a resume must match.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import safetensors.torch
import torch
from accelerate.utils import is_peft_model
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, logging

from armor_trl.integration import trl_seam as seam

logger = logging.get_logger(__name__)

STATE_FILE = "armor_state.json"
FORMAT = 2
# Files of checkpoints written before FORMAT 2 (read when resuming them).
LEGACY_REFILL_FILE = "armor_refill.json"
LEGACY_GUARD_FILE = "collapse_guard.json"


@dataclass
class Part:
    state_dict: Callable[[], object]
    load_state_dict: Callable[[object], None]
    save_files: Callable[[str, bool], None] | None = None  # (directory, write); collective under ZeRO-3
    load_files: Callable[[str], None] | None = None


def write_json_atomically(path: str, value) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump(value, f)
    os.replace(temporary, path)


def read_json(path: str):
    """A JSON file's content; an error names the file and what is wrong with it."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); the file is damaged.") from error


class ArmorState:
    """The registry of a run's ARMOR state: saved and restored together, in registration order."""

    def __init__(self):
        self.parts: dict[str, Part] = {}

    def register(self, name: str, state_dict, load_state_dict, save_files=None, load_files=None) -> None:
        if name in self.parts:
            raise ValueError(f"checkpoint state {name!r} is registered twice")
        self.parts[name] = Part(state_dict, load_state_dict, save_files, load_files)

    def save(self, directory: str, fingerprint: dict, write: bool = True) -> None:
        """Write every part into ``directory`` (an existing checkpoint folder), the state file last. Call on every
        process (files may be collective), with ``write`` on the one that writes."""
        for part in self.parts.values():
            if part.save_files is not None:
                part.save_files(directory, write)
        if write:
            state = {"format": FORMAT, "config": fingerprint,
                     "parts": {name: part.state_dict() for name, part in self.parts.items()}}
            write_json_atomically(os.path.join(directory, STATE_FILE), state)

    def load(self, directory: str, skip: tuple[str, ...] = ()) -> dict:
        """Restore every registered part (but those in ``skip``) from ``directory``; return the saved parts."""
        parts = read_state(directory)["parts"]
        unknown = sorted(name for name, state in parts.items() if state is not None and name not in self.parts)
        if unknown:  # e.g. a collapse guard's history or a refill stream this run has no part to continue
            raise ValueError(
                f"Checkpoint {directory} holds ARMOR state this run does not use ({', '.join(unknown)}): it was written "
                "with other settings. Resume with the settings it was written with."
            )
        for name, part in self.parts.items():
            if name in skip:
                continue
            if part.load_files is not None:
                part.load_files(directory)
            if parts.get(name) is not None:
                part.load_state_dict(parts[name])
        return parts


def read_state(directory: str) -> dict:
    """A checkpoint's ARMOR state (checkpoints of FORMAT 1 converted)."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        raise ValueError(
            f"Checkpoint {directory} has no {STATE_FILE}: it was not written (completely) by ArmorGRPOTrainer, so its "
            "ARMOR state cannot be restored. To start a new run from its weights, pass it as `model` (and "
            "`ref_model`) instead of resuming."
        )
    state = read_json(path)
    if state.get("format") == FORMAT:
        return state
    return _from_format_1(state, directory)


def _from_format_1(state: dict, directory: str) -> dict:
    """FORMAT 1 kept the reference's counters at the top level and the refill sampler / guard in files of their own."""
    reference = {key: state.get(key) for key in ("kind", "resets", "last_reset_step", "synced_step", "weights_step")}
    parts = {"reference": reference, "schedule": {"armor_started_at": state.get("armor_started_at", 0)},
             "anchor_cache": state.get("anchor_cache"), "column_anchors": state.get("column_anchors"),
             "collapse_guard": state.get("collapse_guard")}
    for name, file in (("refill", LEGACY_REFILL_FILE), ("collapse_guard", LEGACY_GUARD_FILE)):
        if os.path.exists(os.path.join(directory, file)):
            parts[name] = read_json(os.path.join(directory, file))
    return {"format": 1, "config": {"kind": state.get("kind"), **state.get("config", {})}, "parts": parts}


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """The checkpoint folders of a run folder, as (step, path), newest first."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        prefix, _, step = name.rpartition("-")
        if prefix == PREFIX_CHECKPOINT_DIR and step.isdigit() and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(step), os.path.join(output_dir, name)))
    return sorted(found, reverse=True)


def is_complete(checkpoint: str) -> bool:
    return os.path.exists(os.path.join(checkpoint, STATE_FILE))


def latest_complete_checkpoint(output_dir: str) -> tuple[str | None, list[str]]:
    """The newest checkpoint folder that holds ARMOR's state file, and the newer ones that do not (incomplete)."""
    incomplete = []
    for _, path in checkpoints(output_dir):
        if is_complete(path):
            return path, incomplete
        incomplete.append(path)
    return None, incomplete


UNORDERED_FIELDS = ("anchor_reward_funcs",)  # names of a set: their order does not change what a run does


def comparable(name: str, value):
    """A fingerprint value as it reads back from ``armor_state.json`` (tuples become lists), with the names of an
    ``UNORDERED_FIELDS`` field sorted: a tuple and the list it is saved as, or the same names in another order,
    compare equal."""
    value = json.loads(json.dumps(value))
    if name in UNORDERED_FIELDS and isinstance(value, list):
        return sorted(value, key=repr)
    return value


def check_fingerprint(checkpoint: str, expected: dict, defaults: dict | None = None) -> None:
    """Refuse to resume ``checkpoint`` when it was written with other settings than ``expected``. A field of
    ``defaults`` is compared both ways: missing on either side, it holds its default there. Values are compared as
    they read back from the state file (:func:`comparable`)."""
    saved, defaults = read_state(checkpoint)["config"], defaults or {}
    names = list(expected) + [name for name in saved if name in defaults and name not in expected]
    pairs = {name: (comparable(name, saved.get(name, defaults.get(name))),
                    comparable(name, expected.get(name, defaults.get(name)))) for name in names}
    differing = {name: (old, new) for name, (old, new) in pairs.items() if old != new}
    if differing:
        details = ", ".join(f"{k}: checkpoint {old!r} vs now {new!r}" for k, (old, new) in differing.items())
        raise ValueError(
            f"Cannot resume from {checkpoint}: it was written by a different ARMOR configuration ({details}). "
            "Resume with the same settings, or start a new run with the checkpoint as `model`/`ref_model`."
        )


# ArmorConfig fields a checkpoint's state depends on; a resumed run must share them. The later ones are written only
# when they differ from their default and compared both ways, a missing one counting as its default (so checkpoints
# written before a field existed resume while it stays at its default).
FINGERPRINT_FIELDS = (
    "use_anchors", "use_mixed_ratio", "num_generations", "anchor_num_samples", "anchor_reward_threshold",
    "anchor_filter", "anchor_cache", "anchor_cache_failures", "ref_reset_steps", "ref_reset_every_step_until",
)
LOOP_FIELDS = (
    "dynamic_sampling", "dynamic_sampling_keep_unsolved", "dynamic_sampling_max_rounds", "dynamic_sampling_refill",
    "advantage_quantile", "armor_alpha_decay_steps", "ref_reset_at_steps", "anchor_selection", "anchor_gate_only",
    "off_policy_ratio", "mask_negative_anchor_advantage", "anchor_reward_funcs", "anchors_per_group", "anchor_loss_weight",
    "anchor_source", "anchor_column", "anchor_cache_per_prompt", "collapse_guard", "advantage_quantile_interpolation",
    "collapse_guard_metric", "collapse_guard_drop", "collapse_guard_patience",  # the guard's history was judged by them
)


def fingerprint(args, reference_kind: str | None) -> dict:
    """The settings (of an ArmorConfig) a checkpoint's ARMOR state depends on; resuming with different ones is refused."""
    defaults = type(args).__dataclass_fields__
    values = {"kind": reference_kind, "armor_alpha": args.resolved_alpha,
              **{name: getattr(args, name) for name in FINGERPRINT_FIELDS}}
    values.update({name: getattr(args, name) for name in LOOP_FIELDS if getattr(args, name) != defaults[name].default})
    return values


def resolve_checkpoint(args, checkpoint, expected: dict, guard_output_dir: bool = True):
    """``train(resume_from_checkpoint=...)``'s checkpoint: the newest complete one in ``args.output_dir`` for ``True``
    (incomplete ones are skipped with a warning), checked against ``expected`` (:func:`fingerprint`). A fresh run
    (``checkpoint`` false) into an output_dir holding complete checkpoints is refused when ``guard_output_dir``, unless
    ``overwrite_output_dir``."""
    output_dir = args.output_dir
    if not checkpoint:
        if guard_output_dir and not args.overwrite_output_dir and any(latest_complete_checkpoint(output_dir)):
            raise ValueError(
                f"output_dir {output_dir} already holds checkpoints of an earlier run, which this run would "
                "overwrite. Resume it with train(resume_from_checkpoint=True), choose another output_dir, or set "
                "overwrite_output_dir=True."
            )
        return checkpoint
    if checkpoint is True:
        checkpoint, incomplete = latest_complete_checkpoint(output_dir)
        for path in incomplete:
            logger.warning(f"Skipping {path}: it is incomplete (the run stopped while writing it); left as is.")
        if checkpoint is None:
            raise ValueError(f"No complete ArmorGRPOTrainer checkpoint found in {output_dir}.")
    defaults = type(args).__dataclass_fields__
    check_fingerprint(checkpoint, expected, {name: defaults[name].default for name in LOOP_FIELDS})
    return checkpoint


def load_policy_weights(trainer, load, checkpoint: str, model=None) -> None:
    """The policy's weights from ``checkpoint``: through transformers' loader (``load``, ``Trainer.
    _load_from_checkpoint``), except where transformers saved them under other names than the model's
    (:func:`~armor_trl.integration.trl_seam.checkpoint_key_names`, e.g. a Qwen2-VL). transformers' loader reads those
    non-strictly under the model's names, so nothing would load and the run would train on from the initial
    weights: they are loaded here under the names they were saved from, and every weight must load."""
    policy = trainer.accelerator.unwrap_model(trainer.model if model is None else model)
    files = weight_files(checkpoint)
    names = None if not files or trainer.is_fsdp_enabled or is_peft_model(policy) else seam.checkpoint_key_names(policy)
    if names is None:
        load(checkpoint, model)
        return
    saved = {}
    for file in files:
        saved.update(safetensors.torch.load_file(file, device="cpu") if file.endswith(".safetensors")
                     else torch.load(file, map_location="cpu", weights_only=True))
    unknown = sorted(set(saved) - set(names))
    loaded = policy.load_state_dict({names[name]: tensor for name, tensor in saved.items() if name in names},
                                    strict=False)
    # a missing name is fine where it is tied to a weight that loaded (an lm_head sharing the embeddings')
    parameters = policy.state_dict(keep_vars=True)
    loaded_ids = {id(parameters[names[name]]) for name in saved if name in names}
    missing = [name for name in loaded.missing_keys if id(parameters[name]) not in loaded_ids]
    if unknown or missing:
        raise ValueError(f"Cannot resume the policy's weights from {checkpoint}: it was not saved from this "
                         f"{type(policy).__name__} (tensors without a place in it: {unknown[:3]}; its weights "
                         f"missing in the checkpoint: {missing[:3]}).")


def weight_files(checkpoint: str) -> list[str]:
    """The files of a checkpoint's full model weights (safetensors or torch, one file or sharded); none for an
    adapter's or a sharded FSDP checkpoint."""
    for single, index in ((SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME), (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)):
        if os.path.isfile(os.path.join(checkpoint, single)):
            return [os.path.join(checkpoint, single)]
        if os.path.isfile(os.path.join(checkpoint, index)):
            shards = sorted(set(read_json(os.path.join(checkpoint, index))["weight_map"].values()))
            return [os.path.join(checkpoint, shard) for shard in shards]
    return []
