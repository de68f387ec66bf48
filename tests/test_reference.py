"""The reference policy's lifecycle: schedule, resets for a full and a LoRA reference."""

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback

from armor_trl.reference.policy import reset_due
from testing import digit_share_reward, make_trainer as _make_trainer, reference_logps_gaps


def make_trainer(*args, **kwargs):
    # a graded reward keeps every step's gradient non-zero, so 'differs before a reset' is a real check
    return _make_trainer(*args, reward_funcs=digit_share_reward, anchor_reward_threshold=0.1, **kwargs)


@pytest.mark.parametrize(
    "reset_steps, every_step_until, expected",
    [
        (None, None, []),
        (2, None, [2, 4, 6]),
        (3, None, [3, 6]),
        (None, 3, [1, 2, 3]),
        (4, 2, [1, 2, 4]),
        (1, None, [1, 2, 3, 4, 5, 6]),
    ],
)
def test_reset_schedule(reset_steps, every_step_until, expected):
    assert [s for s in range(0, 7) if reset_due(s, reset_steps, every_step_until)] == expected


class DistanceToPolicy(TrainerCallback):
    """After every optimizer step (and after the reset callback), record max |π_ref − π_θ| and |π_ref − π_ref,0|."""

    def __init__(self, trainer):
        self.trainer = trainer
        policy = trainer.unwrapped_policy()
        self.initial_reference = [p.detach().clone() for p in trainer.reference.parameters_of(policy)]
        self.to_policy, self.to_initial, self.resets = [], [], []

    def _pairs(self):
        policy = self.trainer.unwrapped_policy()
        return [(t, s) for t, s in self.trainer.reference._pairs(policy)]

    def on_step_end(self, args, state, control, **kwargs):
        pairs = self._pairs()
        self.to_policy.append(max((t - s).abs().max().item() for t, s in pairs))
        self.to_initial.append(
            max((t - t0).abs().max().item() for (t, _), t0 in zip(pairs, self.initial_reference))
        )
        self.resets.append(self.trainer.reference.resets)


LORA = dict(peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), learning_rate=5e-2)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_reference_resets_every_tau_steps(kind, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    extra = LORA if kind == "lora" else {}
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, ref_reset_steps=2, max_steps=4, **extra
    )
    assert trainer.reference.kind == kind
    probe = DistanceToPolicy(trainer)
    assert max((t - s).abs().max().item() for t, s in probe._pairs()) == 0.0  # starts as a copy of the policy
    trainer.add_callback(probe)  # runs after the reset callback
    trainer.train()
    assert probe.resets == [0, 1, 1, 2]
    assert probe.to_policy[1] == 0.0 and probe.to_policy[3] == 0.0  # equal right after a reset
    assert probe.to_policy[0] > 0 and probe.to_policy[2] > 0  # differ before it
    assert probe.to_initial[0] == 0.0  # before any reset: the initial policy (adapter)
    assert probe.to_initial[1] > 0
    assert trainer.state.log_history[-2]["armor/ref_resets"] >= 1


def test_hybrid_schedule_resets_every_step_then_freezes(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(
        tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, ref_reset_every_step_until=2, max_steps=4
    )
    probe = DistanceToPolicy(trainer)
    trainer.add_callback(probe)
    trainer.train()
    assert probe.resets == [1, 2, 2, 2]
    assert probe.to_policy[:2] == [0.0, 0.0] and all(d > 0 for d in probe.to_policy[2:])


def test_static_reference_never_changes(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=3)
    probe = DistanceToPolicy(trainer)
    trainer.add_callback(probe)
    trainer.train()
    assert probe.resets == [0, 0, 0] and probe.to_initial == [0.0, 0.0, 0.0]
    assert probe.to_policy[-1] > 0


def test_lora_reference_is_a_frozen_adapter_outside_the_optimizer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=1, **LORA)
    trainer.train()
    ref_params = trainer.reference.parameters_of(trainer.unwrapped_policy())
    assert ref_params and not any(p.requires_grad for p in ref_params)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in optimized for p in ref_params)


def test_explicit_ref_model_path_is_used(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    from armor_trl.app.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=123)
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, ref_model=other, max_steps=1)
    pairs = trainer.reference._pairs(trainer.unwrapped_policy())
    assert max((t - s).abs().max().item() for t, s in pairs) > 0  # a different model than the policy


# --- exact resets through the trainer -------------------------------------------------------------------------------
def logps_gap(trainer):
    """max |log π_θ − log π_ref| over the completion tokens of a fixed batch, computed as the trainer does."""
    from armor_trl.integration import trl_generation

    input_ids = torch.tensor([[1, 3, 4, 5, 20, 21, 30, 4, 5, 6, 7, 8], [1, 9, 10, 3, 4, 20, 11, 12, 13, 14, 15, 16]])
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        policy = trl_generation.per_token_logps(trainer, trainer.model, input_ids, mask, 8, 2)
        model = trainer.reference.model if trainer.reference.kind == "full" else trainer.model
        with trainer.reference.active(trainer.unwrapped_policy()):
            reference = trl_generation.per_token_logps(trainer, model, input_ids, mask, 8, 2)
    return (policy - reference).abs().max().item()


