"""DAPO dynamic sampling with refill, QAE and the ablation switches, on the tiny model with scripted rewards.

The scripted reward makes each group's outcome known in advance: prompt ``n+…`` is solved by every sample
when n % 3 == 0, by none when n % 3 == 1, and by every other sample (row parity) when n % 3 == 2.
"""

import pytest
import torch

from armor_trl.algorithm.advantages import group_advantages, group_quantile
from armor_trl.integration.checkpoint import read_state
from armor_trl.rollout.dynamic_sampling import refill_groups
from armor_trl.rollout.refill import RefillSampler, concat_rows, put_rows, take_rows
from testing import StopAt, has_digit_reward, logged, make_trainer, numbers_dataset, scripted, trainable_state

G = 4


def capture_batches(trainer):
    """Record the inputs of each generation round and the batch each generation step trains on."""
    rounds, batches = [], []
    score_round, generate = trainer._score_round, trainer._generate_and_score_completions

    def recording_round(inputs):
        rounds.append([row["prompt"] for row in inputs])
        return score_round(inputs)

    def recording_batch(inputs):
        batch = generate(inputs)
        batches.append({k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()})
        return batch

    trainer._score_round, trainer._generate_and_score_completions = recording_round, recording_batch
    return rounds, batches


def kind(prompt):
    return int(prompt.split("+")[0]) % 3


PLAIN = dict(use_anchors=False, use_mixed_ratio=False)


def test_groups_are_dropped_by_the_rule_and_masked_when_the_batch_stays_short(
    tiny_model_path, tiny_tokenizer, tmp_path
):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset(range(12)), tmp_path, reward_funcs=scripted, max_steps=3,
        dynamic_sampling=True, dynamic_sampling_max_rounds=1, per_device_train_batch_size=12, **PLAIN,
    )
    rounds, batches = capture_batches(trainer)
    trainer.train()
    for prompts, batch in zip(rounds, batches):
        groups = prompts[::G]
        mixed = [p for p in groups if kind(p) == 2]
        kept = batch["completion_mask"].view(-1, G, batch["completion_mask"].size(1)).sum(dim=(1, 2)) > 0
        assert kept.tolist() == [True] * len(mixed) + [False] * (len(groups) - len(mixed))
        assert batch["advantages"].view(-1, G)[~kept].abs().sum() == 0
        assert batch["num_items_in_batch"] == batch["completion_mask"].sum()
    n_groups = sum(len(p) // G for p in rounds)
    correct = sum(kind(p) == 0 for prompts in rounds for p in prompts[::G]) / n_groups
    wrong = sum(kind(p) == 1 for prompts in rounds for p in prompts[::G]) / n_groups
    assert sum(logged(trainer, "armor/dropped_all_correct_frac")) / 3 == pytest.approx(correct)
    assert sum(logged(trainer, "armor/dropped_all_wrong_frac")) / 3 == pytest.approx(wrong)
    assert logged(trainer, "armor/generation_rounds") == [1.0, 1.0, 1.0]


def test_refill_fills_the_batch_with_informative_groups(tiny_model_path, tiny_tokenizer, tmp_path):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset(range(30)), tmp_path, reward_funcs=scripted, max_steps=2,
        dynamic_sampling=True, **PLAIN,
    )
    rounds, batches = capture_batches(trainer)
    trainer.train()
    assert all(rounds_ > 1 for rounds_ in logged(trainer, "armor/generation_rounds"))  # a third of prompts are mixed
    assert logged(trainer, "armor/batch_short_groups") == [0.0, 0.0]
    for batch in batches:
        assert (batch["completion_mask"].view(-1, G, batch["completion_mask"].size(1)).sum(dim=(1, 2)) > 0).all()
        # every kept group is a mixed one: advantages ±, not all zero
        assert (batch["advantages"].view(-1, G).abs().sum(dim=1) > 0).all()


