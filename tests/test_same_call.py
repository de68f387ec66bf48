"""Same-call anchors (``anchor_same_call``, armor_trl/rollout/anchor_rollout.py): when π_ref holds the weights that generate
the round, the K candidates per group are extra rows of the policy's own generate call and π_ref's log-probs are the
old policy's. The switch must engage exactly then, and draw anchors from the same distribution as a separate call.
"""

import math

import pytest
import torch
from peft import LoraConfig

from armor_trl.integration import trl_generation
from testing import cpu_args, logged, make_trainer


def record_decisions(trainer):
    """Per generation round: (global step, engaged, π_ref's weights equal the policy's, separate reference call)."""
    rollout, decisions = trainer.anchor_rollout, []
    decide, separate = rollout.same_call_applies, rollout._reference_candidates

    def deciding():
        engaged = decide()
        pairs = trainer.reference._pairs(trainer.unwrapped_policy())
        equal = all(torch.equal(ref, policy) for ref, policy in pairs)
        decisions.append({"step": trainer.state.global_step, "engaged": engaged, "equal": equal, "separate": 0})
        return engaged

    def separately(prompt_ids, k, inputs=None):
        decisions[-1]["separate"] += 1
        return separate(prompt_ids, k, inputs)

    rollout.same_call_applies, rollout._reference_candidates = deciding, separately
    return decisions


LORA = dict(peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
# (id, settings, optimizer steps, expected engagement per round); with steps_per_generation=2 a round every 2 steps
CASES = [
    ("static", {}, 3, [True, False, False]),  # step 0 only: the reference is the initial policy
    ("hybrid", {"ref_reset_every_step_until": 10}, 3, [True, True, True]),
    ("reset_every_2", {"ref_reset_steps": 2}, 4, [True, False, True, False]),
    ("off", {"anchor_same_call": False, "ref_reset_every_step_until": 10}, 3, [False, False, False]),
    ("given_ref_model", {"ref_model": "tiny"}, 2, [False, False]),  # a reference of unknown weights: never
    # resets due inside a rollout batch act at its end (after steps 2 and 4): π_ref holds the generating weights
    ("mid_rollout_reset", {"steps_per_generation": 2, "ref_reset_at_steps": [1, 3]}, 6, [True, True, True]),
    ("boundary_reset", {"steps_per_generation": 2, "ref_reset_at_steps": [2]}, 6, [True, True, False]),
    ("hybrid_M2", {"steps_per_generation": 2, "ref_reset_every_step_until": 10}, 4, [True, True]),
    ("lora_static", LORA, 3, [True, False, False]),
    ("lora_hybrid", {**LORA, "ref_reset_every_step_until": 10}, 3, [True, True, True]),
]


@pytest.mark.parametrize("settings,steps,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_engages_exactly_when_the_reference_holds_the_generating_weights(
        settings, steps, expected, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    settings = dict(settings)
    if settings.get("ref_model") == "tiny":
        settings["ref_model"] = tiny_model_path
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=steps,
                           learning_rate=1e-1, **settings)
    decisions = record_decisions(trainer)
    trainer.train()
    assert [d["engaged"] for d in decisions] == expected
    for d in decisions:
        if d["engaged"]:
            assert d["equal"], d  # never engaged with other weights
            assert d["separate"] == 0, d  # and no second generate call on π_ref
        else:
            assert d["separate"] == 1, d
    if settings.get("ref_model") is None and settings.get("anchor_same_call", True):
        # without a given reference, every round whose reference holds the policy's weights engaged
        assert [d["equal"] for d in decisions if d["step"] > 0] == [d["engaged"] for d in decisions if d["step"] > 0]
    assert logged(trainer, "armor/anchor_same_call") == [float(e) for e in expected]  # once per round


def test_reference_logps_of_a_same_call_round_are_the_old_policy_logps(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, monkeypatch):
    # M = 2 optimizer steps per rollout: TRL computes the old policy's log-probs; a reset after step 2 only
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=6,
                           learning_rate=1e-1, steps_per_generation=2, ref_reset_at_steps=[2])
    forwards, rounds = [], []
    original_forward = trainer._completion_logps

    def counting(model, output):
        forwards.append(trainer.state.global_step)
        return original_forward(model, output)

    trainer._completion_logps = counting
    original_round = trainer._generate_and_score_completions

    def recording(inputs):
        output = original_round(inputs)
        # the reference's own forward on these rows, with its weights of now (before any further step)
        with torch.no_grad():
            ref = original_forward(trainer.reference.model, output)
        rounds.append({"step": trainer.state.global_step, "same_call": trainer.anchor_rollout.same_call_round,
                       "ref": output["armor_ref_logps"].clone(), "old": output["old_per_token_logps"].clone(),
                       "forward": ref, "mask": output["completion_mask"].bool().clone(),
                       "kept": output["armor_loss_row"].clone()})
        return output

    trainer._generate_and_score_completions = recording
    trainer.train()
    assert [(r["step"], r["same_call"]) for r in rounds] == [(0, True), (2, True), (4, False)]
    assert forwards == [4]  # the reference forward ran only where the weights differ
    for r in rounds:
        mask = r["mask"]
        assert torch.allclose(r["ref"][mask], r["forward"][mask], atol=1e-5)  # π_ref's log-probs, either way
        if r["same_call"]:  # (rows out of the loss carry 0, marked by armor_loss_row)
            assert torch.equal(r["ref"][r["kept"]], r["old"][r["kept"]]) and (r["ref"][~r["kept"]] == 0).all()
        else:
            assert not torch.allclose(r["ref"][mask], r["old"][mask], atol=1e-3)  # the policy has moved


