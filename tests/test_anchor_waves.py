"""Candidates only for eligible groups, drawn lazily in waves: the rule, and proofs that the algorithm did not change.

* the eligibility rule per setting (dynamic sampling, the gate, keep_unsolved, gate-only);
* with a deterministic fake generator (the j-th draw of a prompt is a fixed completion), the kept groups, their
  anchors, the gate's decisions and the loss are those of the paper's eager path (every group, K candidates at once),
  and fewer candidate rows are generated;
* statistically (fixed seeds): the found rate and the anchor distribution of waves match all-K-at-once sampling;
* no reward function runs twice on a row; processes agree on the number of rows of every collective call.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

from armor_trl.rollout import anchor_waves
from armor_trl.rollout.anchor_waves import eligible_groups, filters_groups
from armor_trl.rollout.anchors import select_anchors
import testing
from testing import (
    capture_rounds, has_digit_reward, logged, make_trainer, numbers_dataset, trainable_state, with_a_busier_process,
)

G, K = 4, 4


def rule(**fields):
    defaults = dict(anchor_eligible_only=True, dynamic_sampling=True, anchor_filter="drop",
                    dynamic_sampling_keep_unsolved=False, anchor_gate_only=False, anchor_reward_threshold=1.0)
    return SimpleNamespace(**{**defaults, **fields})


# on-policy correctness of four groups: all correct, all wrong, mixed, nothing scored
CORRECTNESS = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0], [math.nan] * 3])


@pytest.mark.parametrize("fields, slots, expected", [
    (dict(), 1, [False, False, True, False]),  # the authors' gate: all-equal groups are dropped anyway
    (dict(anchor_filter="keep"), 1, [False, False, True, False]),  # the anchor joins (and changes) mixed groups
    (dict(dynamic_sampling_keep_unsolved=True), 1, [False, True, True, True]),  # an anchor keeps an unsolved group
    (dict(anchor_filter="keep", dynamic_sampling_keep_unsolved=True), 1, [False, True, True, True]),
    (dict(dynamic_sampling=False), 1, [True] * 4),  # no dynamic sampling: the anchor is a member of every group
    (dict(dynamic_sampling=False, anchor_filter="keep"), 1, [True] * 4),  # an all-failed group: the anchor rescues it
    (dict(dynamic_sampling=False, anchor_gate_only=True), 0, [True] * 4),  # the gate alone decides
    (dict(dynamic_sampling=False, anchor_gate_only=True, anchor_filter="keep"), 0, [False] * 4),  # decides nothing
    (dict(anchor_gate_only=True), 0, [False, False, True, False]),
    (dict(anchor_gate_only=True, anchor_filter="keep"), 0, [False] * 4),  # kept or not by the on-policy rows alone
])
def test_the_eligibility_rule_per_setting(fields, slots, expected):
    assert eligible_groups(CORRECTNESS, rule(**fields), slots).tolist() == expected


def test_which_settings_score_the_on_policy_rows_first():
    assert filters_groups(rule())
    assert not filters_groups(rule(anchor_eligible_only=False))
    assert not filters_groups(rule(dynamic_sampling=False))  # every group eligible: nothing to decide first
    assert filters_groups(rule(dynamic_sampling=False, anchor_gate_only=True, anchor_filter="keep"))


# --- a deterministic fake generator ----------------------------------------------------------------------------------
class FakeGenerator:
    """Every draw a fixed completion: the policy's j-th on-policy row of prompt n in round r, π_ref's j-th draw of
    prompt n in a round. On-policy rows: all correct (n % 3 == 0), all wrong (1), mixed (2). π_ref's j-th draw is
    verified (holds a digit) iff j >= n % 5 (n % 5 == 4: never within K = 4); it names j, so an anchor shows which
    draw it was."""

    def __init__(self, tokenizer):
        self.digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
        self.letters = tokenizer.convert_tokens_to_ids(list("abcxyz"))
        self.tokenizer = tokenizer
        self.round, self.drawn, self.reference_rows, self.reference_calls = -1, {}, 0, 0

    def start_round(self):
        self.round += 1
        self.drawn = {}

    def start_deferred_draw(self):
        """π_ref's draws after the refill loop count from 0 for each group, as in the round it came from."""
        self.drawn = {key: j for key, j in self.drawn.items() if not key[0]}

    def __call__(self, trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        reference = trainer.reference is not None and trainer.model_wrapped is trainer.reference.model
        self.reference_calls += reference
        out = []
        for ids in prompt_ids:
            n = int(self.tokenizer.decode(ids, skip_special_tokens=True).split("+")[0])
            key = (reference, tuple(ids))
            j = self.drawn.get(key, 0)
            self.drawn[key] = j + 1
            if reference:
                self.reference_rows += 1
                first = self.digits[j] if j >= n % 5 else self.letters[j % len(self.letters)]
                out.append([first, self.letters[(n + j) % 6], self.letters[j % 6]])
            else:
                correct = n % 3 == 0 or (n % 3 == 2 and j % 2 == 0)
                token = self.digits[(n + self.round) % 10] if correct else self.letters[(n + j) % 6]
                out.append([token, self.letters[(j + self.round) % 6], self.letters[n % 6]])
        return out, None


def run(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch, numbers=range(40), **fields):
    fake = FakeGenerator(tiny_tokenizer)
    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", lambda trainer, *args, **kw: fake(trainer, *args, **kw))
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset(numbers), tmp_path, reward_funcs=has_digit_reward,
        max_steps=3, dynamic_sampling=True, anchor_same_call=False, anchor_num_samples=K, **fields,
    )
    generate, deferred = trainer.anchor_rollout.generate, trainer.anchor_rollout.deferred_anchors
    trainer.anchor_rollout.generate = lambda *args: fake.start_round() or generate(*args)
    trainer.anchor_rollout.deferred_anchors = lambda *args: fake.start_deferred_draw() or deferred(*args)
    batches = capture_rounds(trainer)
    trainer.train()
    return trainer, batches, fake