def test_refill_stops_at_the_round_limit_and_never_trains_on_nothing(tiny_model_path, tiny_tokenizer, tmp_path, caplog):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset([0, 1, 3, 4, 6, 7]), tmp_path, reward_funcs=scripted,
        max_steps=2, dynamic_sampling=True, dynamic_sampling_max_rounds=3, **PLAIN,
    )
    before = trainable_state(trainer)
    rounds, batches = capture_batches(trainer)
    trainer.train()
    assert logged(trainer, "armor/generation_rounds") == [3.0, 3.0] and len(rounds) == 6
    assert logged(trainer, "armor/batch_short_groups") == [2.0, 2.0]
    assert all(batch["completion_mask"].sum() == 0 for batch in batches)
    after = trainable_state(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)  # a fully masked batch moves nothing
    assert sum("kept too few groups" in r.message for r in caplog.records) <= 1


def test_dropped_groups_stay_out_of_the_loss_the_gradient_the_normaliser_and_the_batch_std(
    tiny_model_path, tiny_tokenizer, tmp_path
):
    # one round, no refill: the all-right and all-wrong groups are dropped and fill the batch, masked
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset(range(12)), tmp_path, reward_funcs=scripted, max_steps=1,
        dynamic_sampling=True, dynamic_sampling_max_rounds=1, per_device_train_batch_size=12, scale_rewards="batch",
        **PLAIN,
    )
    _, batches = capture_batches(trainer)
    trainer.train()
    batch = batches[0]
    kept_rows = [i for i in range(batch["completion_ids"].size(0)) if batch["completion_mask"][i].sum() > 0]
    assert 0 < len(kept_rows) < batch["completion_ids"].size(0)
    kept = take_rows(batch, kept_rows)
    kept["num_items_in_batch"] = kept["completion_mask"].sum()
    assert batch["num_items_in_batch"] == kept["num_items_in_batch"]  # dropped groups are not in the normaliser
    # the batch std is over the kept (mixed: 1, 0, 1, 0) groups only
    expected = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0] * (len(kept_rows) // G)), G, "batch")
    assert batch["advantages"][: len(kept_rows)].tolist() == pytest.approx(expected.tolist())

    def loss_and_grad(inputs):
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    full_loss, full_grad = loss_and_grad(batch)
    kept_loss, kept_grad = loss_and_grad(kept)
    assert full_loss == pytest.approx(kept_loss, abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(full_grad, kept_grad))


def test_the_armor_gate_drops_mixed_groups_without_an_anchor(tiny_model_path, tiny_tokenizer, tmp_path):
    # threshold 2 cannot be reached by a 0/1 reward: no group finds an anchor, so even mixed groups are dropped
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset(range(12)), tmp_path, reward_funcs=scripted, max_steps=1,
        dynamic_sampling=True, dynamic_sampling_max_rounds=1, per_device_train_batch_size=12,
        anchor_reward_threshold=2.0,
    )
    trainer.train()
    assert logged(trainer, "armor/groups_kept_frac") == [0.0]
    assert logged(trainer, "armor/dropped_no_anchor_frac")[0] > 0


@pytest.mark.parametrize("sampling, anchor_filter", [("eager", "drop"), ("lazy", "drop"), ("eager", "keep"),
                                                     ("lazy", "keep")])  # keep: anchors drawn after the refill loop
def test_resume_after_refill_rounds_continues_exactly(tiny_model_path, tiny_tokenizer, tmp_path, sampling,
                                                      anchor_filter):
    common = dict(
        reward_funcs=scripted, max_steps=4, dynamic_sampling=True, save_strategy="steps", save_steps=2,
        anchor_num_samples=2, anchor_sampling=sampling, anchor_filter=anchor_filter,
    )
    dataset = numbers_dataset(range(30))
    straight = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path / "straight", **common)
    straight.train()
    assert (straight.anchor_rollout.counts["deferred_groups"] > 0) == (anchor_filter == "keep")
    interrupted = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path / "cut", **common)
    interrupted.add_callback(StopAt(2))
    interrupted.train()
    assert interrupted.dynamic_sampling.refill.drawn > 0
    assert read_state(str(tmp_path / "cut" / "checkpoint-2"))["parts"]["refill"]["drawn"] == interrupted.dynamic_sampling.refill.drawn
    resumed = make_trainer(tiny_model_path, tiny_tokenizer, dataset, tmp_path / "cut", **common)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.dynamic_sampling.refill.drawn == straight.dynamic_sampling.refill.drawn
    a, b = trainable_state(straight), trainable_state(resumed)
    assert max((a[n] - b[n]).abs().max().item() for n in a) == 0.0


