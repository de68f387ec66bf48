"""Dynamic sampling's refill: where extra prompts come from, and how kept groups of several rounds form one batch.

* :class:`RefillSampler` draws further training prompts when a generation round kept too few groups: a
  seeded stream of dataset indices (a fresh permutation per pass over the data), the same on every
  process, each process taking its own share. Its state is one counter, saved with each checkpoint (:mod:`.checkpoint`), so
  a resumed run draws the prompts an uninterrupted run would have drawn.
* :func:`take_rows` and :func:`concat_rows` cut rows out of the batch dicts that
  ``GRPOTrainer._generate_and_score_completions`` returns and join batches of different padded lengths
  (prompts are left-padded, completions right-padded, as TRL pads them); :func:`put_rows` overwrites some rows of
  such a batch (the deferred anchors, :mod:`~armor_trl.rollout.deferred_anchors`).
"""

from __future__ import annotations

import torch

from armor_trl.rollout.multimodal import concat_image_rows, take_image_rows

PROMPT_KEYS = ("prompt_ids", "prompt_mask")


class RefillSampler:
    """A seeded, resumable stream of dataset indices for refill rounds."""

    def __init__(self, dataset_size: int, seed: int):
        if dataset_size < 1:
            raise ValueError("dynamic sampling needs a non-empty training dataset to refill from.")
        self.dataset_size = dataset_size
        self.seed = seed
        self.drawn = 0  # indices consumed so far, over all processes
        self._permutation = (None, None)  # (epoch, its permutation)

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, self.dataset_size)
        if self._permutation[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._permutation = (epoch, torch.randperm(self.dataset_size, generator=generator).tolist())
        return self._permutation[1][offset]

    def draw(self, count: int, process_index: int = 0, num_processes: int = 1) -> list[int]:
        """``count`` indices for this process; every process must call it with the same ``count``."""
        start = self.drawn + process_index * count
        indices = [self._index(position) for position in range(start, start + count)]
        self.drawn += count * num_processes
        return indices

    def state_dict(self) -> dict:
        return {"dataset_size": self.dataset_size, "seed": self.seed, "drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        if (state["dataset_size"], state["seed"]) != (self.dataset_size, self.seed):
            raise ValueError(
                f"The checkpoint's refill stream was drawn from a dataset of {state['dataset_size']} rows with seed "
                f"{state['seed']}; this run has {self.dataset_size} rows and seed {self.seed}. Resume with the same "
                "training data and seed."
            )
        self.drawn = state["drawn"]


def take_rows(batch: dict, rows: list[int]) -> dict:
    """The given rows of every per-row tensor of ``batch`` (other entries are dropped)."""
    size = batch["completion_ids"].size(0)
    index = torch.tensor(rows, dtype=torch.long, device=batch["completion_ids"].device)
    taken = {k: v.index_select(0, index) for k, v in batch.items() if torch.is_tensor(v) and v.dim() and v.size(0) == size}
    taken.update(take_image_rows(batch, rows))  # a VLM batch: pixel_values per patch, image_grid_thw per image
    return taken


def _pad_to(tensor: torch.Tensor, length: int, value, left: bool) -> torch.Tensor:
    missing = length - tensor.size(1)
    if missing == 0:
        return tensor
    pad = tensor.new_full((tensor.size(0), missing, *tensor.shape[2:]), value)
    return torch.cat([pad, tensor] if left else [tensor, pad], dim=1)


def concat_rows(batches: list[dict], pad_token_id: int) -> dict:
    """Join the rows of ``batches`` (outputs of :func:`take_rows`) into one batch, re-padding to a common length."""
    joined = {}
    for key in batches[0]:
        parts = [batch[key] for batch in batches]
        if not torch.is_tensor(parts[0]):  # (num_images: concat_image_rows)
            continue
        if parts[0].dim() >= 2 and len({p.size(1) for p in parts}) > 1:
            width = max(p.size(1) for p in parts)
            value = pad_token_id if key in ("prompt_ids", "completion_ids") else 0
            parts = [_pad_to(p, width, value, left=key in PROMPT_KEYS) for p in parts]
        joined[key] = torch.cat(parts, dim=0)
    concat_image_rows(batches, joined)  # a VLM batch's image fields replace what the loop made of them
    return joined


def put_rows(batch: dict, rows: list[int], values: dict, pad_token_id: int) -> None:
    """Overwrite ``rows`` of ``batch`` with ``values`` (per-row tensors of some of its keys, one row each, in that
    order), in place. The completion side (every key but the prompt's whose second dimension is as wide as
    ``completion_ids``) is widened, right-padded, where the new rows are longer."""
    size, width = batch["completion_ids"].shape[:2]
    new_width = max(width, values["completion_ids"].size(1))
    index = torch.tensor(rows, dtype=torch.long, device=batch["completion_ids"].device)
    for key, tensor in list(batch.items()):
        if not (torch.is_tensor(tensor) and tensor.dim() and tensor.size(0) == size):
            continue
        aligned = tensor.dim() >= 2 and key not in PROMPT_KEYS and tensor.size(1) == width
        pad = pad_token_id if key == "completion_ids" else 0
        if aligned:
            tensor = _pad_to(tensor, new_width, pad, left=False)
        if key in values:
            value = values[key].to(device=tensor.device, dtype=tensor.dtype)
            if aligned:
                value = _pad_to(value, new_width, pad, left=False)
            tensor = tensor.index_copy(0, index.to(tensor.device), value)
        batch[key] = tensor
