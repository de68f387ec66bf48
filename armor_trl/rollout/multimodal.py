"""Vision-language rounds: every row generated and scored with its own prompt's images.

TRL tokenizes a round's prompts in one processor call: ``images`` holds each row's images and ``multimodal_fields``
the processor's tensors for the whole round (Qwen2-VL: ``pixel_values`` with one row per image patch, ``image_grid_thw``
with one row per image). ARMOR generates subsets of those rows (the on-policy rows, π_ref's candidates), so
:class:`RowMedia` cuts the fields into rows and joins the rows a call asks for. π_ref's log-probs take the batch's
image fields like TRL's own forward passes (:data:`FORWARD_KEYS`), and dynamic sampling moves rows between batches with
their images (:func:`take_image_rows`, :func:`concat_image_rows`).
"""

from __future__ import annotations

import torch

from armor_trl.integration import trl_seam as seam

# what TRL's output holds for a VLM batch and hands to _get_per_token_logps_and_entropies
FORWARD_KEYS = seam.LOGPS_IMAGE_FIELDS
IMAGE_INDEXED = ("image_grid_thw", "image_sizes", "image_position_ids")  # one entry per image
PER_TOKEN = ("token_type_ids", "mm_token_type_ids")  # (rows, prompt + completion tokens) in TRL's output
SUPPORTED = "models whose processor returns pixel_values with image_grid_thw (Qwen2-VL / Qwen2.5-VL family) or one row per image"


class RowMedia:
    """Each row's images and processor fields of one round, found by the row's prompt-ids list (the very object TRL
    tokenized: two rows with the same text and differently sized images are never confused)."""

    def __init__(self, prompt_ids: list, images: list | None, fields: dict):
        self.rows = {id(ids): row for row, ids in enumerate(prompt_ids)}
        self._keep = prompt_ids  # (the ids lists stay alive, so their ids stay theirs)
        self.images = images
        self.num_images = [len(x) if x else 0 for x in images] if images is not None else [0] * len(prompt_ids)
        fields = {key: as_tensor(value) for key, value in fields.items()}
        self.per_row = {key: split_rows(key, value, fields, self.num_images) for key, value in fields.items()}

    def select(self, prompt_ids: list) -> tuple[list | None, dict]:
        """(images, multimodal fields) of the rows whose prompt-ids lists are given, in that order."""
        try:
            rows = [self.rows[id(ids)] for ids in prompt_ids]
        except KeyError:
            raise RuntimeError("armor_trl: a generation call's prompt ids are not rows of this round, so their images "
                               "are unknown") from None
        images = None if self.images is None else [self.images[row] for row in rows]
        fields = {}
        for key, values in self.per_row.items():
            picked = [values[row] for row in rows]
            fields[key] = torch.cat(picked) if torch.is_tensor(picked[0]) else [x for part in picked for x in part]
        return images, fields


def as_tensor(value):
    """A processor's numpy array as a tensor (TRL's generation path takes either); other values as they are."""
    import numpy as np

    return torch.from_numpy(value) if isinstance(value, np.ndarray) else value


def split_rows(key: str, value, fields: dict, num_images: list[int]) -> list:
    """``value`` (the processor's field ``key`` for all rows) cut into one part per row."""
    rows = len(num_images)
    if key == "pixel_values" and "image_grid_thw" in fields:
        patches = fields["image_grid_thw"].prod(-1).tolist()
        per_row, start = [], 0
        for count in num_images:
            per_row.append(sum(patches[start : start + count]))
            start += count
        return list(torch.split(value, per_row))
    if torch.is_tensor(value) and (key in IMAGE_INDEXED or key == "pixel_values") and value.size(0) == sum(num_images):
        return list(torch.split(value, num_images))
    if torch.is_tensor(value) and value.dim() and value.size(0) == rows:
        return list(torch.split(value, 1))
    if isinstance(value, list) and len(value) == rows:
        return [[item] for item in value]
    raise ValueError(
        f"use_anchors=True cannot cut the processor's field {key!r} into rows (a round's rows are generated in parts). "
        f"Anchors support {SUPPORTED}."
    )


def forward_kwargs(output: dict) -> dict:
    """The image fields of a generation batch, as TRL passes them to its own log-prob forward passes."""
    return {key: output[key] for key in FORWARD_KEYS if key in output}


# --- dynamic sampling: rows of a VLM batch ---------------------------------------------------------------------------
def take_image_rows(batch: dict, rows: list[int]) -> dict:
    """The image fields of ``rows`` of ``batch`` (TRL's output): pixel_values and image_grid_thw per image,
    num_images per row."""
    if "num_images" not in batch:
        return {}
    num_images, taken = batch["num_images"], {"num_images": [batch["num_images"][row] for row in rows]}
    for key in ("pixel_values", *IMAGE_INDEXED):
        if key in batch:
            parts = split_rows(key, batch[key], batch, num_images)
            taken[key] = torch.cat([parts[row] for row in rows])
    return taken


def concat_image_rows(batches: list[dict], joined: dict) -> None:
    """Join the image fields of ``batches`` (outputs of take_rows) into ``joined``; per-token fields are re-padded
    around their prompt / completion boundary (prompts left-padded, completions right-padded, as TRL pads them)."""
    if "num_images" not in batches[0]:
        return
    joined["num_images"] = [n for batch in batches for n in batch["num_images"]]
    for key in ("pixel_values", *IMAGE_INDEXED):
        if key in batches[0]:
            joined[key] = torch.cat([batch[key] for batch in batches])
    for key in PER_TOKEN:
        if key in batches[0]:
            width = max(batch["prompt_ids"].size(1) for batch in batches)
            length = max(batch["completion_ids"].size(1) for batch in batches)
            parts = []
            for batch in batches:
                prompt, completion = batch[key].split([batch["prompt_ids"].size(1), batch["completion_ids"].size(1)], 1)
                prompt = torch.cat([prompt.new_zeros(prompt.size(0), width - prompt.size(1)), prompt], dim=1)
                completion = torch.cat([completion, completion.new_zeros(completion.size(0), length - completion.size(1))],
                                       dim=1)
                parts.append(torch.cat([prompt, completion], dim=1))
            joined[key] = torch.cat(parts)