def kept_rows(batch):
    return testing.kept_rows(batch, digits=6)


GATES = ("armor/groups_kept_frac", "armor/dropped_all_correct_frac", "armor/dropped_all_wrong_frac",
         "armor/dropped_no_anchor_frac", "armor/generation_rounds", "armor/batch_short_groups")


@pytest.mark.parametrize("fields", [
    dict(),  # the authors' gate
    dict(anchor_filter="keep"),
    dict(dynamic_sampling_keep_unsolved=True),
    dict(anchors_per_group=2),  # half-group style: two picks per group
    dict(anchor_cache=True),
    dict(anchor_cache=True, ref_reset_steps=1),  # the cache is emptied at every reset
], ids=["gate", "keep", "keep_unsolved", "two_anchors", "cache", "cache_resets"])
@pytest.mark.parametrize("sampling, eligible_only", [("eager", True), ("lazy", True), ("lazy", False)])
def test_kept_groups_anchors_gate_and_loss_equal_the_eager_path(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch,
                                                                fields, sampling, eligible_only):
    paper, paper_batches, paper_fake = run(tiny_model_path, tiny_tokenizer, tmp_path / "eager", monkeypatch,
                                           anchor_sampling="eager", anchor_eligible_only=False, **fields)
    new, new_batches, new_fake = run(tiny_model_path, tiny_tokenizer, tmp_path / "new", monkeypatch,
                                     anchor_sampling=sampling, anchor_eligible_only=eligible_only, **fields)
    assert len(paper_batches) == len(new_batches) == 3
    anchors_seen = 0
    for expected, got in zip(paper_batches, new_batches):
        assert kept_rows(got) == kept_rows(expected)  # the same groups, the same anchors, the same advantages
        assert got["num_items_in_batch"] == expected["num_items_in_batch"]
        anchors_seen += sum(flag for *_, flag in kept_rows(got))
    assert anchors_seen > 0
    for key in GATES + ("loss", "grad_norm", "armor/policy_reward_mean"):  # the gate's decisions, the loss, its gradient
        assert len(logged(paper, key)) == 3 and logged(new, key) == pytest.approx(logged(paper, key), abs=1e-6), key
    assert all(norm > 0 for norm in logged(paper, "grad_norm"))
    before, after = trainable_state(paper), trainable_state(new)
    assert all(torch.allclose(before[n], after[n], atol=1e-6) for n in before)
    # and the work: never more candidate rows than the paper's path, fewer here
    assert new_fake.reference_rows < paper_fake.reference_rows
    assert new.anchor_rollout.counts["candidate_rows"] == new_fake.reference_rows
    assert paper.anchor_rollout.counts["candidate_rows"] == paper_fake.reference_rows


