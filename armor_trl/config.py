"""ArmorConfig: GRPOConfig plus ARMOR's fields, with ARMOR's defaults (β = 0, DAPO loss, clip 0.2 / 0.28)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from .mixed_ratio import default_alpha

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
ANCHOR_FILTERS = ("drop", "keep")


@dataclass
class ArmorConfig(GRPOConfig):
    r"""
    Configuration for [`ArmorGRPOTrainer`]: every [`trl.GRPOConfig`] field, plus the fields of ARMOR (Anchor Rollout
    and Mixed Optimization, arXiv 2607.10481). Defaults follow the paper: no KL penalty (`beta=0.0`), token-level
    DAPO loss, clip range 0.2 / 0.28.
    """

    armor_alpha: float | None = field(
        default=None,
        metadata={
            "help": "Mixing weight α of the current policy in π_mix = α·π_θ + (1−α)·π_ref. `None` means "
            "(G−1)/G from `num_generations`, which matches a group of G−1 on-policy samples and one anchor. Must lie "
            "in (0, 1]; α = 1 gives back the ordinary importance ratio."
        },
    )
    anchor_num_samples: int = field(
        default=4,
        metadata={"help": "Number of completions sampled from the reference per group to find a correct anchor."},
    )
    anchor_reward_threshold: float = field(
        default=1.0,
        metadata={
            "help": "Weighted total reward at or above which a reference candidate counts as correct (verified). A "
            "candidate for which any reward function returned None is never correct."
        },
    )
    anchor_filter: str = field(
        default="drop",
        metadata={
            "help": "What happens to a group whose reference candidates contain no correct one. 'drop': the group "
            "contributes nothing to the loss (the paper's query gate); 'keep': it trains as a plain group of G−1 "
            "on-policy completions.",
            "choices": list(ANCHOR_FILTERS),
        },
    )
    ref_reset_steps: int | None = field(
        default=None,
        metadata={
            "help": "τ: every τ optimizer steps the reference becomes a copy of the current policy. `None` = never "
            "(a static reference)."
        },
    )
    ref_reset_every_step_until: int | None = field(
        default=None,
        metadata={
            "help": "Hybrid schedule: reset the reference after every optimizer step up to and including this step, "
            "then follow `ref_reset_steps` (`None` there = frozen from then on)."
        },
    )
    anchor_cache: bool = field(
        default=False,
        metadata={
            "help": "Keep each prompt's verified anchor and reuse it until the next reference reset (the reference is "
            "unchanged, so it is still a verified sample of π_ref); new candidates are sampled only for prompts "
            "without one."
        },
    )
    anchor_cache_size: int = field(
        default=100_000,
        metadata={"help": "Most prompts the anchor cache holds; the least recently used go first."},
    )
    anchor_cache_failures: bool = field(
        default=False,
        metadata={
            "help": "With anchor_cache: also remember prompts whose candidates all failed (for the current reference) "
            "and count them as groups without an anchor on their next visits instead of sampling again, until the "
            "reference changes or `anchor_failure_retry_every` visits have passed; when a reference generation call "
            "happens anyway they are retried in it. Skips that call when every other group is cached; note it "
            "reuses a prompt's failure where the paper redraws candidates."
        },
    )
    anchor_failure_retry_every: int = field(
        default=4,
        metadata={"help": "A remembered failure is sampled again at the latest on every N-th visit of its prompt."},
    )
    use_anchors: bool = field(
        default=True,
        metadata={"help": "Put one reward-verified reference completion (the anchor) in every group. Ablation switch."},
    )
    use_mixed_ratio: bool = field(
        default=True,
        metadata={
            "help": "Use the mixed importance ratio r_mix = π_mix/π_mix,old in the clipped surrogate instead of "
            "π_θ/π_θ,old. Ablation switch."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Let a new (not resumed) run write into an output_dir that already holds checkpoints, which it may "
            "overwrite. Off by default, so an earlier run's checkpoints are never lost by accident."
        },
    )
    # ARMOR's defaults for fields that GRPOConfig already has.
    beta: float = field(
        default=0.0,
        metadata={"help": "KL coefficient. ARMOR replaces the KL penalty, so it must stay 0.0."},
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "Loss aggregation. ARMOR supports 'grpo', 'bnpo', 'dr_grpo' and 'dapo' (token-level, the paper's).",
        },
    )
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range ε_low of the (mixed) ratio."})
    epsilon_high: float | None = field(
        default=0.28, metadata={"help": "Upper clip range ε_high of the (mixed) ratio (DAPO's clip-higher)."}
    )

    def __post_init__(self):
        self._check_precision()
        super().__post_init__()
        self._check_armor_fields()

    def _check_precision(self) -> None:
        """Say what to do when bf16 (TRL's default) is asked for on a machine without bf16 support."""
        from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

        if self.bf16 and not self.use_cpu and not is_torch_bf16_gpu_available() and not is_torch_xla_available():
            raise ValueError(
                "bf16=True (TRL's default) needs a GPU with bf16 support, and none is available. On a CPU set "
                "bf16=False, or use_cpu=True to train in bf16 on the CPU."
            )

    @property
    def armor_enabled(self) -> bool:
        """Whether any part of ARMOR is on (with both switches off the trainer is plain GRPO)."""
        return self.use_anchors or self.use_mixed_ratio

    @property
    def resolved_alpha(self) -> float:
        """α actually used: `armor_alpha`, or (G−1)/G when it is None."""
        return default_alpha(self.num_generations) if self.armor_alpha is None else self.armor_alpha

    def _check_armor_fields(self) -> None:
        if self.armor_alpha is not None and not 0.0 < self.armor_alpha <= 1.0:
            raise ValueError(f"armor_alpha must lie in (0, 1] (or be None for (G-1)/G), got {self.armor_alpha}.")
        if self.anchor_num_samples < 1:
            raise ValueError(f"anchor_num_samples must be an integer >= 1, got {self.anchor_num_samples}.")
        if self.anchor_cache_size < 1:
            raise ValueError(f"anchor_cache_size must be an integer >= 1, got {self.anchor_cache_size}.")
        if self.anchor_failure_retry_every < 1:
            raise ValueError(
                f"anchor_failure_retry_every must be an integer >= 1, got {self.anchor_failure_retry_every}."
            )
        if self.anchor_cache_failures and not self.anchor_cache:
            raise ValueError("anchor_cache_failures=True needs anchor_cache=True (failures are kept in the anchor cache).")
        if self.anchor_filter not in ANCHOR_FILTERS:
            raise ValueError(f"anchor_filter must be one of {list(ANCHOR_FILTERS)}, got {self.anchor_filter!r}.")
        for name in ("ref_reset_steps", "ref_reset_every_step_until"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive number of optimizer steps or None, got {value}.")
        if not self.armor_enabled:
            return  # both switches off: plain GRPOTrainer, whatever GRPOConfig allows
        if self.beta != 0.0:
            raise ValueError(
                f"beta must be 0.0 with ARMOR (the anchor and the mixed ratio replace the KL penalty), got {self.beta}. "
                "To run the reverse-KL baseline use trl.GRPOTrainer, or set use_anchors=False and "
                "use_mixed_ratio=False."
            )
        if self.loss_type not in SUPPORTED_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {list(SUPPORTED_LOSS_TYPES)} with ARMOR, got {self.loss_type!r}.")
        if self.use_mixed_ratio and self.importance_sampling_level != "token":
            raise ValueError(
                "importance_sampling_level must be 'token' with use_mixed_ratio=True (the mixed ratio is per token), "
                f"got {self.importance_sampling_level!r}."
            )
        local_generation_batch = self.per_device_train_batch_size * self.steps_per_generation
        if local_generation_batch % self.num_generations != 0:
            raise ValueError(
                "per_device_train_batch_size * steps_per_generation "
                f"({self.per_device_train_batch_size} * {self.steps_per_generation} = {local_generation_batch}) must be "
                f"a multiple of num_generations ({self.num_generations}) with ARMOR, so that every group, and its "
                "anchor, lives on one process."
            )
