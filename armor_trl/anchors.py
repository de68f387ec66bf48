"""Anchor Rollout bookkeeping (ARMOR.md, "Anchor Rollout"), as pure functions of indices and tensors.

Layout: a generation round holds groups of G consecutive rows with the same prompt. ARMOR keeps the
first G−1 rows of each group for on-policy completions and the last row for the anchor.
"""

from __future__ import annotations

import torch


def anchor_rows(num_rows: int, num_generations: int) -> list[int]:
    """Row index of the anchor slot of each group (the group's last row)."""
    return list(range(num_generations - 1, num_rows, num_generations))


def policy_rows(num_rows: int, num_generations: int) -> list[int]:
    """Row indices of the on-policy slots (all but each group's last row)."""
    return [i for i in range(num_rows) if i % num_generations != num_generations - 1]


def verified_mask(rewards_per_func: torch.Tensor, weights: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which candidates are correct: weighted total reward ≥ threshold, and no reward function returned None (NaN)."""
    weighted = (rewards_per_func * weights.to(rewards_per_func)).sum(dim=1)
    return ~torch.isnan(rewards_per_func).any(dim=1) & (weighted >= threshold)


def select_anchors(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, num_candidates: int, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the first verified candidate of each group.

    ``rewards_per_func`` holds (groups × K, F) rewards, K consecutive candidates per group.
    Returns (index in [0, K) or −1 where none is verified, weighted reward of the pick or NaN).
    """
    verified = verified_mask(rewards_per_func, weights, threshold).view(-1, num_candidates)
    weighted = (rewards_per_func * weights.to(rewards_per_func)).sum(dim=1).view(-1, num_candidates)
    found = verified.any(dim=1)
    first = verified.int().argmax(dim=1)  # first True; 0 when none (masked below)
    chosen = torch.where(found, first, torch.full_like(first, -1))
    reward = torch.where(found, weighted.gather(1, first.unsqueeze(1)).squeeze(1), torch.full_like(weighted[:, 0], float("nan")))
    return chosen, reward


def fill_groups(policy_items: list, anchor_items: list, num_generations: int) -> list:
    """Interleave G−1 on-policy items per group with the group's anchor item, in row order."""
    per_group = num_generations - 1
    if len(policy_items) != per_group * len(anchor_items):
        raise ValueError(f"expected {per_group} on-policy items per anchor, got {len(policy_items)} for {len(anchor_items)}")
    rows = []
    for group, anchor in enumerate(anchor_items):
        rows.extend(policy_items[group * per_group : (group + 1) * per_group])
        rows.append(anchor)
    return rows


class AnchorCache:
    """Verified anchors per prompt, reused until the reference changes (ARMOR.md: a replay buffer of anchors).

    A verified anchor is a sample of π_ref conditioned on R = 1; while π_ref is unchanged it stays one,
    so a prompt that already has one needs no new candidates. ``reference_version`` (the reset count)
    invalidates everything on a reset. Bounded: least recently used entries go first.

    Optionally it also remembers *failures*: prompts whose K candidates were all unverified, with one
    of those candidates to fill the slot. A remembered failure is skipped for ``retry_every − 1``
    visits, then sampled again.
    """

    def __init__(self, max_entries: int):
        from collections import OrderedDict

        self.max_entries = max_entries
        self.reference_version = 0
        self._entries: "OrderedDict[tuple, tuple[list[int], float]]" = OrderedDict()
        self._failures: "OrderedDict[tuple, list]" = OrderedDict()  # prompt -> [filler completion, visits skipped]

    def __len__(self) -> int:
        return len(self._entries)

    def sync(self, reference_version: int) -> None:
        """Drop every entry if the reference changed since they were stored."""
        if reference_version != self.reference_version:
            self._entries.clear()
            self._failures.clear()
            self.reference_version = reference_version

    def get(self, prompt_ids) -> tuple[list[int], float] | None:
        key = tuple(prompt_ids)
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, prompt_ids, completion_ids: list[int], reward: float) -> None:
        key = tuple(prompt_ids)
        self._failures.pop(key, None)
        self._entries[key] = (list(completion_ids), float(reward))
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def known_failure(self, prompt_ids, retry_every: int) -> list[int] | None:
        """The filler completion of a remembered failure to skip now, or None (unknown, or due for a retry)."""
        key = tuple(prompt_ids)
        entry = self._failures.get(key)
        if entry is None:
            return None
        entry[1] += 1
        if entry[1] >= retry_every:
            del self._failures[key]
            return None
        return entry[0]

    def put_failure(self, prompt_ids, filler_ids: list[int]) -> None:
        key = tuple(prompt_ids)
        self._failures[key] = [list(filler_ids), 0]
        self._failures.move_to_end(key)
        while len(self._failures) > self.max_entries:
            self._failures.popitem(last=False)

    def state_dict(self) -> dict:
        entries = [[list(k), ids, reward] for k, (ids, reward) in self._entries.items()]
        failures = [[list(k), filler, skipped] for k, (filler, skipped) in self._failures.items()]
        return {"reference_version": self.reference_version, "entries": entries, "failures": failures}

    def load_state_dict(self, state: dict) -> None:
        self._entries.clear()
        self._failures.clear()
        self.reference_version = state["reference_version"]
        for key, ids, reward in state["entries"]:
            self.put(key, ids, reward)
        for key, filler, skipped in state.get("failures", []):
            self._failures[tuple(key)] = [filler, skipped]