@pytest.mark.parametrize("fields", [
    dict(anchor_filter="keep"),
    dict(anchor_filter="keep", dynamic_sampling_keep_unsolved=True),  # unsolved groups still draw in their round
    dict(anchor_filter="keep", anchors_per_group=2),
    dict(anchor_filter="keep", anchor_cache=True, ref_reset_steps=2),
    dict(anchor_filter="keep", per_device_train_batch_size=16),  # 4 groups a round: rounds keep more than needed
    # six prompts visited again and again: the cache's rotation over visits (a group looks at the cache in its round)
    dict(anchor_filter="keep", anchor_cache=True, anchor_cache_per_prompt=3, numbers=[5, 20, 3, 4]),
], ids=["keep", "keep_unsolved", "two_anchors", "cache", "wide", "cache_rotation"])
@pytest.mark.parametrize("sampling", ["eager", "lazy"])
def test_deferred_candidates_train_what_the_paper_path_trains_with_one_call_per_batch(
        tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch, fields, sampling):
    """Groups kept whatever their anchor draw after the refill loop, for the final batch only (anchor_deferred): the
    kept groups, their anchors, the gate's decisions and the loss are the paper path's, with fewer candidate rows
    and, where no group's keep decision depends on its anchor, one candidate call per rollout batch."""
    paper, paper_batches, paper_fake = run(tiny_model_path, tiny_tokenizer, tmp_path / "paper", monkeypatch,
                                           anchor_sampling="eager", anchor_eligible_only=False, **fields)
    new, new_batches, fake = run(tiny_model_path, tiny_tokenizer, tmp_path / "deferred", monkeypatch,
                                 anchor_sampling=sampling, **fields)
    in_round, _, in_round_fake = run(tiny_model_path, tiny_tokenizer, tmp_path / "in_round", monkeypatch,
                                     anchor_sampling=sampling, anchor_deferred=False, **fields)
    anchors_seen = 0
    for expected, got in zip(paper_batches, new_batches):
        assert kept_rows(got) == kept_rows(expected)
        assert got["num_items_in_batch"] == expected["num_items_in_batch"]
        assert "armor_deferred" not in got
        anchors_seen += sum(flag for *_, flag in kept_rows(got))
    assert len(new_batches) == 3 and anchors_seen > 0
    for key in GATES + ("loss", "grad_norm", "armor/policy_reward_mean"):
        assert len(logged(paper, key)) == 3 and logged(new, key) == pytest.approx(logged(paper, key), abs=1e-6), key
    before, after = trainable_state(paper), trainable_state(new)
    assert all(torch.allclose(before[n], after[n], atol=1e-6) for n in before)
    counts = new.anchor_rollout.counts
    assert counts["deferred_groups"] > 0 and counts["deferred_calls"] <= 3  # at most one draw per rollout batch
    assert counts["candidate_rows"] == fake.reference_rows <= in_round_fake.reference_rows < paper_fake.reference_rows
    if "per_device_train_batch_size" in fields:  # groups a round kept beyond the batch's need drew nothing
        assert fake.reference_rows < in_round_fake.reference_rows
    if not fields.get("dynamic_sampling_keep_unsolved") and not fields.get("anchor_cache"):
        # nothing draws in a round: one candidate call per rollout batch (lazy: one per wave, up to K)
        assert counts["eligible_groups"] == 0
        assert fake.reference_calls == 3 if sampling == "eager" else 3 <= fake.reference_calls <= 3 * K
        assert in_round_fake.reference_calls > fake.reference_calls
    assert set(logged(new, "armor/anchor_deferred_frac")) and all(0 < v <= 1 for v in
                                                                   logged(new, "armor/anchor_deferred_frac"))