def _rollout_statistics(trainer, same_call: bool, rounds: int, seed: int) -> dict:
    """``rounds`` anchor rounds at step 0 (π_ref = the initial policy), drawn by the trainer's own rollout."""
    trainer.args.anchor_same_call = same_call
    rollout, g = trainer.anchor_rollout, trainer.num_generations
    prompts, inputs = trainer._test_prompt_ids, trainer._test_inputs
    torch.manual_seed(seed)
    verified, found, lengths, anchor_lengths, engaged = [], [], [], [], []
    for _ in range(rounds):
        ids, _, anchors = rollout.generate(lambda p, n: (trl_generation.generate(trainer, p, n), None), prompts, g,
                                           inputs)
        engaged.append(rollout.same_call_round)
        verified += anchors.candidates_verified.float().tolist()
        found += anchors.has_anchor.float().tolist()
        policy = [row for i, row in enumerate(ids) if i % g < g - 1]
        lengths += [len(row) for row in policy]
        anchor_lengths += [len(row) for i, row in enumerate(ids) if i % g == g - 1]
    return {"engaged": engaged, "verified": verified, "found": found, "lengths": lengths,
            "anchor_lengths": anchor_lengths}


def _binomial_tolerance(a: list, b: list, sigmas: float = 4.0) -> float:
    p = (sum(a) + sum(b)) / (len(a) + len(b))
    return sigmas * math.sqrt(p * (1 - p) * (1 / len(a) + 1 / len(b)))


def _mean_tolerance(a: list, b: list, sigmas: float = 4.0) -> float:
    var = lambda x: sum((v - sum(x) / len(x)) ** 2 for v in x) / (len(x) - 1)  # noqa: E731
    return sigmas * math.sqrt(var(a) / len(a) + var(b) / len(b))


def test_same_call_anchors_match_separately_sampled_ones_in_distribution(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    """Same seeds, same prompts, 40 rounds of 8 groups x K=4 candidates each way, at step 0 where both are draws of
    the initial policy. Not bit-exact: TRL's sampler draws one token per row of the batch at each decoding step, so
    one batch of G-1+K rows per group and two batches (G-1, then K) consume the random stream differently. The
    candidates' verified share (a binomial mean over 1280 candidates) and the mean completion lengths must agree
    within 4 standard errors of their difference (a false alarm about once in 16 000 seeds; the seed is fixed)."""
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, per_device_train_batch_size=32,
                           num_generations=4, max_steps=1)
    rows = prompt_dataset.select(range(8)).to_list()
    trainer._test_inputs = [row for row in rows for _ in range(4)]
    trainer._test_prompt_ids = [tiny_tokenizer(row["prompt"])["input_ids"] for row in trainer._test_inputs]
    same = _rollout_statistics(trainer, True, 40, seed=7)
    separate = _rollout_statistics(trainer, False, 40, seed=7)
    assert all(same["engaged"]) and not any(separate["engaged"])
    assert len(same["verified"]) == len(separate["verified"]) == 40 * 8 * 4
    for key, tolerance in (("verified", _binomial_tolerance), ("found", _binomial_tolerance),
                           ("lengths", _mean_tolerance), ("anchor_lengths", _mean_tolerance)):
        a, b = same[key], separate[key]
        assert abs(sum(a) / len(a) - sum(b) / len(b)) <= tolerance(a, b), key
    assert 0.05 < sum(same["verified"]) / len(same["verified"]) < 0.95  # not all or nothing: the check has power
    assert same["lengths"] != separate["lengths"]  # other random draws: not bit-exact