def test_alpha_decays_linearly_to_one(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, armor_alpha_decay_steps=4)
    seen = []
    for step in (0, 1, 2, 4, 8):
        trainer.state.global_step = step
        seen.append(trainer.armor_alpha)
    assert seen == pytest.approx([0.75, 0.8125, 0.875, 1.0, 1.0])


def test_reference_resets_at_the_listed_steps(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=4, ref_reset_at_steps=[1, 3],
        anchor_reward_threshold=0.0,
    )
    trainer.train()
    assert trainer.reference.resets == 2 and trainer.reference.last_reset_step == 3


def test_gate_only_keeps_g_on_policy_samples_and_no_anchor(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1, anchor_gate_only=True,
        use_mixed_ratio=False, reward_funcs=has_digit_reward,
    )
    _, batches = capture_batches(trainer)
    trainer.train()
    assert not batches[0]["armor_is_anchor"].any()
    assert logged(trainer, "armor/anchor_found_frac")  # candidates were sampled and verified for the gate


def test_half_group_variant_places_several_anchors_and_weights_their_loss(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1, anchors_per_group=2,
        anchor_selection="any", anchor_loss_weight=0.5, mask_negative_anchor_advantage=True,
        reward_funcs=has_digit_reward,
    )
    assert trainer.armor_alpha == 0.5  # (G − 2) / G
    _, batches = capture_batches(trainer)
    trainer.train()
    batch = batches[0]
    assert batch["armor_is_anchor"].view(-1, G).tolist() == [[False, False, True, True]] * (len(batch["armor_is_anchor"]) // G)
    assert (batch["advantages"][batch["armor_is_anchor"]] >= 0).all()


def test_refill_sampler_is_seeded_resumable_and_shares_the_stream_between_processes():
    a, b = RefillSampler(10, seed=3), RefillSampler(10, seed=3)
    first = a.draw(4, process_index=0, num_processes=2)
    second = b.draw(4, process_index=1, num_processes=2)
    assert not set(first) & set(second)  # one permutation, split between processes
    resumed = RefillSampler(10, seed=3)
    resumed.load_state_dict(a.state_dict())
    assert resumed.draw(4) == a.draw(4)
    with pytest.raises(ValueError, match="same training data and seed"):
        RefillSampler(11, seed=3).load_state_dict(a.state_dict())


def test_a_refill_round_generates_the_missing_groups_over_the_keep_rate_seen():
    assert refill_groups(missing=2, generated=64, kept=30, batch_groups=64, whole_batch=False) == 5  # ceil(4.27)
    assert refill_groups(missing=1, generated=8, kept=8, batch_groups=64, whole_batch=False) == 1
    assert refill_groups(missing=40, generated=64, kept=10, batch_groups=64, whole_batch=False) == 64  # at most a batch
    assert refill_groups(missing=3, generated=64, kept=0, batch_groups=64, whole_batch=False) == 64  # no rate yet
    assert refill_groups(missing=2, generated=64, kept=30, batch_groups=64, whole_batch=True) == 64  # the last round
    # dynamic_sampling_refill_max_groups: beyond a small generation batch, up to what is missing over the keep rate
    assert refill_groups(missing=7, generated=8, kept=1, batch_groups=8, whole_batch=False, most=64) == 56
    assert refill_groups(missing=7, generated=8, kept=1, batch_groups=8, whole_batch=False, most=32) == 32
    assert refill_groups(missing=7, generated=8, kept=1, batch_groups=64, whole_batch=False, most=32) == 56
    assert refill_groups(missing=7, generated=8, kept=1, batch_groups=8, whole_batch=True, most=64) == 8


class StreamGenerator:
    """Completions fixed by the prompt n and the row's place j among its prompt's rows in the call, never by the
    round: the policy's rows are right (a digit) when n % 3 == 0, wrong when n % 3 == 1, right for even j when
    n % 3 == 2; π_ref's j-th candidate is verified iff j >= n % 5 (so n % 5 == 4 finds none within K = 4). A group
    is generated alike in whatever round, of whatever size, it falls."""

    def __init__(self, tokenizer):
        self.tokenizer, self.rows, self.calls, self.reference_calls = tokenizer, 0, 0, 0
        self.digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
        self.letters = tokenizer.convert_tokens_to_ids(list("abcxyz"))

    def __call__(self, trainer, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        reference = trainer.reference is not None and trainer.model_wrapped is trainer.reference.model
        self.rows += 0 if reference else len(prompt_ids)
        self.calls += not reference
        self.reference_calls += reference
        seen, out = {}, []
        for ids in prompt_ids:
            n = int(self.tokenizer.decode(ids, skip_special_tokens=True).split("+")[0])
            j = seen.get(tuple(ids), 0) % num_generations
            seen[tuple(ids)] = seen.get(tuple(ids), 0) + 1
            right = j >= n % 5 if reference else n % 3 == 0 or (n % 3 == 2 and j % 2 == 0)
            out.append([self.digits[(n + j) % 10] if right else self.letters[(n + j) % 6], self.letters[j % 6]])
        return out, None


STREAM_NUMBERS = [n for n in range(90) if n % 3 == 2 or n % 6 == 0]
# few mixed groups: one prompt in nine or so (n % 3 == 2 and n % 4 == 0), the others settled all right or all wrong
SPARSE_NUMBERS = [n for n in range(300) if n % 3 != 2 or n % 4 == 0][:180]


def stream_run(tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch, numbers=STREAM_NUMBERS, **fields):
    """Three rollout batches of 8 groups on the stream generator, over prompts two thirds of which are mixed: the
    trainer, each batch with the prompts of its rounds and where its refill stream began, and the generator."""
    from trl import GRPOTrainer

    fake = StreamGenerator(tiny_tokenizer)
    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", lambda trainer, *args, **kw: fake(trainer, *args, **kw))
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(numbers), tmp_path,
                           per_device_train_batch_size=32, max_steps=3, dynamic_sampling=True, anchor_same_call=False,
                           anchor_num_samples=4, **fields)
    rounds, batches = capture_batches(trainer)
    starts, generate = [], trainer._generate_and_score_completions

    def marking(inputs):
        starts.append((len(rounds), trainer.dynamic_sampling.refill.drawn))
        return generate(inputs)

    trainer._generate_and_score_completions = marking
    trainer.train()
    return trainer, [(rounds[first:end], drawn, batch) for (first, drawn), end, batch
                     in zip(starts, [s[0] for s in starts[1:]] + [len(rounds)], batches)], fake


def trained_groups(batch):
    """(prompt, its rows' completions and advantages, anchor flags) of each group in the loss, in batch order."""
    rows = [i for i in range(batch["completion_ids"].size(0)) if batch["completion_mask"][i].sum() > 0]
    groups = {}
    for i in rows:
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        completion = batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist()
        anchor = bool(batch["armor_is_anchor"][i]) if "armor_is_anchor" in batch else False
        groups.setdefault(i // G, (prompt, []))[1].append((completion, round(batch["advantages"][i].item(), 6), anchor))
    return list(groups.values())


@pytest.mark.parametrize("fields, kept", [
    (PLAIN, lambda n: n % 3 == 2),
    (dict(), lambda n: n % 3 == 2 and n % 5 != 4),  # the authors' gate: mixed and an anchor among K = 4
    (dict(anchor_filter="keep"), lambda n: n % 3 == 2),  # keep: candidates drawn after the loop
], ids=["grpo", "gate", "keep"])
def test_refill_rounds_of_what_is_missing_train_what_whole_rounds_train(tiny_model_path, tiny_tokenizer, tmp_path,
                                                                        monkeypatch, fields, kept):
    whole, whole_batches, whole_fake = stream_run(tiny_model_path, tiny_tokenizer, tmp_path / "whole", monkeypatch,
                                                  dynamic_sampling_refill="batch", **fields)
    sized, sized_batches, sized_fake = stream_run(tiny_model_path, tiny_tokenizer, tmp_path / "sized", monkeypatch,
                                                  **fields)
    # the first rollout batch starts both streams at the same place: the same groups, rows, advantages, anchors, loss
    assert trained_groups(sized_batches[0][2]) == trained_groups(whole_batches[0][2])
    assert logged(sized, "loss")[0] == pytest.approx(logged(whole, "loss")[0], abs=1e-6)
    for trainer, runs in ((whole, whole_batches), (sized, sized_batches)):
        for rounds, drawn, batch in runs:
            # every batch: the first 8 kept groups of its first round's prompts, then of the refill stream from
            # where it stood; no group the rule keeps is passed over, whatever the size of the rounds
            stream = RefillSampler(len(STREAM_NUMBERS), trainer.args.seed)
            stream.drawn = drawn
            candidates = rounds[0][::G] + [f"{STREAM_NUMBERS[i]}+{STREAM_NUMBERS[i] + 1}=" for i in stream.draw(90)]
            expected = [p for p in candidates if kept(int(p.split("+")[0]))][:8]
            assert [tiny_tokenizer.decode(p, skip_special_tokens=True) for p, _ in trained_groups(batch)] == expected
    assert logged(sized, "armor/batch_short_groups") == logged(whole, "armor/batch_short_groups") == [0.0] * 3
    # the work: refill rounds after the first are smaller, and fewer policy rows are generated in all
    assert any(len(r) < 32 for rounds, _, _ in sized_batches for r in rounds[1:])
    assert all(len(r) == 32 for rounds, _, _ in whole_batches for r in rounds)
    assert sized_fake.rows < whole_fake.rows


@pytest.mark.parametrize("fields, kept", [
    (PLAIN, lambda n: n % 3 == 2),
    (dict(), lambda n: n % 3 == 2 and n % 5 != 4),  # the authors' gate: a candidate call in every round
], ids=["grpo", "gate"])
def test_refill_rounds_larger_than_a_generation_batch_train_the_same_in_fewer_generate_calls(
        tiny_model_path, tiny_tokenizer, tmp_path, monkeypatch, fields, kept):
    """A small generation batch (one optimizer step per rollout batch) whose rounds keep few groups: refill rounds
    sized to what is missing beyond a generation batch (dynamic_sampling_refill_max_groups) train the same groups in
    fewer rounds, so fewer generate calls for the policy and, under the gate, for π_ref's candidates (counted)."""
    fields = dict(fields, dynamic_sampling_max_rounds=30)  # capped rounds need many here: none stays short
    capped, capped_batches, capped_fake = stream_run(tiny_model_path, tiny_tokenizer, tmp_path / "capped", monkeypatch,
                                                     numbers=SPARSE_NUMBERS, **fields)
    sized, sized_batches, sized_fake = stream_run(tiny_model_path, tiny_tokenizer, tmp_path / "sized", monkeypatch,
                                                  numbers=SPARSE_NUMBERS, dynamic_sampling_refill_max_groups=64,
                                                  **fields)
    assert trained_groups(sized_batches[0][2]) == trained_groups(capped_batches[0][2])
    assert logged(sized, "loss")[0] == pytest.approx(logged(capped, "loss")[0], abs=1e-6)
    for trainer, runs in ((capped, capped_batches), (sized, sized_batches)):
        for rounds, drawn, batch in runs:  # the first 8 kept groups of the prompt stream, whatever the rounds' sizes
            stream = RefillSampler(len(SPARSE_NUMBERS), trainer.args.seed)
            stream.drawn = drawn
            candidates = rounds[0][::G] + [f"{SPARSE_NUMBERS[i]}+{SPARSE_NUMBERS[i] + 1}=" for i in stream.draw(400)]
            expected = [p for p in candidates if kept(int(p.split("+")[0]))][:8]
            assert [tiny_tokenizer.decode(p, skip_special_tokens=True) for p, _ in trained_groups(batch)] == expected
    assert logged(sized, "armor/batch_short_groups") == logged(capped, "armor/batch_short_groups") == [0.0] * 3
    assert any(len(r) > 32 for rounds, _, _ in sized_batches for r in rounds[1:])  # a refill round beyond the batch
    assert all(len(r) <= 32 for rounds, _, _ in capped_batches for r in rounds)
    # the calls: one policy generate call per round, and under the gate one candidate call per round with a mixed group
    rounds = lambda runs: sum(len(r) for r, _, _ in runs)  # noqa: E731
    assert sized_fake.calls == rounds(sized_batches) < rounds(capped_batches) == capped_fake.calls
    if "use_anchors" not in fields:
        assert sized_fake.reference_calls <= rounds(sized_batches)
        assert 0 < sized_fake.reference_calls < capped_fake.reference_calls <= rounds(capped_batches)


def test_concat_rows_repads_prompts_left_and_completions_right():
    one = {"prompt_ids": torch.tensor([[5, 6]]), "prompt_mask": torch.ones(1, 2), "completion_ids": torch.tensor([[7]]),
           "completion_mask": torch.ones(1, 1), "advantages": torch.tensor([1.0])}
    two = {"prompt_ids": torch.tensor([[4, 5, 6]]), "prompt_mask": torch.ones(1, 3),
           "completion_ids": torch.tensor([[7, 8]]), "completion_mask": torch.ones(1, 2), "advantages": torch.tensor([2.0])}
    joined = concat_rows([one, two], pad_token_id=0)
    assert joined["prompt_ids"].tolist() == [[0, 5, 6], [4, 5, 6]] and joined["prompt_mask"][0].tolist() == [0, 1, 1]
    assert joined["completion_ids"].tolist() == [[7, 0], [7, 8]] and joined["completion_mask"][0].tolist() == [1, 0]


def test_put_rows_overwrites_rows_and_widens_the_completion_side():
    batch = {"prompt_ids": torch.tensor([[5, 6], [0, 6]]), "prompt_mask": torch.tensor([[1, 1], [0, 1]]),
             "completion_ids": torch.tensor([[7, 8], [9, 0]]), "completion_mask": torch.tensor([[1, 1], [1, 0]]),
             "old_per_token_logps": torch.tensor([[-1.0, -2.0], [-3.0, 0.0]]), "advantages": torch.tensor([1.0, 2.0]),
             "num_items_in_batch": torch.tensor(3)}
    put_rows(batch, [1], {"completion_ids": torch.tensor([[4, 4, 4]]), "completion_mask": torch.tensor([[1, 1, 1]]),
                          "advantages": torch.tensor([5.0])}, pad_token_id=0)
    assert batch["completion_ids"].tolist() == [[7, 8, 0], [4, 4, 4]]
    assert batch["completion_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["old_per_token_logps"].tolist() == [[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]]  # widened, row kept
    assert batch["prompt_ids"].tolist() == [[5, 6], [0, 6]] and batch["advantages"].tolist() == [1.0, 5.0]
    assert batch["num_items_in_batch"].item() == 3  # not a per-row field: left as it was


def logps_rows(monkeypatch, trainer):
    """Rows of every log-prob forward pass made while generation batches are built (π_old's and π_ref's)."""
    from trl import GRPOTrainer

    rows, building = [], []
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def counting(self, model, input_ids, *args, **kwargs):
        if building:
            rows.append(input_ids.size(0))
        return original(self, model, input_ids, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", counting)
    generate = trainer._generate_and_score_completions

    def flagged(inputs):
        building.append(True)
        try:
            return generate(inputs)
        finally:
            building.pop()

    trainer._generate_and_score_completions = flagged
    return rows


@pytest.mark.parametrize("armor", [False, True])
def test_log_probs_are_computed_once_for_the_rows_that_train(armor, tiny_model_path, tiny_tokenizer, tmp_path,
                                                            monkeypatch):
    # two optimizer steps per rollout batch: TRL needs the old policy's log-probs; ARMOR needs π_ref's too. Refill
    # rounds generate about three times the batch (a third of the prompts are mixed), but only the batch is scored.
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset(range(30)), tmp_path, reward_funcs=scripted, max_steps=4,
        dynamic_sampling=True, steps_per_generation=2, anchor_reward_threshold=0.0, anchor_num_samples=2,
        anchor_same_call=False, **({} if armor else PLAIN),  # (a same-call round would reuse π_old's as π_ref's)
    )
    rounds, batches = capture_batches(trainer)
    rows = logps_rows(monkeypatch, trainer)
    trainer.train()
    batch_rows = 2 * 8  # steps_per_generation x per_device_train_batch_size
    assert len(batches) == 2 and sum(len(prompts) for prompts in rounds) > 2 * batch_rows  # refill happened
    assert sum(rows) == len(batches) * batch_rows * (2 if armor else 1)  # π_old (and π_ref) once per row that trains
    for batch in batches:
        assert batch["old_per_token_logps"].shape == batch["completion_ids"].shape
        if armor:
            assert batch["armor_ref_logps"].shape == batch["completion_ids"].shape
    # the first optimizer step of a rollout batch trains with the weights that made it: its ratio is 1
    deviation = logged(trainer, "armor/policy_abs_ratio_dev_max")
    assert deviation[0] < 1e-5 and deviation[2] < 1e-5 and deviation[1] > 1e-5


@pytest.mark.parametrize("armor", [False, True])
def test_qae_uses_the_group_quantile_as_baseline(armor, tiny_model_path, tiny_tokenizer, tmp_path):
    extra = {} if armor else PLAIN
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, numbers_dataset([2, 5, 8, 11]), tmp_path, reward_funcs=scripted, max_steps=1,
        advantage_quantile=0.4, anchor_reward_threshold=0.0, anchor_num_samples=2, **extra,
    )
    _, batches = capture_batches(trainer)
    trainer.train()
    # every prompt is "mixed" (the scripted reward alternates 1, 0 with the row's position in a scoring call). Without
    # anchors the batch is one call: 1, 0, 1, 0 per group. With anchors the call holds the 6 on-policy rows (1, 0, 1 |
    # 0, 1, 0) and each anchor keeps the score it was verified with: the first of its K = 2 candidates, position 0 or 2.
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0] if armor else [1.0, 0.0, 1.0, 0.0] * 2)
    expected = group_advantages(rewards, G, "group", quantile=0.4)
    assert batches[0]["advantages"].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    # QAE's baseline (K = 0.4): 1 where more than 60% of the group is correct (3 of 4), else 0; never the mean
    assert group_quantile(rewards.view(-1, G), 0.4).flatten().tolist() == ([1.0, 0.0] if armor else [0.0, 0.0])