def test_the_authors_gate_defers_nothing(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch):
    # anchor_filter="drop": a mixed group without an anchor is dropped, so every eligible group draws in its round
    new, _, fake = run(tiny_model_path, tiny_tokenizer, tmp_path / "gate", monkeypatch)
    assert new.anchor_rollout.counts["deferred_groups"] == 0 and new.anchor_rollout.counts["eligible_groups"] > 0
    assert logged(new, "armor/anchor_deferred_frac") == []


def test_gate_only_with_keep_draws_no_candidate_and_trains_the_same(tiny_model_path, tiny_tokenizer, tmp_path,
                                                                      monkeypatch):
    # anchor_gate_only + anchor_filter="keep": the anchor neither joins a group nor gates it, so nothing depends on it
    common = dict(anchor_gate_only=True, anchor_filter="keep", anchor_fail_after_rounds=0)
    paper, paper_batches, paper_fake = run(tiny_model_path, tiny_tokenizer, tmp_path / "eager", monkeypatch,
                                           anchor_eligible_only=False, **common)
    new, new_batches, fake = run(tiny_model_path, tiny_tokenizer, tmp_path / "new", monkeypatch, **common)
    assert paper_fake.reference_rows > 0 and fake.reference_rows == 0
    assert new.anchor_rollout.counts["candidate_rows"] == 0
    assert set(logged(new, "armor/anchor_eligible_frac")) == {0.0}
    for expected, got in zip(paper_batches, new_batches):
        assert kept_rows(got) == kept_rows(expected)
    for key in GATES + ("loss", "grad_norm"):
        assert len(logged(paper, key)) == 3 and logged(new, key) == pytest.approx(logged(paper, key), abs=1e-6), key


# --- waves against all K at once, statistically ----------------------------------------------------------------------
CONTENTS = torch.softmax(torch.linspace(-1.0, 1.0, 10), dim=0)  # π_ref's distribution over ten completions
VERIFIED = {2, 5, 9}  # the completions that pass: p = 0.29 per draw


class FakeRollout:
    """What draw_in_waves needs of an AnchorRollout: one process, π_ref drawing one of ten completions per row."""

    def __init__(self, seed, selection="correct", processes=None):
        self.generator = torch.Generator().manual_seed(seed)
        self.rows_per_call = []
        accelerator = SimpleNamespace(num_processes=1, device="cpu", gather=None)
        if processes is not None:  # another process's pending counts, wave by wave
            accelerator.num_processes, others = 2, iter(processes)
            accelerator.gather = lambda t: torch.cat([t, torch.tensor([next(others)])])
        self.trainer = SimpleNamespace(reward_weights=torch.ones(1), accelerator=accelerator, use_vllm=False,
                                       reference_server=None)
        self.args = SimpleNamespace(anchor_reward_threshold=1.0, anchor_selection=selection)
        self.funcs = None

    def _reference_candidates(self, prompt_ids, k):
        self.rows_per_call.append(len(prompt_ids))
        return [[int(torch.multinomial(CONTENTS, 1, generator=self.generator))] for _ in prompt_ids]

    def _score_candidates(self, prompt_ids, inputs, k, ids):
        return ids, torch.tensor([[float(ids[0] in VERIFIED)] for ids in ids])


def eager_anchors(rollout, groups, k=K):
    ids, rewards = rollout._score_candidates(None, None, k, rollout._reference_candidates([[0]] * (groups * k), k))
    chosen, _ = select_anchors(rewards, torch.ones(1), k, 1.0, 1, rollout.args.anchor_selection)
    return [ids[g * k + int(c)][0] if c >= 0 else None for g, c in enumerate(chosen[:, 0])], groups * k


