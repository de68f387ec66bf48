"""ArmorMetrics.loss_ratios: clip shares and ratio deviations per row type, on scripted tensors and in training."""

import math
from collections import defaultdict
from types import SimpleNamespace

import torch

from armor_trl.integration.metrics import ArmorMetrics
from armor_trl.algorithm.mixture import clip_masks, mixed_logprobs, mixed_ratio
from testing import logged, make_trainer


class OneProcess:
    """The accelerator calls ArmorMetrics makes, for one process."""

    def reduce(self, tensor, reduction):
        return tensor

    def gather(self, tensor):
        return tensor


def metrics_of(inputs, logps, ref_logps=None, alpha=0.5, eps=(0.2, 0.28), level="token", loss_type="dapo") -> dict:
    trainer = SimpleNamespace(accelerator=OneProcess(), _metrics={"train": defaultdict(list)}, loss_type=loss_type)
    ArmorMetrics(trainer).loss_ratios(inputs, logps, None, ref_logps, alpha, *eps, level)
    return {name: values[-1] for name, values in trainer._metrics["train"].items()}


def scripted_batch():
    torch.manual_seed(0)
    logps = -torch.rand(6, 5) * 3
    return {
        "completion_mask": torch.tensor([[1, 1, 1, 1, 0]] * 5 + [[0, 0, 0, 0, 0]]),
        "advantages": torch.tensor([1.0, -1.0, 0.5, -2.0, 1.0, 1.0]),
        "armor_is_anchor": torch.tensor([False, False, False, True, True, False]),
        "old_per_token_logps": logps + torch.randn(6, 5),  # far from π_θ: many tokens outside the clip range
    }, logps, logps - torch.rand(6, 5)


