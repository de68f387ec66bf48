"""The anchor cache: reuse verified anchors until the reference changes; bounded; hit rate logged."""

from datasets import Dataset

from armor_trl.rollout.anchors import AnchorCache
from testing import count_reference_rows, digit_share_reward, logged, make_trainer


def test_cache_is_lru_bounded_and_invalidated_by_a_new_reference():
    cache = AnchorCache(max_entries=2)
    cache.put([1, 2], [7], [1.0])
    cache.put([3], [8], [1.0])
    assert cache.get([1, 2]) == ([7], [1.0])  # touch: [3] is now the least recently used
    cache.put([4], [9], [1.0])
    assert len(cache) == 2 and cache.get([3]) is None and cache.get([1, 2]) is not None
    cache.sync(reference_version=0)
    assert len(cache) == 2
    cache.sync(reference_version=1)
    assert len(cache) == 0


def test_cache_state_round_trip():
    cache = AnchorCache(max_entries=5)
    cache.put([1], [2, 3], [0.5])
    cache.sync(0)
    restored = AnchorCache(max_entries=5)
    restored.load_state_dict(cache.state_dict())
    assert restored.get([1]) == ([2, 3], [0.5]) and restored.reference_version == 0


def two_prompts():
    return Dataset.from_dict({"prompt": ["1+2=", "3+4="] * 8})


def test_cached_prompts_sample_no_new_candidates(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, two_prompts(), tmp_path, reward_funcs=digit_share_reward,
        anchor_reward_threshold=0.01, anchor_cache=True, anchor_same_call=False, max_steps=4, num_generations=4, per_device_train_batch_size=8,
    )
    rows = count_reference_rows(monkeypatch, trainer)
    trainer.train()
    hits = logged(trainer, "armor/anchor_cache_hit_frac")
    assert hits[0] == 0.0 and hits[-1] == 1.0  # both prompts found their anchor in round 1, reused afterwards
    assert rows[0] == 2 * 4 and len(rows) < 4  # later rounds sampled nothing
    assert logged(trainer, "armor/anchor_found_frac")[-1] == 1.0


def test_a_reset_invalidates_the_cache(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, two_prompts(), tmp_path, reward_funcs=digit_share_reward,
        anchor_reward_threshold=0.01, anchor_cache=True, anchor_same_call=False, ref_reset_steps=1, max_steps=3,
    )
    rows = count_reference_rows(monkeypatch, trainer)
    trainer.train()
    assert logged(trainer, "armor/anchor_cache_hit_frac") == [0.0, 0.0, 0.0]
    assert rows == [8, 8, 8]


def test_cache_size_bound_is_respected(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, reward_funcs=digit_share_reward,
        anchor_reward_threshold=0.01, anchor_cache=True, anchor_cache_size=1, max_steps=2,
    )
    trainer.train()
    assert len(trainer.anchor_cache) == 1
    assert max(logged(trainer, "armor/anchor_cache_size")) == 1


def test_remembered_failures_are_skipped_then_retried():
    cache = AnchorCache(max_entries=4)
    cache.put_failure([5], [9, 9])
    assert cache.known_failure([5], retry_every=3) == [9, 9]  # 1st skipped visit
    assert cache.known_failure([5], retry_every=3) == [9, 9]  # 2nd
    assert cache.known_failure([5], retry_every=3) is None  # 3rd visit: due for a retry
    cache.put_failure([6], [1])
    cache.put([6], [2], [1.0])  # a later success replaces the failure
    assert cache.known_failure([6], retry_every=3) is None and cache.get([6]) == ([2], [1.0])
    cache.put_failure([7], [1])
    cache.sync(reference_version=1)  # a new reference: failures are forgotten too
    assert cache.known_failure([7], retry_every=3) is None