def lazy_anchors(rollout, groups, k=K):
    ids, rewards, drawn, generated, _ = anchor_waves.draw_in_waves(rollout, [[0]] * groups, [{}] * groups,
                                                                   list(range(groups)), k, None, 1)
    chosen, _ = select_anchors(rewards, torch.ones(1), k, 1.0, 1, rollout.args.anchor_selection)
    assert all(drawn[g * k + int(c)] for g, c in enumerate(chosen[:, 0]) if c >= 0)  # never an undrawn pick
    return [ids[g * k + int(c)][0] if c >= 0 else None for g, c in enumerate(chosen[:, 0])], generated


def distribution(anchors):
    found = [a for a in anchors if a is not None]
    return torch.bincount(torch.tensor(found), minlength=10).float() / len(found), len(found) / len(anchors)


@pytest.mark.parametrize("selection", ["correct", "incorrect"])
def test_waves_find_as_often_and_pick_the_same_distribution_as_all_k_at_once(selection):
    """20 000 groups each way, independent seeds. Tolerances: found rate within 0.015 (its standard error is 0.003 per
    side, so about 3.5 standard errors of the difference), the anchor distribution within 0.02 in total variation
    (about 4 expected sampling errors at ~15 000 anchors over 10 values), both also against the exact values."""
    groups = 20_000
    eager, eager_rows = eager_anchors(FakeRollout(0, selection), groups)
    lazy, lazy_rows = lazy_anchors(FakeRollout(1, selection), groups)
    (eager_dist, eager_found), (lazy_dist, lazy_found) = distribution(eager), distribution(lazy)
    passing = torch.tensor([(i in VERIFIED) == (selection == "correct") for i in range(10)])
    p = CONTENTS[passing].sum().item()
    exact_found, exact_dist = 1 - (1 - p) ** K, torch.where(passing, CONTENTS, 0.0) / p
    assert abs(eager_found - lazy_found) < 0.015 and abs(lazy_found - exact_found) < 0.015
    assert 0.5 * (eager_dist - lazy_dist).abs().sum() < 0.02
    assert 0.5 * (lazy_dist - exact_dist).abs().sum() < 0.02
    # the work: K rows per group at once, E = (1 - (1 - p)^K) / p rows per group in waves
    assert eager_rows == K * groups
    assert lazy_rows / groups == pytest.approx(exact_found / p, rel=0.02)


def test_every_wave_takes_the_largest_count_of_any_process():
    # the other process still needs 3, 2, 1 and then 0 draws: this one pads its waves to those counts
    rollout = FakeRollout(0, processes=[3, 2, 1, 0])
    rollout.args.anchor_reward_threshold = math.inf  # nothing passes here: every local group draws all K
    ids, rewards, drawn, generated, scored = anchor_waves.draw_in_waves(rollout, [[0]] * 2, [{}] * 2, [0, 1], K, None,
                                                                        1)
    assert rollout.rows_per_call == [3, 2, 2, 2]  # max(local 2, other's) per wave; local needs K = 4 waves
    assert generated == scored == 9 and drawn.tolist() == [True] * (2 * K)  # padding: generated, scored, not kept
    rollout = FakeRollout(0, processes=[0, 0, 0, 0])
    anchor_waves.draw_in_waves(rollout, [[0]], [{}], [], K, None, 1)  # nothing local: it stops when no process draws
    assert rollout.rows_per_call == []


# --- scoring: once per row ---------------------------------------------------------------------------------------------
def counting_reward(calls):
    def digit(completions, **kwargs):
        calls.append(len(completions))
        return has_digit_reward(completions)

    return digit