def test_anchor_same_call_is_a_documented_config_field(tmp_path):
    from armor_trl import ArmorConfig

    field = ArmorConfig.__dataclass_fields__["anchor_same_call"]
    assert field.default is True and "armor/anchor_same_call" in field.metadata["help"]
    assert ArmorConfig(output_dir=str(tmp_path), anchor_same_call=False, **cpu_args()).anchor_same_call is False


def record_reference_logps(trainer):
    """Per generation round: whether it was a same-call round, the π_ref log-probs stored for the loss, and an
    independent forward of π_ref (eval mode, its weights of now) over the same rows."""
    rounds, original_round, forward = [], trainer._generate_and_score_completions, trainer._completion_logps

    def recording(inputs):
        output = original_round(inputs)
        reference, policy = trainer.reference, trainer.unwrapped_policy()
        model = reference.model if reference.kind == "full" else trainer.model
        with torch.no_grad(), reference.active(policy):
            independent = forward(model, output)
        rounds.append({"same_call": trainer.anchor_rollout.same_call_round, "ref": output["armor_ref_logps"].clone(),
                       "forward": independent, "mask": output["completion_mask"].bool().clone()})
        return output

    trainer._generate_and_score_completions = recording
    return rounds


def test_a_second_train_takes_anchors_from_the_reference_and_continues_the_schedules(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    # Two optimizer steps per call, one rollout each (M = 2: TRL computes the old policy's log-probs). The second
    # call's step count restarts at 0, but the policy has moved two steps away from the static π_ref.
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=2, learning_rate=1e-1,
                           steps_per_generation=2, ref_reset_steps=3, armor_alpha_decay_steps=4)
    decisions, rounds = record_decisions(trainer), record_reference_logps(trainer)
    trainer.train()
    trainer.train()
    assert trainer.state.global_step == 2
    assert [(d["step"], d["engaged"], d["equal"]) for d in decisions] == [(0, True, True), (0, False, False)]
    assert decisions[1]["separate"] == 1  # the second call's anchors were sampled from π_ref itself
    for r in rounds:
        mask = r["mask"]
        assert torch.allclose(r["ref"][mask], r["forward"][mask], atol=1e-5)
    # the schedules count the optimizer steps of both calls: the reset after step 3 happened, α reached step 4's
    assert trainer.reference.resets == 1
    assert trainer.armor_alpha == pytest.approx(trainer.args.alpha_at(4)) == 1.0


def test_a_second_train_with_a_collapse_guard_is_refused(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1,
                           collapse_guard="stop")
    trainer.train()
    with pytest.raises(ValueError, match="collapse_guard keeps its validation history"):
        trainer.train()


@pytest.mark.parametrize("disable_dropout", [False, True])
def test_same_call_only_without_dropout(disable_dropout, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    # Reset after every step, so π_ref holds the generating weights at every round; but TRL generates and computes the
    # old log-probs in train mode, with LoRA's dropout (0.5) on unless disable_dropout, while π_ref runs in eval mode.
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, peft_config=lora, max_steps=4,
                           learning_rate=1e-1, steps_per_generation=2, ref_reset_every_step_until=10,
                           disable_dropout=disable_dropout)
    rounds = record_reference_logps(trainer)
    trainer.train()
    assert [r["same_call"] for r in rounds] == [disable_dropout] * 2
    assert logged(trainer, "armor/anchor_same_call") == [float(disable_dropout)] * 2
    for r in rounds:  # the stored π_ref log-probs are an eval-mode π_ref forward's
        mask = r["mask"]
        assert torch.allclose(r["ref"][mask], r["forward"][mask], atol=1e-5)