def untied_model(tiny_model_path, directory, dtype=torch.float32):
    """The tiny model with its own LM head, saved to ``directory`` (TRL's cast_lm_head_to_fp32 needs untied embeddings,
    and its fused head cannot run a tied head that trainable_token_indices wraps)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=dtype)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("given_as", ["path", "instance", "tied_path"])
def test_reset_is_exact_with_an_fp32_lm_head(given_as, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    instance = untied_model(tiny_model_path, tmp_path / "untied", torch.bfloat16)
    model = {"path": str(tmp_path / "untied"), "instance": instance, "tied_path": tiny_model_path}[given_as]
    extra = {} if given_as == "instance" else dict(model_init_kwargs={"dtype": "bfloat16"})
    trainer = make_trainer(
        model, tiny_tokenizer, prompt_dataset, tmp_path, bf16=True, cast_lm_head_to_fp32=True, **extra
    )
    policy, reference = trainer.unwrapped_policy(), trainer.reference.model
    assert policy.lm_head.weight.dtype == torch.float32
    assert policy.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    # the reference's head is float32 like the policy's (so a reset does not round it), the rest stays bfloat16
    assert {n: p.dtype for n, p in reference.named_parameters()} == {n: p.dtype for n, p in policy.named_parameters()}
    assert logps_gap(trainer) == 0.0  # the initial copy

    perturb = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in policy.parameters():  # fp32 head values that bf16 cannot hold
            param.add_(0.01 * torch.randn(param.shape, generator=perturb, dtype=param.dtype))
    assert logps_gap(trainer) > 0.01
    trainer.reference.reset(policy, step=1)
    assert logps_gap(trainer) == 0.0


@pytest.mark.parametrize(
    "lora",
    [
        dict(target_modules=["q_proj", "embed_tokens"]),
        dict(target_modules=["q_proj"], trainable_token_indices=[int(c) + 3 for c in "0123456789"]),
    ],
    ids=["lora_embedding", "trainable_token_indices"],
)
def test_lora_reset_after_training_is_exact(lora, tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    untied_model(tiny_model_path, tmp_path / "untied")
    config = LoraConfig(r=4, lora_alpha=8, **lora)
    trainer = make_trainer(
        str(tmp_path / "untied"), tiny_tokenizer, prompt_dataset, tmp_path, peft_config=config, learning_rate=5e-2,
        max_steps=1,
    )
    assert logps_gap(trainer) == 0.0
    trainer.train()  # no reset scheduled: the trained adapter (embedding weights included) moves away from π_ref
    gap_before = logps_gap(trainer)
    assert gap_before > 1e-3
    trainer.reference.reset(trainer.unwrapped_policy(), step=1)
    assert logps_gap(trainer) == 0.0


@pytest.mark.parametrize("schedule, resets", [(dict(ref_reset_at_steps=[1]), [0, 1, 1, 1]),
                                              (dict(ref_reset_steps=1), [0, 1, 1, 2]),
                                              (dict(ref_reset_every_step_until=3), [0, 1, 1, 2])])
def test_every_step_trains_against_the_reference_it_holds(schedule, resets, tiny_model_path, tiny_tokenizer,
                                                          prompt_dataset, tmp_path):
    """Two optimizer steps per rollout batch (steps_per_generation=2) and resets the schedule places after step 1
    (inside the first batch): the reset acts at the batch's end, after step 2, so the π_ref log-probs each step's mixed
    ratio and KL read (computed at the batch's start) are those of the π_ref the trainer holds at that step."""
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, steps_per_generation=2,
                           max_steps=4, beta=0.04, **schedule)
    distance, gaps = DistanceToPolicy(trainer), reference_logps_gaps(trainer)
    trainer.add_callback(distance)
    trainer.train()
    assert [step for step, _ in gaps] == [1, 2, 3, 4]
    assert max(gap for _, gap in gaps) < 1e-5, gaps
    assert distance.resets == resets  # after step 2 (and 4), the ends of the rollout batches
    assert distance.to_policy[1] == 0.0 and distance.to_policy[0] > 0.0


def test_a_reset_waiting_for_its_rollout_batch_survives_a_checkpoint():
    """A reset due inside a rollout batch waits for its end; a checkpoint written meanwhile keeps it waiting, and the
    resumed run (which starts a new rollout batch) resets at its start."""
    from types import SimpleNamespace

    from armor_trl.reference.policy import ReferencePolicy, ReferenceResetCallback

    policy = torch.nn.Linear(2, 2)
    reference = ReferencePolicy.full(torch.nn.Linear(2, 2))
    ended = [False]
    callback = ReferenceResetCallback(reference, lambda: policy, None, None, at_steps=[1],
                                      rollout_ended=lambda: ended[0])
    state = SimpleNamespace(global_step=1)
    callback.on_step_end(None, state, None)
    assert reference.resets == 0 and reference.reset_pending
    saved = reference.state_dict()

    resumed = ReferencePolicy.full(torch.nn.Linear(2, 2))
    resumed.load_state_dict(saved)
    assert resumed.reset_pending
    ReferenceResetCallback(resumed, lambda: policy, None, None, at_steps=[1]).on_train_begin(None, state, None)
    assert resumed.resets == 1 and not resumed.reset_pending
    assert torch.equal(resumed.model.weight, policy.weight)

    ended[0] = True  # the run that was not interrupted: at the batch's end
    callback.on_step_end(None, SimpleNamespace(global_step=2), None)
    assert reference.resets == 1 and reference.last_reset_step == 2 and not reference.reset_pending