@pytest.mark.parametrize("sampling, chat", [("eager", False), ("lazy", False), ("lazy", True)])
def test_no_reward_function_runs_twice_on_a_row(tiny_model_path, tiny_tokenizer, tmp_path, sampling, chat):
    calls = []
    data = numbers_dataset(range(40))
    if chat:  # chat prompts: the completions handed to the reward functions are messages, decoded as TRL does
        data = data.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, data, tmp_path,
                           reward_funcs=counting_reward(calls), max_steps=2, dynamic_sampling=True,
                           anchor_sampling=sampling, anchor_fail_after_rounds=0)
    rounds = []
    score = trainer._score_round
    trainer._score_round = lambda inputs: rounds.append(len(inputs)) or score(inputs)
    trainer.train()
    counts = trainer.anchor_rollout.counts
    on_policy_rows = sum(rows // G * (G - 1) for rows in rounds)
    # every on-policy row scored once (before the candidates, reused by TRL's scoring), every candidate once
    assert sum(calls) == on_policy_rows + counts["candidates_scored"]
    assert counts["rounds"] == len(rounds) and counts["eligible_groups"] <= counts["groups"]


def test_scores_are_not_reused_for_other_rows(tiny_model_path, tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(range(8)), tmp_path, dynamic_sampling=True)
    early = anchor_waves.OnPolicyScores([[5, 6]], ["ab"], torch.tensor([[1.0]]))
    assert early.reuse(trainer, ["ab"], [[5, 6]]) is early.rewards
    assert early.reuse(trainer, ["ab"], [[5, 7]]) is None  # other ids: TRL scores them
    assert early.reuse(trainer, ["a b"], [[5, 6]]) is None  # decoded otherwise: TRL scores them
    # the same completion with other fields (a rollout_func's extra field, a row carried over): TRL scores it
    fields = anchor_waves.OnPolicyScores([[5, 6]], ["ab"], torch.tensor([[1.0]]), [{"prompt": "p", "env_score": 1.0}])
    assert fields.reuse(trainer, ["ab"], [[5, 6]], [{"prompt": "p", "env_score": 1.0}]) is fields.rewards
    assert fields.reuse(trainer, ["ab"], [[5, 6]], [{"prompt": "p", "env_score": 0.0}]) is None
    assert fields.reuse(trainer, ["ab"], [[5, 6]], [{"prompt": "p"}]) is None
    assert fields.reuse(trainer, ["ab"], [[5, 6]], [{"prompt": "q", "env_score": 1.0}]) is None
    trainer.anchor_rollout.on_policy_scores = early
    calls = []
    score = trainer.anchor_rollout.reusing_scores(lambda *rows: calls.append(rows) or torch.zeros(1, 1))
    assert trainer.anchor_rollout.on_policy_scores is None  # used by this round's scoring only
    assert score([{}], ["p"], ["ab"], [[5, 6]]) is early.rewards and calls == []
    assert score([{}], ["p"], ["xy"], [[9]]).tolist() == [[0.0]] and len(calls) == 1


def test_same_call_rounds_score_their_candidates_in_waves(tiny_model_path, tiny_tokenizer, tmp_path):
    calls = []
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(range(40)), tmp_path,
                           reward_funcs=counting_reward(calls), max_steps=1, ref_reset_steps=1, dynamic_sampling=True,
                           anchor_sampling="lazy", anchor_fail_after_rounds=0)
    trainer.train()
    counts = trainer.anchor_rollout.counts
    assert logged(trainer, "armor/anchor_same_call") == [1.0]
    # K candidates per group come with the policy's call; only eligible groups' are scored, until one passes
    assert counts["candidate_rows"] == K * counts["groups"]
    assert counts["candidates_scored"] <= K * counts["eligible_groups"]


@pytest.mark.parametrize("cache", [False, True])
def test_rounds_in_which_no_group_looks_do_not_count_as_rounds_without_an_anchor(tiny_model_path, tiny_tokenizer,
                                                                                  tmp_path, cache):
    from testing import scripted

    # prompts n % 3 in {0, 1}: every group all correct or all wrong, so no group can be kept by its anchor; a
    # threshold no candidate reaches. The paper's path looks in every group and stops after 3 empty rounds; here no
    # group looks, and 4 such rounds say nothing about the verifier.
    settings = dict(reward_funcs=scripted, max_steps=4, dynamic_sampling=True, dynamic_sampling_max_rounds=1,
                    anchor_reward_threshold=2.0, anchor_fail_after_rounds=3, anchor_same_call=False,
                    anchor_cache=cache)
    data = numbers_dataset([n for n in range(60) if n % 3 != 2])
    paper = make_trainer(tiny_model_path, tiny_tokenizer, data, tmp_path / "paper", anchor_eligible_only=False,
                         **settings)
    with pytest.raises(ValueError, match="No anchor in the first 3 anchor rounds"):
        paper.train()
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, data, tmp_path / "eligible", **settings)
    trainer.train()
    assert set(logged(trainer, "armor/anchor_eligible_frac")) == {0.0}
    assert trainer.anchor_rollout.counts["candidate_rows"] == 0 and logged(trainer, "armor/anchor_found_frac") == []
    assert logged(trainer, "armor/anchor_cache_hit_frac") == []  # no group looked: no share to log


