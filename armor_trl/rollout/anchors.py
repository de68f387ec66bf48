"""Anchor Rollout bookkeeping (docs/algorithm.md, "1. Anchor Rollout"), as pure functions of indices and tensors.

Layout: a generation round holds groups of G consecutive rows with the same prompt. ARMOR keeps the
first G−m rows of each group for on-policy completions and the last m rows (``anchors_per_group``, 1 in
the paper) for anchors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SELECTIONS = ("correct", "any", "incorrect")


@dataclass
class AnchorRound:
    """The anchors of one generation round (this process's groups), as the steps after generation need them.

    ``found`` (anchor slots,) whether each slot holds a verified anchor (an empty slot holds a filler completion,
    which is no member of its group); ``has_anchor`` (groups,) whether the group found one; ``reward`` (anchor slots,)
    the anchor's weighted reward, NaN where none; ``rewards_per_func`` (anchor slots, reward functions) the scores of
    the anchors that were scored when they were picked (None: TRL scores them with the group, column anchors);
    ``candidates_verified`` (candidates,) the verdict on each fresh candidate; ``cache_hits`` (hits, groups that looked for an anchor);
    ``best_candidate_reward`` the highest weighted reward among the fresh candidates (NaN: none sampled);
    ``verifier_counts`` what the fresh candidates say about the verifier (:func:`verifier_counts`); ``eligible``
    (groups,) the groups that looked for an anchor, the others' fate not depending on one (None: every group,
    :mod:`~armor_trl.rollout.anchor_waves`); ``candidate_rows`` the candidate rows this process generated (padding for other
    processes included) and scored this round; ``deferred`` (groups,) the eligible groups whose candidates wait until
    the refill loop knows whether they train (None: none waits, :mod:`~armor_trl.rollout.deferred_anchors`).
    """

    found: torch.Tensor
    has_anchor: torch.Tensor
    reward: torch.Tensor
    candidates_verified: torch.Tensor
    cache_hits: torch.Tensor
    rewards_per_func: torch.Tensor | None = None
    column: bool = False
    best_candidate_reward: float = float("nan")  # the highest weighted reward of this round's fresh candidates
    verifier_counts: torch.Tensor | None = None  # verifier_counts() of the fresh candidates (None: column anchors)
    eligible: torch.Tensor | None = None  # (groups,) the groups that looked for an anchor (None: all of them)
    candidate_rows: torch.Tensor | None = None  # (2,) candidate rows generated and scored by this process this round
    deferred: torch.Tensor | None = None  # (groups,) the groups that draw after the refill loop (None: none)
    after_loop: bool = False  # the draw of a batch's deferred groups, after the refill loop (not a round's)


def anchor_rows(num_rows: int, num_generations: int, anchors_per_group: int = 1) -> list[int]:
    """Row indices of the anchor slots (the last ``anchors_per_group`` rows of each group)."""
    first = num_generations - anchors_per_group
    return [i for i in range(num_rows) if i % num_generations >= first]


def policy_rows(num_rows: int, num_generations: int, anchors_per_group: int = 1) -> list[int]:
    """Row indices of the on-policy slots (all but the anchor slots)."""
    first = num_generations - anchors_per_group
    return [i for i in range(num_rows) if i % num_generations < first]


def verified_mask(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, threshold: float, use_funcs: torch.Tensor | None = None
) -> torch.Tensor:
    """Which candidates are correct: the weighted total of the reward functions that apply reaches ``threshold``.

    A function returning None (NaN) does not apply to that candidate (TRL's multi-task convention) and is left
    out of the total; a candidate to which no function applies is never correct. ``use_funcs`` (F,) bool limits
    the decision to some functions (``anchor_reward_funcs``).
    """
    weighted, applies = verifier_totals(rewards_per_func, weights, use_funcs)
    return applies & (weighted >= threshold)


def verifier_totals(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, use_funcs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per candidate: the weighted total of the verifying reward functions that apply (None/NaN left out), and
    whether any of them applies."""
    rewards = rewards_per_func if use_funcs is None else rewards_per_func[:, use_funcs.to(rewards_per_func.device)]
    weights = weights if use_funcs is None else weights[use_funcs.to(weights.device)]
    weighted = (torch.nan_to_num(rewards) * weights.to(rewards)).sum(dim=1)
    return weighted, (~torch.isnan(rewards)).any(dim=1)


def verifier_counts(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, threshold: float, use_funcs: torch.Tensor | None = None,
    empty: torch.Tensor | None = None,
) -> torch.Tensor:
    """What a round's fresh candidates say about the verifier, as a (7,) float tensor: candidates, candidates some
    verifying function scored, verified candidates, scored candidates whose total lies outside [0, 1], the lowest and
    highest scored total (+inf / -inf when none was scored), and scored candidates that failed with a completion
    that is not empty (``empty``: (candidates,) bool, whether the completion's text is empty or blank; None: none is).
    Only these show a verifier saying "incorrect": any reward may score an empty completion 0 (``len(set(c))``)."""
    weighted, applies = verifier_totals(rewards_per_func, weights, use_funcs)
    scored = weighted[applies]
    failed = applies & (weighted < threshold)
    if empty is not None:
        failed = failed & ~empty.to(failed.device)
    return torch.tensor([
        float(len(weighted)), float(applies.sum()), float((applies & (weighted >= threshold)).sum()),
        float(((scored < 0) | (scored > 1)).sum()),
        scored.min().item() if len(scored) else math.inf, scored.max().item() if len(scored) else -math.inf,
        float(failed.sum()),
    ])


def select_anchors(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_candidates: int,
    threshold: float,
    anchors_per_group: int = 1,
    selection: str = "correct",
    use_funcs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``anchors_per_group`` candidates per group, in candidate order.

    ``rewards_per_func`` holds (groups × K, F) rewards, K consecutive candidates per group. ``selection``:
    ``"correct"`` takes verified candidates, ``"any"`` takes candidates regardless of their reward,
    ``"incorrect"`` takes candidates that are not verified.
    Returns (groups, anchors_per_group) tensors: the index in [0, K) or −1 where no eligible candidate was
    left, and the weighted reward of the pick (functions that apply; NaN where none was picked).
    """
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    verified = verified_mask(rewards_per_func, weights, threshold, use_funcs).view(-1, num_candidates)
    eligible = {"correct": verified, "any": torch.ones_like(verified), "incorrect": ~verified}[selection]
    weighted = (torch.nan_to_num(rewards_per_func) * weights.to(rewards_per_func)).sum(dim=1)
    weighted = weighted.view(-1, num_candidates)
    # eligible candidates first, each side in candidate order (a stable sort on "not eligible")
    order = torch.sort((~eligible).int(), dim=1, stable=True).indices[:, :anchors_per_group]
    found = eligible.gather(1, order)
    chosen = torch.where(found, order, torch.full_like(order, -1))
    reward = torch.where(found, weighted.gather(1, order), torch.full_like(weighted[:, :anchors_per_group], float("nan")))
    return chosen, reward


def fill_groups(policy_items: list, anchor_items: list, num_generations: int, anchors_per_group: int = 1) -> list:
    """Interleave G−m on-policy items per group with the group's m anchor items, in row order."""
    per_group = num_generations - anchors_per_group
    groups = len(anchor_items) // anchors_per_group
    if len(anchor_items) % anchors_per_group or len(policy_items) != per_group * groups:
        raise ValueError(
            f"expected {per_group} on-policy and {anchors_per_group} anchor items per group, got {len(policy_items)} "
            f"and {len(anchor_items)}"
        )
    rows = []
    for group in range(groups):
        rows.extend(policy_items[group * per_group : (group + 1) * per_group])
        rows.extend(anchor_items[group * anchors_per_group : (group + 1) * anchors_per_group])
    return rows


class AnchorCache:
    """Verified anchors per prompt, reused until the reference changes (the reviewers' replay buffer of anchors).

    A verified anchor is a sample of π_ref conditioned on R = 1; while π_ref is unchanged it stays one,
    so a prompt that already has one needs no new candidates. ``reference_version`` (the reset count)
    invalidates everything on a reset. Bounded: least recently used entries go first.

    It keeps up to ``per_prompt`` verified anchors per prompt and rotates among them; a prompt counts as a hit
    (no new candidates) once it holds ``per_prompt`` of them. ``per_prompt=1`` keeps one anchor per prompt.

    Optionally it also remembers *failures*: prompts whose K candidates were all unverified, with one
    of those candidates to fill the slot. A remembered failure is skipped for ``retry_every − 1``
    visits, then sampled again.
    """

    def __init__(self, max_entries: int, per_prompt: int = 1):
        from collections import OrderedDict

        self.max_entries, self.per_prompt = max_entries, per_prompt
        self.reference_version = 0
        self._entries: "OrderedDict[tuple, list[tuple[list[int], list[float]]]]" = OrderedDict()  # oldest anchor first
        self._turns: dict[tuple, int] = {}  # prompt -> anchors handed out (the rotation's position)
        self._failures: "OrderedDict[tuple, list]" = OrderedDict()  # prompt -> [filler completion, visits skipped]
        # prompt -> visits at which its group did not look (anchor_eligible_only) before the prompt had an entry:
        # the paper's path would have drawn and filled the cache at the first of them
        self._unlooked: "OrderedDict[tuple, int]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def sync(self, reference_version: int) -> None:
        """Drop every entry if the reference changed since they were stored."""
        if reference_version != self.reference_version:
            self._entries.clear()
            self._turns.clear()
            self._failures.clear()
            self._unlooked.clear()
            self.reference_version = reference_version

    def get(self, prompt_ids, partial: bool = False) -> tuple[list[int], list[float]] | None:
        """The prompt's next anchor in rotation, once it holds ``per_prompt`` of them (any number with ``partial``)."""
        key = tuple(prompt_ids)
        anchors = self._entries.get(key)
        if not anchors or (len(anchors) < self.per_prompt and not partial):
            return None
        self._entries.move_to_end(key)
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        return anchors[turn % len(anchors)]

    def put(self, prompt_ids, completion_ids: list[int], rewards: list[float]) -> None:
        """Add a verified anchor with its score per reward function; beyond ``per_prompt`` the prompt's oldest one
        goes."""
        key = tuple(prompt_ids)
        self._failures.pop(key, None)
        anchors = self._entries.setdefault(key, [])
        if all(ids != list(completion_ids) for ids, _ in anchors):
            anchors.append((list(completion_ids), [float(value) for value in rewards]))
        del anchors[: -self.per_prompt]
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._turns.pop(self._entries.popitem(last=False)[0], None)

    def completions(self) -> list[list[int]]:
        """Every anchor the cache holds (its completion ids)."""
        return [ids for anchors in self._entries.values() for ids, _ in anchors]

    def visit_unlooked(self, prompt_ids) -> None:
        """A visit of the prompt at which its group does not look for an anchor (``anchor_eligible_only``): what the
        paper's path, which looks in every group, does to the cache there, without drawing. A full entry is a hit
        there: its rotation moves on. A partial entry is drawn for again there and keeps what it holds. A prompt
        without an entry is drawn for there: the visit is counted, and :meth:`first_fill` starts the rotation where
        the paper's path, filled at the first such visit, would be. (A remembered failure is left as it is: docs/
        algorithm.md, "Which groups get candidates".)"""
        key = tuple(prompt_ids)
        anchors = self._entries.get(key)
        if anchors and len(anchors) >= self.per_prompt:
            self.get(prompt_ids)
        elif anchors:
            self._entries.move_to_end(key)
        elif key not in self._failures:
            self._unlooked[key] = self._unlooked.pop(key, 0) + 1
            while len(self._unlooked) > self.max_entries:
                self._unlooked.popitem(last=False)

    def first_fill(self, prompt_ids) -> tuple[list[int], list[float]] | None:
        """Right after the prompt's verified anchors were put: the anchor the paper's path hands out at this visit
        when it filled the entry at an earlier visit at which this group did not look (:meth:`visit_unlooked`), with
        the rotation moved on as there; None when there was no such visit or the entry is not full (the paper's path
        then draws again at every visit and picks the first verified candidate, as here)."""
        key = tuple(prompt_ids)
        unlooked = self._unlooked.pop(key, 0)
        anchors = self._entries.get(key)
        if not unlooked or not anchors or len(anchors) < self.per_prompt:
            return None
        # the paper's path: filled at the first unlooked visit (no turn), a hit at each later one and at this one
        self._turns[key] = unlooked - 1
        return self.get(prompt_ids)

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
        entries = [[list(k), ids, reward] for k, anchors in self._entries.items() for ids, reward in anchors]
        failures = [[list(k), filler, skipped] for k, (filler, skipped) in self._failures.items()]
        turns = [[list(k), turn] for k, turn in self._turns.items()]
        unlooked = [[list(k), visits] for k, visits in self._unlooked.items()]
        return {"reference_version": self.reference_version, "entries": entries, "failures": failures, "turns": turns,
                "unlooked": unlooked}

    def load_state_dict(self, state: dict) -> None:
        from collections import OrderedDict

        self._entries.clear()
        self._failures.clear()
        self.reference_version = state["reference_version"]
        for key, ids, rewards in state["entries"]:
            if isinstance(rewards, list):  # older checkpoints kept the total only: those entries are sampled anew
                self.put(key, ids, rewards)
        for key, filler, skipped in state.get("failures", []):
            self._failures[tuple(key)] = [filler, skipped]
        self._turns = {tuple(key): turn for key, turn in state.get("turns", [])}
        self._unlooked = OrderedDict((tuple(key), visits) for key, visits in state.get("unlooked", []))