def test_clip_masks_are_trls_one_sided_tests():
    ratio = torch.tensor([[0.5, 0.9, 1.0, 1.5], [0.5, 1.1, 1.3, 2.0]])
    advantages = torch.tensor([-1.0, 1.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    low, high = clip_masks(ratio, advantages, mask, 0.2, 0.28)
    # low: r < 0.8 with A < 0 (row 0 only); high: r > 1.28 with A > 0 (row 1 only); masked tokens never count
    assert low.tolist() == [[True, False, False, False], [False, False, False, False]]
    assert high.tolist() == [[False, False, False, False], [False, False, True, True]]
    per_token = clip_masks(ratio, advantages.unsqueeze(1).expand(2, 4), mask, 0.2, 0.28)
    assert all(torch.equal(a, b) for a, b in zip(per_token, (low, high)))


def test_clip_masks_follow_what_each_loss_type_clips():
    ratio = torch.tensor([[0.5, 0.9, 1.0, 1.5], [0.5, 1.1, 1.3, 2.0]])
    advantages = torch.tensor([-1.0, 1.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    surrogate = clip_masks(ratio, advantages, mask, 0.2, 0.28)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "luspo"):  # the clipped surrogate, as dapo
        assert all(torch.equal(a, b) for a, b in zip(clip_masks(ratio, advantages, mask, 0.2, 0.28, loss_type), surrogate))
    # CISPO caps the weight min(r, ε_high) whatever the sign of A, and has no lower clip
    low, high = clip_masks(ratio, advantages, mask, 0.2, 1.2, "cispo")
    assert not low.any() and high.tolist() == [[False, False, False, False], [False, False, True, True]]
    low, high = clip_masks(ratio, -advantages, mask, 0.2, 1.2, "cispo")
    assert high.tolist() == [[False, False, False, False], [False, False, True, True]]
    for loss_type in ("sapo", "vespo"):  # soft weights, no clip
        assert not any(m.any() for m in clip_masks(ratio, advantages, mask, 0.2, 0.28, loss_type))


def test_at_sequence_level_the_mixed_clip_shares_are_on_each_rows_mixed_ratio():
    inputs, logps, ref = scripted_batch()
    inputs["old_per_token_logps"][1] = logps[1] + 1.0  # row 1 (A < 0): its mixed ratios well below 1
    got = metrics_of(inputs, logps, ref, alpha=0.5, level="sequence")
    mask = inputs["completion_mask"].bool()
    log_ratio = mixed_logprobs(logps, ref, 0.5) - mixed_logprobs(inputs["old_per_token_logps"], ref, 0.5)
    row_ratio = torch.exp((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1))  # GSPO's, on the mixture
    low_rows = (row_ratio < 0.8) & (inputs["advantages"] < 0)
    high_rows = (row_ratio > 1.28) & (inputs["advantages"] > 0)
    assert low_rows[1]
    assert got["armor/clip_low_frac"] == (mask.sum(1) * low_rows).sum().item() / mask.sum().item()
    assert got["armor/clip_high_frac"] == (mask.sum(1) * high_rows).sum().item() / mask.sum().item()
    policy = ~inputs["armor_is_anchor"] & mask.any(1)
    assert math.isclose(got["armor/ratio_policy_min"], row_ratio[policy].min().item(), rel_tol=1e-6)
    per_token = metrics_of(inputs, logps, ref, alpha=0.5)  # the token level clips r_mix per token: other shares
    assert per_token["armor/clip_low_frac"] != got["armor/clip_low_frac"]
    # the per-token deviation of r_mix is logged at both levels
    assert got["armor/policy_abs_mixed_ratio_dev_max"] == per_token["armor/policy_abs_mixed_ratio_dev_max"]
    # SAPO and VESPO clip nothing; CISPO counts the weights ε_high caps
    assert metrics_of(inputs, logps, ref, level="sequence", loss_type="sapo")["armor/clip_low_frac"] == 0.0
    cispo = metrics_of(inputs, logps, ref, eps=(0.2, 0.9), level="sequence", loss_type="cispo")
    assert cispo["armor/clip_high_frac"] == (mask.sum(1) * (row_ratio > 0.9)).sum().item() / mask.sum().item() > 0


def test_the_mixed_clip_shares_count_what_the_loss_clips():
    inputs, logps, ref = scripted_batch()
    got = metrics_of(inputs, logps, ref, alpha=0.5)
    mask = inputs["completion_mask"].bool()
    ratio = mixed_ratio(logps, inputs["old_per_token_logps"], ref, 0.5)
    adv = inputs["advantages"].unsqueeze(1)
    low = (ratio < 0.8) & (adv < 0) & mask
    high = (ratio > 1.28) & (adv > 0) & mask
    anchor = inputs["armor_is_anchor"].unsqueeze(1) & mask
    policy = ~inputs["armor_is_anchor"].unsqueeze(1) & mask
    assert low.sum() > 0 and high.sum() > 0  # the scripted case makes the mixed clip bind both ways
    assert got["armor/clip_low_frac"] == low.sum().item() / mask.sum().item()
    assert got["armor/clip_high_frac"] == high.sum().item() / mask.sum().item()
    for kind, rows in (("policy", policy), ("anchor", anchor)):
        assert math.isclose(got[f"armor/{kind}_clip_low_frac"], (low & rows).sum().item() / rows.sum().item())
        assert math.isclose(got[f"armor/{kind}_clip_high_frac"], (high & rows).sum().item() / rows.sum().item())
        deviation = (ratio - 1).abs()[rows]
        assert math.isclose(got[f"armor/{kind}_abs_mixed_ratio_dev_max"], deviation.max().item(), rel_tol=1e-6)
        assert math.isclose(got[f"armor/{kind}_abs_mixed_ratio_dev_mean"], deviation.mean().item(), rel_tol=1e-5)
        plain = (torch.exp(logps - inputs["old_per_token_logps"]) - 1).abs()[rows]
        assert math.isclose(got[f"armor/{kind}_abs_ratio_dev_max"], plain.max().item(), rel_tol=1e-6)
        assert math.isclose(got[f"armor/ratio_{kind}_min"], ratio[rows].min().item(), rel_tol=1e-6)


def test_without_the_mixed_ratio_the_plain_ratio_is_clipped_and_no_mixed_metric_is_logged():
    inputs, logps, _ = scripted_batch()
    got = metrics_of(inputs, logps)
    mask = inputs["completion_mask"].bool()
    ratio = torch.exp(logps - inputs["old_per_token_logps"])
    low = (ratio < 0.8) & (inputs["advantages"].unsqueeze(1) < 0) & mask
    assert low.sum() > 0 and got["armor/clip_low_frac"] == low.sum().item() / mask.sum().item()
    assert not any("mixed" in name or "kl_" in name for name in got)
    # sequence-level importance sampling clips each row's ratio exp(mean log-ratio), as TRL's loss does
    inputs["old_per_token_logps"][1] = logps[1] + 1.0  # row 1 (A < 0): sequence ratio e^-1, clipped low
    sequence = metrics_of(inputs, logps, level="sequence")
    log_ratio = ((logps - inputs["old_per_token_logps"]) * mask).sum(1) / mask.sum(1).clamp(min=1)
    rows = (log_ratio.exp() < 0.8) & (inputs["advantages"] < 0)
    assert rows[1] and sequence["armor/clip_low_frac"] > 0
    assert sequence["armor/clip_low_frac"] == (mask.sum(1) * rows).sum().item() / mask.sum().item()


def test_on_policy_rows_without_old_logps_have_ratio_one_and_anchor_metrics_need_anchor_tokens():
    inputs, logps, ref = scripted_batch()
    del inputs["old_per_token_logps"]  # TRL's one-step regime: π_old = π_θ
    inputs["armor_is_anchor"] = torch.zeros(6, dtype=torch.bool)
    got = metrics_of(inputs, logps, ref)
    assert got["armor/clip_low_frac"] == got["armor/clip_high_frac"] == 0.0
    assert got["armor/policy_abs_ratio_dev_max"] == got["armor/policy_abs_mixed_ratio_dev_max"] == 0.0
    assert not any(name.startswith(("armor/anchor_", "armor/ratio_anchor")) for name in got)  # no anchor tokens


def test_the_mixed_ratio_leaves_one_from_the_second_mini_batch_of_a_rollout_batch(
    tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path
):
    # one rollout batch of 8 prompts x 4, split into 4 mini-batches with one optimizer step each, at a high lr
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, per_device_train_batch_size=8,
                           steps_per_generation=4, max_steps=4, learning_rate=0.05, use_anchors=False,
                           armor_alpha=0.7)
    trainer.train()
    deviation = logged(trainer, "armor/policy_abs_mixed_ratio_dev_max")
    assert len(deviation) == 4
    assert deviation[0] < 1e-5  # the first mini-batch: π_θ = π_old (up to the batching of the forward passes)
    assert min(deviation[1:]) > 1e-3  # the policy has moved away from π_old within the rollout batch
    assert all(value > 1e-3 for value in logged(trainer, "armor/policy_abs_ratio_dev_max")[1:])


# --- the anchor mode diagnostic (anchor_mode_classifier) -------------------------------------------------------
def first_letter(text: str) -> str:
    return text[:1] or "empty"


def test_anchor_modes_count_the_kept_rows_of_each_type(tiny_tokenizer):
    """Shares over the kept rows only (a dropped group's rows and empty slots never count), anchors apart from
    on-policy rows; the kept anchors' count and mean advantage."""
    from armor_trl.algorithm.loss_rows import KEPT_ROWS

    texts = ["ab", "ac", "bd", "ae",   # group 0: three on-policy rows, anchor "ae" (row 3)
             "bb", "bc", "ad", "be",   # group 1: kept too, anchor "be"
             "cc", "cd", "ce", "cf"]   # group 2: dropped by the gate (anchor "cf" never counts)
    ids = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    pad = tiny_tokenizer.pad_token_id
    output = {
        "completion_ids": torch.tensor([row + [pad] * (width - len(row)) for row in ids]),
        "completion_mask": torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids]),
        "advantages": torch.tensor([0.5, -0.5, 0.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
        KEPT_ROWS: torch.tensor([True] * 8 + [False] * 4),
    }
    is_anchor = torch.tensor([False, False, False, True] * 3)
    trainer = SimpleNamespace(accelerator=OneProcess(), _metrics={"train": defaultdict(list)},
                              processing_class=tiny_tokenizer)
    ArmorMetrics(trainer).anchor_modes(output, is_anchor, first_letter)
    got = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert got["armor/anchor_mode/a"] == 0.5 and got["armor/anchor_mode/b"] == 0.5
    assert got["armor/policy_mode/a"] == 3 / 6 and got["armor/policy_mode/b"] == 3 / 6
    assert not any(name.endswith("/c") for name in got)  # the dropped group's modes
    assert got["armor/anchors_kept"] == 2
    assert got["armor/kept_anchor_advantage_mean"] == 0.75


def test_anchor_modes_are_logged_in_training(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    """The trainer calls the diagnostic every round when anchor_mode_classifier is set (and not otherwise)."""
    trainer = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path, max_steps=2,
                           anchor_mode_classifier="test_armor_metrics:first_letter")
    trainer.train()
    policy = {k: v for h in trainer.state.log_history for k, v in h.items() if k.startswith("armor/policy_mode/")}
    assert policy and all(0.0 <= v <= 1.0 for v in policy.values())
    kept = logged(trainer, "armor/anchors_kept")
    assert kept
    anchors = [k for h in trainer.state.log_history for k in h if k.startswith("armor/anchor_mode/")]
    assert bool(anchors) == (max(kept) > 0)
    plain = make_trainer(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path / "off", max_steps=1)
    plain.train()
    assert not logged(plain, "armor/anchors_kept")


def test_anchor_mode_classifier_is_checked_at_construction(tmp_path):
    import pytest

    from armor_trl import ArmorConfig

    with pytest.raises(ValueError, match="anchor_mode_classifier 'no_such_mode'"):
        ArmorConfig(output_dir=str(tmp_path), anchor_mode_classifier="no_such_mode", report_to="none", use_cpu=True)


def test_anchor_modes_split_by_prompt_type(tiny_tokenizer):
    """anchor_mode_prompt_classifier: each prompt type's shares apart (anchors and on-policy rows), beside the overall
    shares; the carry prompts' anchors are counted only under `carry/`."""
    from armor_trl.rewards.modes import prompt_needs_carry

    prompts = ["15+17="] * 4 + ["12+13="] * 4  # group 0 needs a carry, group 1 does not
    texts = ["ab", "ac", "bd", "ae", "bb", "bc", "ad", "be"]

    def padded(strings, left):
        ids = [tiny_tokenizer(s, add_special_tokens=False)["input_ids"] for s in strings]
        width, pad = max(map(len, ids)), tiny_tokenizer.pad_token_id
        rows = [([pad] * (width - len(r)) + r) if left else (r + [pad] * (width - len(r))) for r in ids]
        masks = [([0] * (width - len(r)) + [1] * len(r)) if left else ([1] * len(r) + [0] * (width - len(r)))
                 for r in ids]
        return torch.tensor(rows), torch.tensor(masks)

    prompt_ids, prompt_mask = padded(prompts, left=True)
    completion_ids, completion_mask = padded(texts, left=False)
    output = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.zeros(8)}
    is_anchor = torch.tensor([False, False, False, True] * 2)
    trainer = SimpleNamespace(accelerator=OneProcess(), _metrics={"train": defaultdict(list)},
                              processing_class=tiny_tokenizer)
    ArmorMetrics(trainer).anchor_modes(output, is_anchor, first_letter, prompt_needs_carry)
    got = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert got["armor/anchor_mode/carry/a"] == 1.0 and got["armor/anchor_mode/no_carry/b"] == 1.0
    assert "armor/anchor_mode/carry/b" not in got and "armor/anchor_mode/no_carry/a" not in got
    assert got["armor/policy_mode/carry/a"] == 2 / 3 and got["armor/policy_mode/no_carry/b"] == 2 / 3
    assert got["armor/anchor_mode/a"] == 0.5 and got["armor/policy_mode/b"] == 3 / 6  # overall, as before


def test_the_carry_prompt_classifier_reads_the_problem():
    from armor_trl.rewards.modes import prompt_needs_carry, resolve_prompt_classifier

    assert resolve_prompt_classifier("arithmetic_needs_carry") is prompt_needs_carry
    assert [prompt_needs_carry(p) for p in ("125+307=", "Add: 121+302=", "hello")] == ["carry", "no_carry", "other"]


def test_the_prompt_classifier_needs_the_mode_classifier_and_a_known_name(tmp_path):
    import pytest

    from armor_trl import ArmorConfig

    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="needs anchor_mode_classifier"):
        ArmorConfig(anchor_mode_prompt_classifier="arithmetic_needs_carry", **common)
    with pytest.raises(ValueError, match="anchor_mode_prompt_classifier 'nope'"):
        ArmorConfig(anchor_mode_classifier="arithmetic_carries", anchor_mode_prompt_classifier="nope", **common)