def test_lora_reference_draws_waves_with_the_ref_adapter(tiny_model_path, tiny_tokenizer, tmp_path):
    from peft import LoraConfig

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(range(40)), tmp_path, max_steps=2,
                           dynamic_sampling=True, anchor_sampling="lazy", anchor_same_call=False,
                           anchor_fail_after_rounds=0, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapters = []
    generate = trainer.anchor_rollout._reference_candidates
    trainer.anchor_rollout._reference_candidates = lambda ids, k: adapters.append(trainer.model.active_adapter) or \
        generate(ids, k)
    trainer.train()
    counts = trainer.anchor_rollout.counts
    assert counts["candidate_rows"] > 0 and counts["candidate_rows"] <= K * counts["eligible_groups"]
    assert set(adapters) == {"default"}  # π_ref is activated inside each wave's call, and left again after it
    assert trainer.model.active_adapter == "default"


@pytest.mark.parametrize("sampling", ["eager", "lazy"])
def test_processes_sample_as_many_rows_as_the_busiest_one(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch,
                                                          sampling):
    # one process of two: it holds 4 groups, 2 of them eligible; the other process (simulated by the gather) has 2 more
    # groups to sample than this one in every call, so this one pads its calls with repeated groups, discarded
    from testing import count_reference_rows

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(range(8)), tmp_path, dynamic_sampling=True,
                           anchor_sampling=sampling, anchor_reward_threshold=2.0)  # nothing passes: K draws each
    rollout = trainer.anchor_rollout
    with_a_busier_process(monkeypatch, trainer)  # the other process: 2 more groups to sample
    rows = count_reference_rows(monkeypatch, trainer)
    prompts = [f"{n}+{n + 1}=" for n in range(4)]
    prompt_ids = [tiny_tokenizer(p)["input_ids"] for p in prompts]
    eligible = torch.tensor([True, False, True, False])
    fillers = [[7, 8], [9], [10], [11, 12]]
    anchors, anchor_round = rollout.sample(prompt_ids, [{"prompt": p} for p in prompts], eligible=eligible,
                                           fillers=fillers)
    if sampling == "eager":
        assert rows == [(2 + 2) * K]  # one call: 2 groups + 2 padding groups, K candidates each
    else:
        assert rows == [2 + 2] * K  # K waves of the 2 local groups + 2 padding rows
    assert rollout.counts["candidate_rows"] == sum(rows) and rollout.counts["candidates_scored"] == sum(rows)
    assert anchors[1] == [9] and anchors[3] == [11, 12]  # left-out groups keep their filler; no anchor anywhere
    assert anchor_round.has_anchor.tolist() == [False] * 4 and anchor_round.eligible.tolist() == eligible.tolist()
    assert len(anchor_round.candidates_verified) == 2 * K  # the local groups' candidates only, padding discarded


