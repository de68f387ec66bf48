"""checks: the update regime (fully on-policy or M optimizer steps per rollout batch) and the vLLM settings a trainer cannot run with."""

from types import SimpleNamespace

import pytest

from armor_trl import ArmorConfig
from armor_trl.integration.checks import (check_fsdp_version, describe_reset_timing, describe_update_regime, log_update_regime,
                                          optimizer_steps_per_rollout, reset_timing, rollout_end_steps)
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


@pytest.mark.parametrize("fields, period", [
    (dict(), 1), (dict(steps_per_generation=8), 8), (dict(steps_per_generation=8, gradient_accumulation_steps=2), 4),
    (dict(num_iterations=2), 2), (dict(steps_per_generation=3, gradient_accumulation_steps=2), 3),  # lcm(3, 2) / 2
])
def test_rollout_batches_end_every_so_many_optimizer_steps(tmp_path, fields, period):
    assert rollout_end_steps(ArmorConfig(output_dir=str(tmp_path), **cpu_args(**fields))) == period


@pytest.mark.parametrize("fields, moved, every_step", [
    (dict(ref_reset_steps=16, ref_reset_at_steps=[8, 32]), [], False),  # on rollout-batch ends: nothing to say
    (dict(ref_reset_steps=25), ["ref_reset_steps=25"], False),
    (dict(ref_reset_at_steps=[1, 2, 4, 8, 16]), ["ref_reset_at_steps=[1, 2, 4]"], False),
    (dict(ref_reset_every_step_until=100), [], True),
])
def test_a_schedule_with_resets_inside_rollout_batches_is_named_at_start_up(tmp_path, fields, moved, every_step):
    args = ArmorConfig(output_dir=str(tmp_path), **cpu_args(steps_per_generation=8, **fields))
    assert reset_timing(args) == (moved, every_step)
    logged = []

    class Logger:
        def warning(self, text):
            logged.append(("warning", text))

        def info(self, text):
            logged.append(("info", text))

    log_update_regime(args, Logger())
    resets = [entry for entry in logged if entry[1].startswith("reference resets")]
    if not (moved or every_step):
        assert not resets
        return
    assert resets == [("warning" if moved else "info", describe_reset_timing(args))]
    text = resets[0][1]
    assert all(name.split("=")[0] in text for name in moved)
    assert "steps_per_generation=8" in text and "gradient_accumulation_steps=1" in text and "multiples of 8" in text


@pytest.mark.parametrize("fields", [dict(), dict(vllm_reference_server_port=8001)])
def test_vllm_server_mode_on_a_cpu_is_refused_at_construction_naming_colocate(tiny_model_path, tiny_tokenizer,
                                                                                prompt_dataset, tmp_path, fields):
    from armor_trl import ArmorGRPOTrainer
    from testing import has_digit_reward

    args = ArmorConfig(output_dir=str(tmp_path), **cpu_args(use_vllm=True, vllm_mode="server", **fields))
    with pytest.raises(ValueError, match="vllm_mode='server' needs the trainer on a CUDA device.*vllm_mode='colocate'"):
        ArmorGRPOTrainer(model=tiny_model_path, reward_funcs=has_digit_reward, args=args, train_dataset=prompt_dataset,
                         processing_class=tiny_tokenizer)


@pytest.mark.parametrize("fields, message", [
    (dict(vllm_enforce_eager=True), "vllm_enforce_eager sets an option of the colocated vLLM engine"),
    (dict(vllm_dtype="float32", use_vllm=True, vllm_mode="server"), "vllm_dtype sets an option"),
    (dict(vllm_dtype="fp32", use_vllm=True), "vllm_dtype must be one of"),
])
def test_colocated_engine_options_are_checked(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        ArmorConfig(output_dir=str(tmp_path), **cpu_args(**fields))


@pytest.mark.parametrize("version", [1, 2, None])
def test_fsdp1_is_refused_naming_fsdp_version_2(version):
    plugin = None if version is None else SimpleNamespace(fsdp_version=version)
    trainer = SimpleNamespace(is_fsdp_enabled=plugin is not None,
                              accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))
    if version == 1:
        with pytest.raises(ValueError, match=r"needs fsdp_version 2, got 1.*fsdp_version: 2 in the accelerate config"):
            check_fsdp_version(trainer)
    else:
        check_fsdp_version(trainer)  # FSDP2, or no FSDP: nothing to refuse