def test_dropout_in_the_model_config_counts_as_active(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from armor_trl.rollout.anchor_rollout import dropout_active

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.train()
    assert not dropout_active(model)
    model.config.attention_dropout = 0.3  # applied by the attention function in train mode, not by a module
    assert dropout_active(model)
    model.eval()
    assert not dropout_active(model)


def test_loading_the_best_model_at_the_end_counts_as_a_change_of_the_policy_weights():
    from types import SimpleNamespace

    from armor_trl.reference.policy import ReferenceResetCallback, ReferencePolicy

    reference = ReferencePolicy("full")
    reference.copied_version = reference.policy_version  # π_ref = the policy, e.g. right after a reset
    callback = ReferenceResetCallback(reference, lambda: None, None, None)
    callback.on_train_end(SimpleNamespace(load_best_model_at_end=False), None, None)
    assert reference.holds_policy_weights()
    callback.on_train_end(SimpleNamespace(load_best_model_at_end=True), None, None)  # transformers loaded other weights
    assert not reference.holds_policy_weights()


def test_loading_the_best_model_at_the_end_marks_the_vllm_engine_stale(tiny_model_path, tiny_tokenizer,
                                                                      prompt_dataset, tmp_path):
    # transformers loads the best checkpoint's weights at the end of train(); a vLLM engine that holds the final
    # weights (TRL's step marker = the last step) must push them again before a later evaluate() samples
    from transformers import TrainerCallback

    from armor_trl.integration import trl_seam as seam

    from armor_trl import ArmorConfig, ArmorGRPOTrainer
    from testing import cpu_args, has_digit_reward

    args = ArmorConfig(output_dir=str(tmp_path), **cpu_args(
        max_steps=2, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="loss"))
    trainer = ArmorGRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, args=args,
                               train_dataset=prompt_dataset, eval_dataset=prompt_dataset,
                               processing_class=tiny_tokenizer)

    class EngineCurrent(TrainerCallback):  # what TRL's vLLM path holds at the end: the engine has the final weights
        def on_train_end(self, args, state, control, **kwargs):
            trainer.use_vllm = True
            seam.set_engine_step(trainer, state.global_step)

    trainer.add_callback(EngineCurrent())
    trainer.train()
    assert trainer.state.best_model_checkpoint is not None
    assert seam.engine_step(trainer) == -1  # TRL pushes the (best) weights before its next generation


@pytest.mark.parametrize("change", ["load_state_dict", "replace_parameter", "data_write", "vector_to_parameters"])
def test_weights_changed_outside_the_trainer_between_train_calls_end_same_call_rounds(
        change, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    # π_ref is reset after every step, so after train() it holds the policy's weights; weights then loaded into the
    # policy (load_state_dict, load_adapter, a parameter replaced, a write through .data, which moves no in-place
    # version counter, torch's vector_to_parameters) bump no version of the trainer's
    from testing import logged

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1,
                           ref_reset_every_step_until=10)
    trainer.train()
    reference, policy = trainer.reference, trainer.unwrapped_policy()
    assert reference.holds_policy_weights()
    name, param = next((n, p) for n, p in policy.named_parameters() if "layers.0." in n)  # (not the tied embedding)
    if change == "load_state_dict":
        policy.load_state_dict({name: param.detach() + 0.5}, strict=False)
    elif change == "replace_parameter":
        module_name, _, attribute = name.rpartition(".")
        setattr(policy.get_submodule(module_name), attribute, torch.nn.Parameter(param.detach() + 0.5))
    elif change == "data_write":
        param.data.add_(0.5)
    else:
        vector = torch.nn.utils.parameters_to_vector(policy.parameters())
        torch.nn.utils.vector_to_parameters(vector + 0.5, policy.parameters())
    assert not reference.holds_policy_weights()  # the next round's anchors come from π_ref itself
    if change in ("data_write", "vector_to_parameters"):  # and the next train() call's first round is not same-call
        trainer.train()
        assert logged(trainer, "armor/anchor_same_call")[-1] == 0.0
        return
    reference.reset(policy, trainer.state.global_step)
    assert reference.holds_policy_weights()


def test_after_an_unchanged_first_call_the_next_round_is_same_call(tiny_model_path, tiny_tokenizer, prompt_dataset,
                                                                    tmp_path):
    # the counterpart of the test above: with the policy's weights left alone the second call samples in one call
    from testing import logged

    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1,
                           ref_reset_every_step_until=10)
    trainer.train()
    trainer.train()
    assert logged(trainer, "armor/anchor_same_call") == [1.0]  # (log_history: this call's)