@pytest.mark.parametrize("sampling", ["eager", "lazy"])
@pytest.mark.parametrize("idle", ["none_eligible", "all_cache_hits"])
def test_a_process_with_nothing_to_sample_pads_the_others_calls(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch,
                                                                sampling, idle):
    # one process of two (simulated by the gather): this one has no group to sample this round (none eligible, or
    # every group a cache hit), the other has 2; this one pads every call of the other with a repeated group, keeps
    # none of those draws, and its anchors are its fillers (ineligible) or its cached anchors
    from testing import count_reference_rows

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(range(8)), tmp_path, dynamic_sampling=True,
                           anchor_sampling=sampling, anchor_reward_threshold=2.0, anchor_cache=idle == "all_cache_hits")
    rollout = trainer.anchor_rollout
    with_a_busier_process(monkeypatch, trainer)  # the other process: 2 more groups to sample
    rows = count_reference_rows(monkeypatch, trainer)
    prompts = [f"{n}+{n + 1}=" for n in range(4)]
    prompt_ids = [tiny_tokenizer(p)["input_ids"] for p in prompts]
    fillers = [[7, 8], [9], [10], [11, 12]]
    eligible = None
    if idle == "none_eligible":
        eligible = torch.tensor([False] * 4)
    else:
        rollout.cache.sync(trainer.reference.resets)
        for g, ids in enumerate(prompt_ids):
            rollout.cache.put(ids, [20 + g], [3.0])
    anchors, anchor_round = rollout.sample(prompt_ids, [{"prompt": p} for p in prompts], eligible=eligible,
                                           fillers=fillers)
    assert rows == ([2 * K] if sampling == "eager" else [2] * K)  # the other process's calls, padded to its count
    assert rollout.counts["candidate_rows"] == sum(rows)
    if idle == "none_eligible":
        assert anchors == [[7, 8], [9], [10], [11, 12]] and anchor_round.has_anchor.tolist() == [False] * 4
    else:
        assert anchors == [[20], [21], [22], [23]] and anchor_round.has_anchor.tolist() == [True] * 4
    assert len(anchor_round.candidates_verified) == 0 and math.isnan(anchor_round.best_candidate_reward)


@pytest.mark.parametrize("threshold", [2.0, 0.0])  # nothing passes / every candidate passes
def test_the_draw_after_the_loop_pads_to_the_busiest_process_and_fills_only_its_slots(
        tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch, threshold):
    # one process of two: its batch holds 4 groups, 2 of them deferred (one beyond the groups that train: a short
    # batch's filler); the other process has 2 more groups to draw, so this one pads its call with a repeated group
    from armor_trl.algorithm.loss_rows import KEPT_ROWS
    from armor_trl.rollout.deferred_anchors import DEFERRED
    from testing import count_reference_rows

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(range(8)), tmp_path, dynamic_sampling=True,
                           anchor_filter="keep", anchor_reward_threshold=threshold)
    with_a_busier_process(monkeypatch, trainer)
    rows = count_reference_rows(monkeypatch, trainer)
    prompts = [f"{n}+{n + 1}=" for n in range(4)]
    prompt_ids = torch.tensor([tiny_tokenizer(p)["input_ids"] for p in prompts]).repeat_interleave(G, dim=0)
    filler = torch.tensor([[7, 8, 9]] * (4 * G))
    slot = torch.arange(4 * G) % G == G - 1
    batch = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": filler,
             "completion_mask": (~slot).long().unsqueeze(1).repeat(1, 3), "advantages": torch.zeros(4 * G),
             "armor_reward": torch.where(slot, torch.nan, 1.0), "armor_correctness": torch.where(slot, torch.nan, 1.0),
             "armor_is_anchor": torch.zeros(4 * G, dtype=torch.bool), KEPT_ROWS: ~slot,
             DEFERRED: slot & torch.tensor([True, False, False, True]).repeat_interleave(G)}
    anchors, placed = trainer.anchor_rollout.deferred_anchors(batch, [{"prompt": p} for p in prompts], 3)
    assert DEFERRED not in batch
    assert rows == [(1 + 2) * K]  # one call: the 1 deferred group that trains + 2 padding groups, K candidates each
    assert anchors.eligible.tolist() == [True, False, False, False] and anchors.after_loop
    assert trainer.anchor_rollout.counts["deferred_groups"] == 1 and trainer.anchor_rollout.counts["deferred_calls"] == 1
    assert placed == ([] if threshold > 1 else [G - 1])
    assert batch["armor_is_anchor"].nonzero().flatten().tolist() == placed
    assert batch[KEPT_ROWS].tolist() == [not s or r in placed for r, s in enumerate(slot.tolist())]
    others = [r for r in range(4 * G) if r not in placed]
    assert (batch["completion_ids"][others, :3] == 7 + torch.arange(3)).all()  # every other row as it was
    if placed:
        length = int(batch["completion_mask"][G - 1].sum())
        assert length > 0 and batch["armor_reward"][G - 1] >= threshold