def test_anchor_advantage_options_act_on_anchor_rows_only(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, anchor_loss_weight=0.5,
        mask_negative_anchor_advantage=True,
    )
    output = {
        "advantages": torch.tensor([1.0, -1.0, 2.0, -2.0]),
        "armor_is_anchor": torch.tensor([False, False, True, True]),
        "completion_mask": torch.ones(4, 3),
    }
    trainer._shape_anchor_advantages(output)
    assert output["advantages"].tolist() == [1.0, -1.0, 1.0, 0.0]  # λ · max(A, 0) on anchors


def test_off_policy_ratio_uses_the_reference_as_old_policy_on_anchor_tokens(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=2, use_mixed_ratio=False,
        off_policy_ratio=True, anchor_reward_threshold=0.0,
    )
    _, batches = capture_batches(trainer)
    trainer.train()
    batch = batches[1]  # after one update π_θ differs from π_ref
    anchor = batch["armor_is_anchor"]
    assert anchor.any()
    assert torch.equal(batch["old_per_token_logps"][anchor], batch["armor_ref_logps"][anchor])
    assert not torch.equal(batch["old_per_token_logps"][~anchor], batch["armor_ref_logps"][~anchor])


def test_anchor_reward_funcs_must_name_reward_functions_of_the_trainer(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    with pytest.raises(ValueError, match=r"anchor_reward_funcs names \['length'\].*\['has_digit_reward'\]"):
        make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, anchor_reward_funcs=["length"])


def test_the_keep_rule_judges_correctness_by_the_verifier_not_the_shaped_reward(
    tiny_model_path, tiny_tokenizer, tmp_path
):
    def verifier(completions, **kwargs):  # every answer wrong
        return [0.0] * len(completions)

    def length_shaping(completions, **kwargs):  # a shaping reward that varies within every group
        return [0.01 * position for position in range(len(completions))]

    common = dict(dynamic_sampling=True, dynamic_sampling_max_rounds=1, max_steps=1, **PLAIN)
    judged = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(range(8)), tmp_path / "verifier",
                          reward_funcs=[verifier, length_shaping], anchor_reward_funcs=["verifier"], **common)
    judged.train()
    assert logged(judged, "armor/dropped_all_wrong_frac") == [1.0]  # all wrong: dropped, whatever the shaping
    shaped = make_trainer(tiny_model_path, tiny_tokenizer, numbers_dataset(range(8)), tmp_path / "total",
                          reward_funcs=[verifier, length_shaping], **common)
    shaped.train()
    assert logged(shaped, "armor/dropped_all_wrong_frac") == [0.0]  # None: the total reward decides, as before
