"""checks.describe_update_regime: fully on-policy or M optimizer steps per rollout batch, from TRL's fields."""

import pytest

from armor_trl import ArmorConfig
from armor_trl.checks import describe_update_regime, optimizer_steps_per_rollout
from testing import cpu_args


@pytest.mark.parametrize(
    "fields, steps",
    [
        (dict(), 1),  # the default: steps_per_generation = gradient_accumulation_steps
        (dict(gradient_accumulation_steps=4), 1),  # accumulation alone: still one step per rollout batch
        (dict(steps_per_generation=8), 8),
        (dict(num_iterations=2), 2),
        (dict(steps_per_generation=8, gradient_accumulation_steps=2), 4),
        (dict(steps_per_generation=2, gradient_accumulation_steps=4), 0.5),  # one step spans two rollout batches
    ],
)
def test_update_regime(tmp_path, fields, steps):
    args = ArmorConfig(output_dir=str(tmp_path), **cpu_args(**fields))
    assert optimizer_steps_per_rollout(args) == steps
    text = describe_update_regime(args)
    if steps <= 1:
        assert "fully on-policy" in text and "clip never binds" in text
        assert "acts only as a per-token gradient weight" in text  # ARMOR's mixed ratio is on by default
    else:
        assert f"{steps:g} optimizer steps per rollout batch" in text and "on-policy" not in text


def test_without_the_mixed_ratio_the_on_policy_text_does_not_mention_it(tmp_path):
    args = ArmorConfig(output_dir=str(tmp_path), **cpu_args(use_mixed_ratio=False))
    assert "fully on-policy" in describe_update_regime(args) and "r_mix" not in describe_update_regime(args)
