"""Deferred candidates on TRL's tool loop (``anchor_deferred`` with ``tools`` / ``environment_factory``): under dynamic
sampling with ``anchor_filter="keep"`` a group the loop will not keep runs no multi-turn candidate; the groups that
train draw their candidates' whole trajectories once per rollout batch, after the refill loop.

A deterministic fake at the model (testing.DrawToolFake): the policy answers at once, all right
(n % 3 == 0), all wrong (n % 3 == 1) or mixed (n % 3 == 2: its j-th row of a round right iff j is even); π_ref's j-th
draw of a prompt (in a round, or after the loop) calls the tool and answers with its result iff j >= n % 4, else
answers "5" at once. So the kept groups, their anchors (trajectories with a masked tool result) and the loss of the
deferred path, the in-round path and the paper's path (every group, K candidates at once) can be compared token for
token.
"""

from __future__ import annotations

import pytest
import torch

from testing import DrawToolFake, build_tool_trainer, capture_rounds, chat_numbers, kept_rows, logged, trainable_state

K = 3
GATES = ("armor/groups_kept_frac", "armor/dropped_all_correct_frac", "armor/dropped_all_wrong_frac",
         "armor/generation_rounds", "armor/batch_short_groups")


def run(tool_model, tool_tokenizer, tmp_path, monkeypatch, numbers=range(40), environment=None, stop=None,
        resume=None, **fields):
    from testing import StopAt

    settings = dict(dynamic_sampling=True, anchor_filter="keep", anchor_same_call=False, anchor_num_samples=K,
                    max_steps=3, **fields)
    if environment is not None:
        settings.update(tools=(), environment_factory=environment)
    trainer = build_tool_trainer(tool_model, tool_tokenizer, tmp_path, chat_numbers(numbers), **settings)
    fake = DrawToolFake(tool_tokenizer, trainer, "increment" if environment is not None else "multiply")
    fake.install(monkeypatch).hook(trainer)
    if stop is not None:
        trainer.add_callback(StopAt(stop))
    batches = capture_rounds(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, batches, fake


def reference_first_turns(fake) -> list:
    """π_ref's generate calls that hold first turns (a call after a tool result continues a trajectory)."""
    return [texts for is_reference, texts in fake.calls if is_reference and not any("\nt:" in t for t in texts)]


def check_same_training(expected, expected_batches, got, got_batches):
    anchors_with_a_tool = 0
    assert len(expected_batches) == len(got_batches) == 3
    for want, have in zip(expected_batches, got_batches):
        assert kept_rows(have) == kept_rows(want)  # the same groups, anchors (tool masks included), advantages
        assert have["num_items_in_batch"] == want["num_items_in_batch"]
        assert "armor_deferred" not in have
        anchors_with_a_tool += sum(flag and 0 in tools for *_, tools, flag in kept_rows(have))
    assert anchors_with_a_tool > 0, "some anchor is a trajectory with a masked tool result"
    for key in GATES + ("loss", "grad_norm"):
        assert len(logged(expected, key)) == 3 and logged(got, key) == pytest.approx(logged(expected, key), abs=1e-6), key
    before, after = trainable_state(expected), trainable_state(got)
    assert all(torch.allclose(before[n], after[n], atol=1e-6) for n in before)


@pytest.mark.parametrize("sampling, batch", [("eager", 8), ("lazy", 8), ("eager", 16)],
                         ids=["eager", "lazy", "wide"])  # wide: 4 groups a round, rounds keep more than needed
def test_deferred_tool_candidates_train_what_in_round_drawing_trains(tool_model, tool_tokenizer, tmp_path, monkeypatch,
                                                                      sampling, batch):
    common = dict(per_device_train_batch_size=batch)
    paper, paper_batches, paper_fake = run(tool_model, tool_tokenizer, tmp_path / "paper", monkeypatch,
                                           anchor_sampling="eager", anchor_eligible_only=False, **common)
    new, new_batches, fake = run(tool_model, tool_tokenizer, tmp_path / "deferred", monkeypatch,
                                 anchor_sampling=sampling, **common)
    in_round, in_round_batches, in_round_fake = run(tool_model, tool_tokenizer, tmp_path / "in_round", monkeypatch,
                                                    anchor_sampling=sampling, anchor_deferred=False, **common)
    check_same_training(paper, paper_batches, new, new_batches)
    check_same_training(paper, paper_batches, in_round, in_round_batches)
    counts, rows = new.anchor_rollout.counts, lambda f: sum(len(texts) for texts in reference_first_turns(f))
    # no group that the loop drops, nor one a round kept beyond the batch's need, ran a candidate trajectory
    assert counts["deferred_groups"] > 0 and counts["eligible_groups"] == 0 and counts["deferred_calls"] == 3
    assert counts["candidate_rows"] == rows(fake) <= rows(in_round_fake) < rows(paper_fake)
    if batch > 8:  # groups a round kept beyond the batch's need ran no candidate trajectory
        assert rows(fake) < rows(in_round_fake)
    # one candidate call per rollout batch (lazy: one per wave, K at most), against one per round in the round
    assert len(reference_first_turns(fake)) == 3 if sampling == "eager" else 3 <= len(reference_first_turns(fake)) <= 3 * K
    assert len(reference_first_turns(in_round_fake)) > len(reference_first_turns(fake))
    assert all(0 < v <= 1 for v in logged(new, "armor/anchor_deferred_frac"))


def test_deferred_candidates_run_in_environments_of_their_own(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    from testing import Registry, counter_environment

    registries = {}

    def one(name, **fields):
        registries[name] = Registry()
        return run(tool_model, tool_tokenizer, tmp_path / name, monkeypatch,
                   environment=counter_environment(registries[name]), **fields)

    paper, paper_batches, _ = one("paper", anchor_eligible_only=False)
    new, new_batches, fake = one("deferred")
    check_same_training(paper, paper_batches, new, new_batches)
    assert new.anchor_rollout.counts["deferred_calls"] == 3 and len(reference_first_turns(fake)) == 3
    policy = [instance for pool in new._environment_pool.values() for instance in pool]
    candidates = registries["deferred"].candidates_of(new)
    assert candidates and all(instance.counter == 0 for instance in policy), "the policy's environments saw no call"
    policy_resets = [kwargs for instance in policy for kwargs in instance.resets]
    assert all(kwargs in policy_resets for instance in candidates for kwargs in instance.resets)


def test_a_resumed_run_repeats_the_next_batch_exactly(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    common = dict(save_strategy="steps", save_steps=1)
    straight, straight_batches, _ = run(tool_model, tool_tokenizer, tmp_path / "straight", monkeypatch, **common)
    run(tool_model, tool_tokenizer, tmp_path / "stopped", monkeypatch, stop=2, **common)
    resumed, resumed_batches, _ = run(tool_model, tool_tokenizer, tmp_path / "stopped", monkeypatch,
                                      resume=str(tmp_path / "stopped" / "checkpoint-2"), **common)
    assert straight.anchor_rollout.counts["deferred_calls"] == 3
    assert len(resumed_batches) == 1 and resumed.anchor_rollout.counts["deferred_calls"] == 1
    assert kept_rows(resumed_batches[0]) == kept_rows(straight_batches[-1])
    for key in ("completion_ids", "tool_mask", "armor_is_anchor", "advantages"):
        assert torch.equal(resumed_batches[0][key], straight_batches[-1][key]), key
    assert logged(resumed, "loss")[-1] == pytest.approx(logged(straight, "loss")[-1])


def test_deferred_anchors_log_their_tool_calls_when_placed(tool_model, tool_tokenizer, tmp_path, monkeypatch):
    """The default path (candidates drawn after the refill loop): the anchors' tool metrics are logged when they are
    placed, with the meaning they have in a round (tool calls per anchor row, failed calls per call), counted here by
    hand from the anchor rows of each batch."""
    from testing import anchor_rows, row_text

    trainer, batches, _ = run(tool_model, tool_tokenizer, tmp_path, monkeypatch)
    assert trainer.anchor_rollout.counts["deferred_calls"] == 3
    expected = []
    for batch in batches:  # (a batch whose deferred draw found no anchor logs none: NaN is left out)
        calls = [row_text(tool_tokenizer, batch, row).count("<tool_call>") for row in anchor_rows(batch)]
        if calls:
            expected.append(sum(calls) / len(calls))
    assert len(expected) >= 2
    assert logged(trainer, "armor/anchor_tool_call_frequency") == pytest.approx(expected)
    assert logged(trainer, "armor/anchor_tool_failure_frequency") == [0.0] * len(expected)  # multiply never fails
    assert len(logged(trainer, "armor/policy_tool_call_frequency")) == 3