def test_remembering_failures_saves_reference_calls(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    def reward(completions, prompts, **kwargs):
        # "3+4=" can never be verified; "1+2=" almost always
        return [0.0 if p == "3+4=" else share for p, share in zip(prompts, digit_share_reward(completions))]

    calls = {}
    for remember in (False, True):
        trainer = make_trainer(
            tiny_model_path, tiny_tokenizer, two_prompts(), tmp_path / str(remember), reward_funcs=reward,
            anchor_reward_threshold=0.01, anchor_cache=True, anchor_cache_failures=remember,
            anchor_failure_retry_every=100, max_steps=6,
        )
        rows = count_reference_rows(monkeypatch, trainer)
        trainer.train()
        calls[remember] = len(rows)
        assert min(logged(trainer, "armor/anchor_found_frac")) < 1.0  # "3+4=" groups stay without anchor
    assert calls[True] < calls[False]
    assert calls[True] <= 2  # once per distinct prompt, at most


def test_failures_need_the_anchor_cache(tmp_path):
    from armor_trl import ArmorConfig
    from testing import cpu_args

    import pytest

    with pytest.raises(ValueError, match="anchor_cache_failures=True needs anchor_cache=True"):
        ArmorConfig(output_dir=str(tmp_path), anchor_cache_failures=True, **cpu_args())


# --- several anchors per prompt (anchor_cache_per_prompt) --------------------------------------------------------
def test_several_anchors_per_prompt_rotate_once_the_prompt_is_full():
    cache = AnchorCache(max_entries=4, per_prompt=2)
    cache.put([1], [10], [1.0])
    assert cache.get([1]) is None  # one of two: still sampled
    assert cache.get([1], partial=True) == ([10], [1.0])  # ... but usable when a round finds nothing
    cache.put([1], [10], [1.0])  # the same completion twice is kept once
    cache.put([1], [11], [0.9])
    assert [cache.get([1])[0] for _ in range(4)] == [[11], [10], [11], [10]]
    cache.put([1], [12], [1.0])  # beyond two: the oldest goes
    assert sorted(cache.get([1])[0] + cache.get([1])[0]) == [11, 12]
    restored = AnchorCache(max_entries=4, per_prompt=2)
    restored.load_state_dict(cache.state_dict())
    assert [restored.get([1]) for _ in range(3)] == [cache.get([1]) for _ in range(3)]  # rotation continues
    assert len(cache) == 1


def test_trainer_keeps_and_rotates_several_anchors(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    from testing import capture_rounds

    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, two_prompts(), tmp_path, reward_funcs=digit_share_reward,
        anchor_reward_threshold=0.01, anchor_cache=True, anchor_cache_per_prompt=2, max_steps=5, anchor_same_call=False,
    )
    rows = count_reference_rows(monkeypatch, trainer)
    rounds = capture_rounds(trainer)
    trainer.train()
    assert all(len(anchors) == 2 for anchors in trainer.anchor_cache._entries.values())
    assert len(rows) < 5 and logged(trainer, "armor/anchor_cache_hit_frac")[-1] == 1.0
    used = {}
    for out in rounds[len(rows):]:  # rounds served from the cache
        for slot in (3, 7):
            prompt = tuple(out["prompt_ids"][slot][out["prompt_mask"][slot].bool()].tolist())
            used.setdefault(prompt, []).append(out["completion_ids"][slot][out["completion_mask"][slot].bool()].tolist())
    for prompt, anchors in used.items():
        kept = [ids for ids, _ in trainer.anchor_cache._entries[prompt]]
        assert all(a in kept for a in anchors) and all(a != b for a, b in zip(anchors, anchors[1:]))
    assert sum(len(a) for a in used.values()) >= 4


def test_several_anchors_per_prompt_need_the_cache(tmp_path):
    import pytest

    from armor_trl import ArmorConfig
    from testing import cpu_args

    with pytest.raises(ValueError, match="anchor_cache_per_prompt > 1 needs anchor_cache=True"):
        ArmorConfig(output_dir=str(tmp_path), anchor_cache_per_prompt=2, **cpu_args())
    with pytest.raises(ValueError, match="anchor_cache_per_prompt must be"):
        ArmorConfig(output_dir=str(tmp_path), anchor_cache=True, anchor_cache_per_prompt=0, **cpu_args())


def visits_with_a_scripted_reference(trainer, looks_per_round):
    """Rounds of two groups (prompts "0+1=" and "1+2="), drawn through ``trainer.anchor_rollout.sample`` with π_ref's
    j-th candidate of a prompt fixed and verified for every j but 1 (so a prompt's first three verified anchors are
    its draws 0, 2, 3). ``looks_per_round``: per round, which groups are eligible (None: all look, the paper's
    path). Returns, per round, the anchor ids of the groups that looked."""
    import torch

    rollout = trainer.anchor_rollout

    def score_candidates(prompt_ids, inputs, k, candidate_ids=None):
        ids = [[100 + 10 * len(prompt) + j] for prompt in prompt_ids for j in range(k)]
        return ids, torch.tensor([[0.0 if j == 1 else 1.0] for _ in prompt_ids for j in range(k)])

    rollout._score_candidates = score_candidates
    prompt_ids = [[5, 6], [5, 6, 7]]
    anchors = []
    for looks in looks_per_round:
        eligible = None if looks is None else torch.tensor(looks)
        ids, _ = rollout.sample(prompt_ids, [{"prompt": "0+1="}, {"prompt": "1+2="}], eligible=eligible,
                                fillers=[[1], [2]])
        anchors.append([ids[g] if looks is None or looks[g] else None for g in range(2)])
    return anchors


def test_eligible_only_rotates_a_prompts_anchors_as_the_paper_path(tiny_model_path, tiny_tokenizer, tmp_path):
    # a prompt not eligible in some rounds: the paper's path looks anyway (a hit moves the rotation on; the first
    # visit fills the cache); eligible-only does not look, and its anchors at the visits that look must be the same
    pattern = [[False, True], [True, True], [True, False], [False, False], [True, True], [False, True], [True, True]]
    for per_prompt in (2, 3):
        common = dict(anchor_cache=True, anchor_cache_per_prompt=per_prompt, dynamic_sampling=True, max_steps=1)
        paper = visits_with_a_scripted_reference(
            make_trainer(tiny_model_path, tiny_tokenizer, two_prompts(), tmp_path / f"paper{per_prompt}", **common),
            [None] * len(pattern))
        eligible_only = visits_with_a_scripted_reference(
            make_trainer(tiny_model_path, tiny_tokenizer, two_prompts(), tmp_path / f"new{per_prompt}", **common),
            pattern)
        for looks, expected, got in zip(pattern, paper, eligible_only):
            assert got == [anchor if look else None for anchor, look in zip(expected, looks)], per_prompt
        assert len({tuple(a[0]) for a in paper}) == per_prompt  # the rotation went round all kept anchors
