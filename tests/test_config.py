"""ArmorConfig: defaults and a clear ValueError, naming the field, for each config mistake."""

import pytest
from trl import GRPOConfig

from armor_trl import ArmorConfig


def make(**kwargs):
    base = dict(output_dir="unused", use_cpu=True, bf16=False, per_device_train_batch_size=8, num_generations=4)
    base.update(kwargs)
    return ArmorConfig(**base)


def test_is_a_grpo_config_with_armor_defaults():
    args = make()
    assert isinstance(args, GRPOConfig)
    assert (args.beta, args.loss_type, args.epsilon, args.epsilon_high) == (0.0, "dapo", 0.2, 0.28)
    assert args.resolved_alpha == 0.75  # (G−1)/G with G = 4
    assert make(armor_alpha=0.9).resolved_alpha == 0.9


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(armor_alpha=0.0), "armor_alpha"),
        (dict(armor_alpha=1.5), "armor_alpha"),
        (dict(armor_alpha=-0.1), "armor_alpha"),
        (dict(anchor_num_samples=0), "anchor_num_samples"),
        (dict(anchor_filter="skip"), "anchor_filter"),
        (dict(ref_reset_steps=0), "ref_reset_steps"),
        (dict(ref_reset_steps=-5), "ref_reset_steps"),
        (dict(ref_reset_every_step_until=-1), "ref_reset_every_step_until"),
        (dict(beta=-0.04), "beta"),
        (dict(beta=0.04, sync_ref_model=True), "sync_ref_model"),
        (dict(loss_type="ppo"), "loss_type"),
        (dict(importance_sampling_level="segment"), "importance_sampling_level"),
    ],
)
def test_config_mistakes_are_value_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make(**kwargs)


def test_groups_must_not_span_processes(monkeypatch):
    # GRPOConfig only checks the global generation batch (2 per process × 2 processes = 4 is a multiple of 4);
    # ARMOR needs whole groups, with their anchor, on each process.
    monkeypatch.setattr(ArmorConfig, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="per_device_train_batch_size \\* steps_per_generation"):
        make(per_device_train_batch_size=2, num_generations=4)


def test_error_message_lists_allowed_values():
    with pytest.raises(ValueError, match=r"\['drop', 'keep'\]"):
        make(anchor_filter="skip")
    with pytest.raises(ValueError, match=r"'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo', 'vespo'"):
        make(loss_type="ppo")
    with pytest.raises(ValueError, match=r"\['token', 'sequence'\]"):
        make(importance_sampling_level="segment")


def test_ablation_switches_off_allow_any_grpo_setting():
    args = make(use_anchors=False, use_mixed_ratio=False, beta=0.04, loss_type="cispo")
    assert not args.armor_enabled


def test_every_trl_loss_type_and_level_is_allowed_with_the_mixed_ratio():
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"):
        for level in ("token", "sequence"):
            args = make(loss_type=loss_type, importance_sampling_level=level)
            assert args.use_anchors and args.use_mixed_ratio


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dynamic_sampling_max_rounds=0), "dynamic_sampling_max_rounds must be an integer >= 1"),
        (dict(dynamic_sampling_refill="half"), "dynamic_sampling_refill must be one of \\['missing', 'batch'\\]"),
        (dict(advantage_quantile=1.5), "advantage_quantile must lie in \\[0, 1\\]"),
        (dict(dynamic_sampling=True, multi_objective_aggregation="normalize_then_sum"), "sum_then_normalize"),
        (dict(anchor_selection="best"), "anchor_selection must be one of \\['correct', 'any', 'incorrect'\\]"),
        (dict(anchors_per_group=4), "anchors_per_group must be at least 1 and below num_generations"),
        (dict(anchors_per_group=3, anchor_num_samples=2), "anchor_num_samples \\(2\\) must be at least anchors_per_group"),
        (dict(anchor_loss_weight=-1.0), "anchor_loss_weight must be >= 0"),
        (dict(use_anchors=False, dynamic_sampling_keep_unsolved=True), "dynamic_sampling_keep_unsolved=True needs use_anchors"),
        (dict(off_policy_ratio=True), "set use_mixed_ratio=False with it"),
        (dict(use_mixed_ratio=False, off_policy_ratio=True, anchor_gate_only=True), "cannot be combined with anchor_gate_only"),
        (dict(anchor_cache=True, anchor_selection="any"), "anchor_cache=True keeps one verified anchor"),
        (dict(armor_alpha_decay_steps=0), "armor_alpha_decay_steps must be a positive number"),
        (dict(ref_reset_at_steps=[0, 3]), "ref_reset_at_steps must hold positive optimizer steps"),
    ],
)
def test_loop_and_ablation_mistakes_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


def test_reset_steps_from_the_command_line_and_alpha_for_several_anchors():
    assert make(ref_reset_at_steps="8,2,4").ref_reset_at_steps == [2, 4, 8]
    assert make(anchors_per_group=2).resolved_alpha == 0.5  # (G − 2) / G with G = 4

