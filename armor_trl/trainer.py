"""ArmorGRPOTrainer: TRL's GRPOTrainer with Anchor Rollout, Mixed Optimization and reference resets.

How one generation round differs from GRPO (train mode, ARMOR on):

1. ``_generate_single_turn`` samples G−1 on-policy completions per group (not G), samples
   ``anchor_num_samples`` candidates per group from π_ref, scores them with the trainer's own
   reward functions (quietly, see ``trl_seam.score_quietly``) and puts the first verified one in the
   group's last row. Rewards and advantages are then computed by TRL with the anchor as a member.
2. ``_generate_and_score_completions`` adds π_ref's per-token log-probs and an anchor flag to the
   batch (they travel with their rows through TRL's shuffle and split), and masks groups per
   ``anchor_filter``.
3. ``_compute_loss`` lets TRL build its clipped surrogate from mixture log-probs
   log(α·π + (1−α)·π_ref) for both the current and old policy, which makes TRL's ratio r_mix.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os

import torch
from accelerate.utils import gather, is_peft_model
from transformers import ProcessorMixin
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import logging
from trl import GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.trainer.utils import add_fused_lm_head, create_model_from_path, disable_dropout_in_model, get_config_model_id

from . import trl_seam as seam
from .advantages import DROP_REASONS, dynamic_sampling_keep, group_advantages
from .anchors import AnchorCache, anchor_rows, fill_groups, policy_rows, select_anchors, verified_mask
from .column_anchors import ColumnAnchors, verify_round
from .collapse_guard import CollapseGuard
from .config import ArmorConfig
from .mixture import k3_kl, mixed_logprobs
from .reference import ReferencePolicy, ReferenceResetCallback, copy_model_for_reference, latest_complete_checkpoint
from .refill import RefillSampler, concat_rows, take_rows
from .reward_checks import checked
from .rewards import math_verify_reward, verifier_timeouts
from .vllm_reference import ReferenceServer
from .vllm_swap import neutral_sampling_logprobs, reference_in_engine

logger = logging.get_logger(__name__)

# ArmorConfig fields of DAPO's loop and the ablations that a resumed run must share with its checkpoint.
LOOP_FIELDS = (
    "dynamic_sampling", "dynamic_sampling_keep_unsolved", "dynamic_sampling_max_rounds", "advantage_quantile",
    "armor_alpha_decay_steps", "ref_reset_at_steps", "anchor_selection", "anchor_gate_only", "off_policy_ratio",
    "mask_negative_anchor_advantage", "anchor_reward_funcs", "anchors_per_group", "anchor_loss_weight",
    "anchor_source", "anchor_column", "anchor_cache_per_prompt",
    "collapse_guard",
)


def group_rows(groups: list[int], group_size: int) -> list[int]:
    """Row indices of the given groups (G consecutive rows each)."""
    return [g * group_size + j for g in groups for j in range(group_size)]


class ArmorGRPOTrainer(GRPOTrainer):
    """Drop-in replacement for ``trl.GRPOTrainer`` that trains with ARMOR (arXiv 2607.10481).

    Takes every argument of ``GRPOTrainer`` (with an [`ArmorConfig`] as ``args``) plus ``ref_model``:
    the initial reference policy, as a path, hub id or model instance. ``None`` means a copy of the
    initial policy (for LoRA: a frozen copy of the initial adapter).
    """

    _tag_names = ["trl", "grpo", "armor"]
    # Read by TRL's model-card generator (create_model_card): cards name ARMOR and cite its paper, not DeepSeekMath.
    _name = "ARMOR"
    _paper = {
        "title": "ARMOR: Anchor Rollout and Mixed Optimization for RL",
        "id": "2607.10481",
        "citation": (
            "@misc{armor2026,\n"
            "    title         = {{ARMOR: Anchor Rollout and Mixed Optimization for RL}},\n"
            "    year          = 2026,\n"
            "    eprint        = {2607.10481},\n"
            "    archivePrefix = {arXiv},\n"
            "    url           = {https://arxiv.org/abs/2607.10481},\n"
            "}"
        ),
    }

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: ArmorConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        ref_model=None,
    ):
        if args is None:
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = ArmorConfig(f"{name.split('/')[-1]}-ARMOR")
        if not isinstance(args, ArmorConfig):
            raise ValueError(
                f"args must be an armor_trl.ArmorConfig, got {type(args).__name__}. ArmorConfig accepts every "
                "GRPOConfig field: replace GRPOConfig(...) with ArmorConfig(...)."
            )
        uses_peft = peft_config is not None or (not isinstance(model, str) and is_peft_model(model))
        self._check_combinations(args, processing_class, tools, rollout_func, environment_factory, ref_model, uses_peft)
        if args.armor_enabled:
            self._check_inputs(train_dataset, processing_class, environment_factory)

        self.reference: ReferencePolicy | None = None
        self._reference_server: ReferenceServer | None = None  # π_ref on a second vLLM server
        self.anchor_cache = None
        if args.anchor_cache and args.use_anchors:
            self.anchor_cache = AnchorCache(args.anchor_cache_size, args.anchor_cache_per_prompt)
        self._armor_inputs = None  # the rows of the generation round being built (anchor rounds only)
        self._armor_round = None  # anchors found in that round
        self._armor_loss_ctx = None  # reference log-probs of the micro-batch whose loss is being computed
        self._round_rewards = None  # gathered rewards (rows, reward functions) of the round being scored
        self._warned_short_batch = False
        # anchor slots per group: none when the anchor only gates its group (anchor_gate_only)
        self._anchor_slots = 0 if args.anchor_gate_only else args.anchors_per_group
        # optimizer step ARMOR started at: 0, or None while it is dormant (collapse_guard="armor" before the switch)
        self.armor_started_at: int | None = None if args.collapse_guard == "armor" else 0
        # A policy instance is copied before TRL patches its forward (a later deep copy would keep that patch).
        ref_copy = None
        if args.armor_enabled and not uses_peft and ref_model is None and not isinstance(model, str):
            ref_copy = copy_model_for_reference(model)

        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        self._refill = self._build_refill_sampler() if args.dynamic_sampling else None
        self._uses_verifier = any(getattr(f, "__wrapped__", f) is math_verify_reward for f in self.reward_funcs)
        self._verifier_timeouts_seen = verifier_timeouts()
        self.collapse_guard = CollapseGuard(self) if args.collapse_guard else None
        if not args.armor_enabled:
            return  # both ablation switches off: GRPOTrainer (plus dynamic sampling / QAE where asked for)
        self.reward_funcs = [
            func if isinstance(func, torch.nn.Module) or inspect.iscoroutinefunction(func) else checked(func, name)
            for func, name in zip(self.reward_funcs, self.reward_func_names)
        ]
        self._warned_no_anchor = False
        if args.use_anchors and self._is_vlm:
            raise ValueError("use_anchors=True does not support vision-language models (multimodal prompts) yet.")
        self._anchor_funcs = self._anchor_func_mask(args.anchor_reward_funcs)
        self._column_anchors = None
        if args.use_anchors and args.anchor_source == "column":
            self._column_anchors = ColumnAnchors(args.anchor_column, args.seed, self._tokenizer, self.max_completion_length)
            self._column_anchors.check_dataset(train_dataset)
        if is_peft_model(self.model):
            self._check_lora_with_vllm()
            self.reference = ReferencePolicy.lora(self.model)
        else:
            self.reference = ReferencePolicy.full(self._build_reference_model(ref_model, ref_copy, quantization_config))
            if ref_model is None:
                self.reference.synced_step = self.reference.weights_step = 0  # a copy of the initial policy
        self.add_callback(
            ReferenceResetCallback(
                self.reference, self._unwrapped_policy, args.ref_reset_steps, args.ref_reset_every_step_until,
                args.ref_reset_at_steps, start_step=lambda: self.armor_started_at,
            )
        )
        if args.vllm_reference_server_url is not None:
            # A reference built from a path is assumed to be what the server was started with; otherwise it is pushed.
            from_path = self.reference.kind == "full" and ref_copy is None and not isinstance(ref_model, torch.nn.Module)
            self._reference_server = ReferenceServer.connect(self, holds_initial_reference=from_path)

    def _check_lora_with_vllm(self) -> None:
        # TRL's vLLM weight sync maps "modules_to_save.default." and the trainable-token delta of the *trained*
        # adapter onto the base names, so with the "ref" adapter active it would push the policy's copy of them.
        config = self.model.peft_config[self.model.active_adapter]
        extra = [name for name in ("modules_to_save", "trainable_token_indices") if getattr(config, name, None)]
        if self.use_vllm and self.args.use_anchors and extra:
            raise ValueError(
                f"LoRA with {' and '.join(extra)} cannot sample anchors through vLLM: TRL's weight sync would push the "
                "policy's copy of those weights instead of the reference's. Use target_modules only (plain LoRA), or "
                "use_vllm=False."
            )

    @property
    def armor_alpha(self) -> float:
        """α of the mixture at the current optimizer step (constant unless `armor_alpha_decay_steps` is set)."""
        return self.args.alpha_at(self.state.global_step - (self.armor_started_at or 0))

    @property
    def armor_active(self) -> bool:
        """Whether ARMOR acts now: a reference exists and ARMOR is not dormant (see `collapse_guard`)."""
        return self.reference is not None and self.armor_started_at is not None

    def _anchor_func_mask(self, names) -> torch.Tensor | None:
        """(F,) bool: the reward functions that decide whether a candidate is correct (None = all)."""
        if names is None:
            return None
        unknown = sorted(set(names) - set(self.reward_func_names))
        if unknown:
            raise ValueError(
                f"anchor_reward_funcs names {unknown}, which are not among this trainer's reward functions "
                f"{self.reward_func_names}."
            )
        return torch.tensor([name in names for name in self.reward_func_names])

    def _build_refill_sampler(self) -> RefillSampler:
        if self._is_vlm:
            raise ValueError("dynamic_sampling=True does not support vision-language models (multimodal prompts) yet.")
        if self.args.per_device_train_batch_size * self.args.steps_per_generation % self.num_generations:
            raise ValueError(
                "dynamic_sampling=True needs per_device_train_batch_size * steps_per_generation to be a multiple of "
                f"num_generations ({self.num_generations}), so that every group lives on one process."
            )
        size = len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None
        if size is None:
            if self.args.dynamic_sampling_max_rounds > 1:
                raise ValueError(
                    "dynamic_sampling refill draws prompts by index, which an IterableDataset cannot give: set "
                    "dynamic_sampling_max_rounds=1 (drop without refill) or use a map-style Dataset."
                )
            size = 1
        return RefillSampler(size, self.args.seed)

    # --- construction ------------------------------------------------------------------------------------------
    @staticmethod
    def _check_combinations(args, processing_class, tools, rollout_func, environment_factory, ref_model, uses_peft):
        if not args.armor_enabled:
            return
        if ref_model is not None and uses_peft:
            raise ValueError(
                "ref_model cannot be combined with LoRA (peft_config or a PeftModel): the LoRA reference is a frozen "
                "copy of the adapter. Merge the adapter you want as reference into the base model instead."
            )
        if not args.use_anchors:
            return
        unsupported = {
            "use_transformers_continuous_batching=True": args.use_transformers_continuous_batching,
            "tools": bool(tools),
            "rollout_func": rollout_func is not None,
            "environment_factory": environment_factory is not None,
            "a multimodal processing_class": isinstance(processing_class, ProcessorMixin),
        }
        for what, present in unsupported.items():
            if present:
                raise ValueError(
                    f"use_anchors=True is not supported with {what} yet: anchors are sampled on the transformers or "
                    "vLLM generation path. Set use_anchors=False to train with the mixed ratio only, or drop that option."
                )

    @staticmethod
    def _check_inputs(train_dataset, processing_class, environment_factory):
        columns = getattr(train_dataset, "column_names", None)
        if environment_factory is None and columns is not None and "prompt" not in columns:
            raise ValueError(
                f"train_dataset needs a 'prompt' column (a string or a list of chat messages); it has {columns}. "
                "Rename your question column to 'prompt', e.g. dataset.rename_column('question', 'prompt')."
            )
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        if tokenizer is not None and tokenizer.pad_token is None and tokenizer.eos_token is None:
            raise ValueError(
                "processing_class has neither a pad token nor an eos token; GRPO pads with the pad token (or eos). "
                "Set tokenizer.pad_token (and eos_token) before creating the trainer."
            )

    def _check_prompt_lengths(self, prompt_ids: list) -> None:
        limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        longest = max(len(ids) for ids in prompt_ids)
        if limit is not None and longest + self.max_completion_length > limit:
            raise ValueError(
                f"A prompt is {longest} tokens long; with max_completion_length={self.max_completion_length} that "
                f"exceeds the model's max_position_embeddings ({limit}). Filter or truncate long prompts, or lower "
                "max_completion_length."
            )

    def _build_reference_model(self, ref_model, ref_copy, quantization_config):
        args = self.args
        if isinstance(ref_model, torch.nn.Module):
            reference = ref_model
        elif ref_copy is not None:
            reference = ref_copy
        else:
            source = ref_model if isinstance(ref_model, str) else get_config_model_id(self.model.config)
            init_kwargs = dict(args.model_init_kwargs or {})
            if quantization_config is not None:
                init_kwargs["quantization_config"] = quantization_config
            if args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
                init_kwargs["device_map"] = None
            init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
            init_kwargs.setdefault("dtype", self.model.dtype)
            try:
                reference = create_model_from_path(source, **init_kwargs)
            except (OSError, ValueError) as error:
                raise ValueError(f"ref_model {source!r} could not be loaded as a causal LM: {error}") from error
        if args.disable_dropout:
            disable_dropout_in_model(reference)
        if args.cast_lm_head_to_fp32:  # as GRPOTrainer casts the policy's head, so a reset copies it exactly
            from .reference import cast_lm_head_to_fp32

            cast_lm_head_to_fp32(reference)
        add_fused_lm_head(reference, temperature=self.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(reference, self.accelerator)
        if self.is_fsdp_enabled:
            return prepare_fsdp(reference, self.accelerator)
        return self.accelerator.prepare_model(reference, evaluation_mode=True)

    def _unwrapped_policy(self):
        return self.accelerator.unwrap_model(self.model_wrapped)

    def _reference_model(self):
        """The model to run as π_ref: the separate reference, or the policy itself with the "ref" adapter active."""
        return self.reference.model if self.reference.kind == "full" else self.model

    def _reference_ready(self):
        """Context in which ``_reference_model()`` computes π_ref (activates the LoRA "ref" adapter)."""
        return self.reference.active(self._unwrapped_policy())

    # --- one generation batch: rounds of generation, dynamic sampling, advantages -----------------------------
    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return self._score_round(inputs)
        if self._refill is not None:
            output = self._dynamic_sampling_batch(inputs)
        else:
            output = self._score_round(inputs)
            if self.args.advantage_quantile is not None:
                keep = output["advantages"].new_ones(len(inputs) // self.num_generations, dtype=torch.bool)
                if self._armor_round is not None and self.args.anchor_filter == "drop":
                    keep = self._armor_round["has_anchor"].to(keep.device)
                output["advantages"] = self._recompute_advantages(output["armor_reward"], keep)
        output.pop("armor_reward")
        self._armor_round = None
        if "armor_is_anchor" in output:
            self._shape_anchor_advantages(output)
        return output

    def _score_round(self, inputs):
        """One generation round, scored by TRL, with ARMOR's fields added (train mode)."""
        training = self.model.training
        self._armor_inputs = inputs if training and self.armor_active and self.args.use_anchors else None
        self._armor_round = None
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._armor_inputs = None
        if training and self.armor_active:
            output = self._add_armor_fields(output)
        if training:
            rows = len(inputs)
            totals = self._total_rewards(self._round_rewards)
            rank = self.accelerator.process_index
            output["armor_reward"] = totals[rank * rows : (rank + 1) * rows]
        else:
            self._armor_round = None
        return output

    def _total_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """TRL's total reward per row: weighted sum with None as 0; NaN where no function could score the row."""
        total = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)).nansum(dim=1)
        total[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
        return total

    def _recompute_advantages(self, local_rewards: torch.Tensor, local_keep: torch.Tensor) -> torch.Tensor:
        """Group advantages over all processes' rows (collective), returned for this process's rows."""
        rewards, keep = self.accelerator.gather(local_rewards), self.accelerator.gather(local_keep)
        advantages = group_advantages(
            rewards, self.num_generations, self.scale_rewards, self.args.advantage_quantile, keep
        )
        rank, rows = self.accelerator.process_index, len(local_rewards)
        return advantages[rank * rows : (rank + 1) * rows]

    def _round_keep(self, output: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic sampling's decision for each local group of a round, and the reason of each drop."""
        group_size = self.num_generations
        rewards = output["armor_reward"].view(-1, group_size)
        on_policy = torch.ones(group_size, dtype=torch.bool)
        has_anchor, gate = None, False
        if self._armor_round is not None:
            on_policy[group_size - self._anchor_slots :] = False
            has_anchor = self._armor_round["has_anchor"].to(rewards.device)
            gate = self.args.anchor_filter == "drop"
        return dynamic_sampling_keep(
            rewards, on_policy, self.args.anchor_reward_threshold, has_anchor, gate,
            self.args.dynamic_sampling_keep_unsolved,
        )

    def _dynamic_sampling_batch(self, inputs):
        """DAPO's dynamic sampling with refill: generate rounds until the batch holds its number of kept groups."""
        group_size, target = self.num_generations, len(inputs) // self.num_generations
        device = self.accelerator.device
        kept, spare, kept_groups, spare_groups = [], [], 0, 0
        counts = torch.zeros(1 + len(DROP_REASONS), device=device)  # groups generated, dropped per reason
        rounds = 0
        while True:
            output = self._score_round(inputs)
            rounds += 1
            keep, reasons = self._round_keep(output)
            counts[0] += len(keep)
            for code in DROP_REASONS:
                counts[code] += (reasons == code).sum()
            take = keep.nonzero().flatten().tolist()[: target - kept_groups]
            dropped = (~keep).nonzero().flatten().tolist()[: target - spare_groups]
            if take:
                kept.append(take_rows(output, group_rows(take, group_size)))
                kept_groups += len(take)
            if dropped:
                spare.append(take_rows(output, group_rows(dropped, group_size)))
                spare_groups += len(dropped)
            short = target - kept_groups
            if rounds >= self.args.dynamic_sampling_max_rounds:
                break
            # generation and reward gathering are collective: every process runs the same number of rounds
            if self.accelerator.gather(torch.tensor([short], device=device)).max().item() == 0:
                break
            indices = self._refill.draw(target, self.accelerator.process_index, self.accelerator.num_processes)
            inputs = [dict(self.train_dataset[i]) for i in indices for _ in range(group_size)]
        parts = kept
        if short > 0:  # still short: fill the batch with dropped groups, masked out of the loss
            filler = concat_rows(spare, seam.pad_token_id(self))
            parts = kept + [take_rows(filler, list(range(short * group_size)))]
        batch = concat_rows(parts, seam.pad_token_id(self))
        keep = torch.arange(target, device=device) < kept_groups
        batch["advantages"] = self._recompute_advantages(batch["armor_reward"], keep)
        row_keep = keep.repeat_interleave(group_size)
        batch["completion_mask"] = batch["completion_mask"] * row_keep.unsqueeze(1).to(batch["completion_mask"].dtype)
        if "armor_is_anchor" in batch:
            batch["armor_is_anchor"] = batch["armor_is_anchor"] & row_keep
        loss_mask = batch["completion_mask"] * batch.get("tool_mask", 1)
        batch["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        self._log_dynamic_sampling(counts, rounds, short)
        return batch

    def _log_dynamic_sampling(self, counts: torch.Tensor, rounds: int, short: int) -> None:
        generated, *dropped = self.accelerator.reduce(counts, reduction="sum").tolist()
        short_total = int(self.accelerator.reduce(torch.tensor(float(short), device=counts.device), reduction="sum"))
        seam.log_metric(self, "armor/generation_rounds", rounds)
        seam.log_metric(self, "armor/prompts_per_step", generated)
        seam.log_metric(self, "armor/groups_kept_frac", 1.0 - sum(dropped) / generated)
        for (code, name), value in zip(DROP_REASONS.items(), dropped):
            seam.log_metric(self, f"armor/dropped_{name}_frac", value / generated)
        seam.log_metric(self, "armor/batch_short_groups", short_total)
        if short_total and not self._warned_short_batch:
            self._warned_short_batch = True
            logger.warning(
                f"Dynamic sampling kept too few groups after {rounds} generation rounds "
                f"(dynamic_sampling_max_rounds={self.args.dynamic_sampling_max_rounds}): {short_total} group(s) of the "
                "batch are masked out of the loss. armor/batch_short_groups tracks this (warned once)."
            )

    def _shape_anchor_advantages(self, output: dict) -> None:
        """Anchor-row advantage options: never negative (`mask_negative_anchor_advantage`), weighted by λ."""
        is_anchor = output["armor_is_anchor"].to(output["advantages"].device)
        advantages = output["advantages"]
        if self.args.mask_negative_anchor_advantage:
            advantages = torch.where(is_anchor, advantages.clamp(min=0), advantages)
        if self.args.anchor_loss_weight != 1.0:
            # the clipped surrogate is positively homogeneous in A, so λ·A scales the anchor's loss terms by λ
            advantages = torch.where(is_anchor, advantages * self.args.anchor_loss_weight, advantages)
        output["advantages"] = advantages
        if self._anchor_slots and self.args.use_anchors:
            self._log_anchor_advantages(output, is_anchor)

    # --- anchor rollout ----------------------------------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.reference is not None:
            self._check_prompt_lengths(prompt_ids)
        if self._armor_inputs is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        rows, group_size, slots = len(prompt_ids), num_generations, self._anchor_slots
        firsts = list(range(0, rows, group_size))
        on_policy_ids, on_policy_logprobs = super()._generate_single_turn(
            [prompt_ids[i] for i in policy_rows(rows, group_size, slots)], images, multimodal_fields, group_size - slots
        )
        anchor_ids = self._sample_anchors([prompt_ids[i] for i in firsts], [self._armor_inputs[i] for i in firsts])
        if not slots:  # anchor_gate_only: the anchors decided the gate and are not trained
            return on_policy_ids, on_policy_logprobs
        logprobs = None
        if on_policy_logprobs is not None:  # vLLM: anchors were not sampled by the policy engine
            logprobs = fill_groups(on_policy_logprobs, neutral_sampling_logprobs(anchor_ids), group_size, slots)
        return fill_groups(on_policy_ids, anchor_ids, group_size, slots), logprobs

    @contextlib.contextmanager
    def _reference_generation(self):
        """Context in which TRL's generation path samples from π_ref."""
        if self.use_vllm:
            with reference_in_engine(self):
                yield
            return
        full_reference = self.reference.model if self.reference.kind == "full" else None
        with self._reference_ready(), seam.generating_with(self, full_reference):
            yield

    def _reference_candidates(self, prompt_ids: list, k: int) -> list:
        """Sample π_ref's completions: on the reference's own vLLM server when there is one, else on TRL's path."""
        if self._reference_server is not None:
            return self._reference_server.generate(prompt_ids, k, self._unwrapped_policy())
        with self._reference_generation():
            return seam.generate(self, prompt_ids, k)

    def _sample_anchors(self, group_prompt_ids: list, group_inputs: list[dict]) -> list:
        """Return ``max(anchor slots, 1)`` anchors per group, group after group: from the cache, or picked from K
        reference candidates per ``anchor_selection``.

        Where no candidate is eligible the slot still gets a candidate (so shapes stay fixed) and
        ``_armor_round["found"]`` marks it; it is then excluded from its group.
        """
        if self._column_anchors is not None and self._column_anchors.active(self.reference.resets):
            anchors, self._armor_round = self._column_anchors.round_anchors(
                group_prompt_ids, group_inputs, self.accelerator.device
            )
            return anchors
        k, threshold = self.args.anchor_num_samples, self.args.anchor_reward_threshold
        per_group = max(self._anchor_slots, 1)
        groups = len(group_prompt_ids)
        cached, known_failures = [None] * groups, [None] * groups
        if self.anchor_cache is not None:
            self.anchor_cache.sync(self.reference.resets)
            cached = [self.anchor_cache.get(ids) for ids in group_prompt_ids]
            if self.args.anchor_cache_failures:
                retry_every = self.args.anchor_failure_retry_every
                known_failures = [
                    None if hit is not None else self.anchor_cache.known_failure(ids, retry_every)
                    for ids, hit in zip(group_prompt_ids, cached)
                ]
        to_sample = [g for g in range(groups) if cached[g] is None and known_failures[g] is None]
        # Generation and scoring are collective (ZeRO-3 gathers, rewards are gathered): every process samples
        # the same number of groups. Spare places retry remembered failures, then repeat a group (discarded).
        rounds = len(to_sample)
        if self.anchor_cache is not None:
            rounds = int(self.accelerator.gather(torch.tensor([rounds], device=self.accelerator.device)).max())
        retried = [g for g in range(groups) if known_failures[g] is not None][: max(rounds - len(to_sample), 0)]
        used = to_sample + retried
        sampled = used + [used[0] if used else 0] * (rounds - len(used))

        anchors = [[None] * per_group for _ in range(groups)]
        rewards_out = torch.full((groups, per_group), float("nan"))
        for g in range(groups):
            if cached[g] is not None:
                anchors[g][0], rewards_out[g, 0] = cached[g]
            elif known_failures[g] is not None and g not in retried:
                anchors[g][0] = known_failures[g]  # fills the slot; the group has no anchor this round
        verified_frac = torch.empty(0)
        if sampled:
            candidate_prompt_ids = [group_prompt_ids[g] for g in sampled for _ in range(k)]
            candidate_inputs = [group_inputs[g] for g in sampled for _ in range(k)]
            candidate_ids = self._reference_candidates(candidate_prompt_ids, k)
            prompts = [row["prompt"] for row in candidate_inputs]
            completions = seam.decode(self, candidate_ids, seam.is_conversational_prompt(prompts[0]))
            rewards = seam.score_quietly(self, candidate_inputs, prompts, completions, candidate_ids)
            weights = self.reward_weights.to(rewards.device)
            chosen, chosen_reward = select_anchors(
                rewards, weights, k, threshold, per_group, self.args.anchor_selection, self._anchor_funcs
            )
            verified = verified_mask(rewards, weights, threshold, self._anchor_funcs)
            verified_frac = verified.float()[: len(used) * k]
            totals = (torch.nan_to_num(rewards) * weights).sum(dim=1)
            for position, g in enumerate(used):
                for slot in range(per_group):
                    index = int(chosen[position, slot])
                    anchors[g][slot] = candidate_ids[position * k + max(index, 0)]
                    if index >= 0:
                        rewards_out[g, slot] = chosen_reward[position, slot].item()
                if self.anchor_cache is not None:
                    # keep up to anchor_cache_per_prompt verified candidates, the chosen anchor first
                    span = range(position * k, (position + 1) * k)
                    fresh = [i for i in span if verified[i]][: self.args.anchor_cache_per_prompt]
                    for i in fresh:
                        self.anchor_cache.put(group_prompt_ids[g], candidate_ids[i], totals[i].item())
                    kept = None if fresh else self.anchor_cache.get(group_prompt_ids[g], partial=True)
                    if kept is not None:  # no verified candidate now, but the prompt has a kept anchor
                        anchors[g][0], rewards_out[g, 0] = kept
                    elif not fresh and self.args.anchor_cache_failures:
                        self.anchor_cache.put_failure(group_prompt_ids[g], anchors[g][0])
        device = self.accelerator.device
        found = ~torch.isnan(rewards_out).to(device)
        self._armor_round = {
            "found": found.flatten() if self._anchor_slots else found.new_zeros(0),  # per anchor slot
            "has_anchor": found.any(dim=1),  # per group
            "reward": rewards_out.flatten().to(device),
            "candidates_verified": verified_frac.to(device),
            "cache_hits": torch.tensor(
                [sum(hit is not None for hit in cached), groups], device=device, dtype=torch.float
            ),
        }
        return [ids for group in anchors for ids in group]

    def _slots(self, rows: int, device) -> torch.Tensor:
        return torch.tensor(anchor_rows(rows, self.num_generations, self._anchor_slots), device=device, dtype=torch.long)

    def _empty_slots(self, rows: int, device) -> torch.Tensor:
        """Local rows whose anchor slot holds no anchor."""
        empty = torch.zeros(rows, dtype=torch.bool, device=device)
        if self._armor_round is not None:
            empty[self._slots(rows, device)[~self._armor_round["found"].to(device)]] = True
        return empty

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._round_rewards = rewards
        if self._uses_verifier:  # completions math-verify could not judge in time (scored None), all processes
            seen, self._verifier_timeouts_seen = self._verifier_timeouts_seen, verifier_timeouts()
            new = torch.tensor(float(self._verifier_timeouts_seen - seen), device=rewards.device)
            seam.log_metric(self, "rewards/verifier_timeouts", self.accelerator.reduce(new, reduction="sum").item())
        if self._armor_round is not None and self._armor_round.get("column"):
            self._verify_column_anchors(rewards, len(prompts))
        self._log_anchor_column(len(prompts))
        if self._armor_round is None:
            return rewards
        rows, device = len(prompts), rewards.device
        # An empty anchor slot is no member of its group: NaN keeps it out of TRL's group mean/std (nan-aware).
        empty = gather(self._empty_slots(rows, device).int()).bool()
        rewards[empty] = float("nan")
        is_policy = torch.ones(rows, dtype=torch.bool, device=device)
        is_policy[self._slots(rows, device)] = False
        policy_rewards = self._total_rewards(rewards)[is_policy.repeat(len(rewards) // rows)]
        seam.log_metric(self, "armor/policy_reward_mean", torch.nanmean(policy_rewards).item())
        return rewards

    def _verify_column_anchors(self, rewards: torch.Tensor, rows: int) -> None:
        """A column anchor below anchor_reward_threshold counts as missing (scored by TRL as a group member)."""
        rank = self.accelerator.process_index
        local = rewards[rank * rows : (rank + 1) * rows][self._slots(rows, rewards.device)]
        weights = self.reward_weights.to(rewards.device)
        counts = verify_round(self._armor_round, local, weights, self.args.anchor_reward_threshold, self._anchor_funcs)
        offered, rejected = self.accelerator.reduce(torch.tensor(counts, device=rewards.device), reduction="sum").tolist()
        seam.log_metric(self, "armor/column_anchor_rejected_frac", rejected / offered if offered else math.nan)

    def _log_anchor_column(self, rows: int) -> None:
        """Add an ``anchor`` column (True on anchor rows) to TRL's completions table (``log_completions``).

        Written to TRL's pending extra columns, which TRL gathers across processes together with the rows' prompts
        and completions, so it stays aligned with them. Every round writes it (all False outside anchor rounds).
        """
        if not self.armor_active or not self.args.use_anchors or not self.log_completions:
            return
        is_anchor = torch.zeros(rows, dtype=torch.bool)
        if self._armor_round is not None:
            is_anchor[self._slots(rows, "cpu")[self._armor_round["found"].cpu()]] = True
        self._pending_extra_logs["anchor"].extend(is_anchor.tolist())

    def _add_armor_fields(self, output: dict) -> dict:
        device = output["completion_ids"].device
        rows, group_size = output["completion_ids"].size(0), self.num_generations
        completion_mask = output["completion_mask"]
        if self.args.use_mixed_ratio or self.args.off_policy_ratio:
            input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention_mask = torch.cat([output["prompt_mask"], completion_mask], dim=1)
            width, batch_size = output["completion_ids"].size(1), self.args.per_device_train_batch_size
            with torch.no_grad(), self._reference_ready():
                output["armor_ref_logps"] = seam.per_token_logps(
                    self, self._reference_model(), input_ids, attention_mask, width, batch_size
                )
        is_anchor = torch.zeros(rows, dtype=torch.bool, device=device)
        if self._armor_round is not None:
            slots = self._slots(rows, device)
            is_anchor[slots[self._armor_round["found"].to(device)]] = True
            keep = ~self._empty_slots(rows, device)
            if self.args.anchor_filter == "drop":
                keep &= self._armor_round["has_anchor"].to(device).repeat_interleave(group_size)
            output["advantages"] = output["advantages"] * keep
            if "importance_sampling_ratio" in output:  # vLLM correction: anchors were sampled by π_ref, not the engine
                output["importance_sampling_ratio"][slots] = 1.0
            output["completion_mask"] = completion_mask * keep.unsqueeze(1).to(completion_mask.dtype)
            loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
            output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
            self._log_anchor_metrics()
        if self.args.off_policy_ratio:
            # ordinary off-policy IS on anchor tokens: their "old" policy is π_ref, so TRL's ratio is π_θ/π_ref
            old = output.get("old_per_token_logps")
            if old is None:
                with torch.no_grad():
                    old = seam.per_token_logps(
                        self, self.model, input_ids, attention_mask, width, batch_size
                    )
            output["old_per_token_logps"] = torch.where(is_anchor.unsqueeze(1), output["armor_ref_logps"], old)
        output["armor_is_anchor"] = is_anchor
        seam.log_metric(self, "armor/ref_resets", self.reference.resets)
        if self.reference.weights_step is not None:
            seam.log_metric(self, "armor/ref_weights_step", self.reference.weights_step)
        return output

    def _log_anchor_metrics(self) -> None:
        has_anchor = gather(self._armor_round["has_anchor"].float())
        seam.log_metric(self, "armor/anchor_found_frac", has_anchor.mean().item())
        if has_anchor.sum() == 0 and not self._warned_no_anchor:
            self._warned_no_anchor = True
            effect = "nothing was trained" if self.args.anchor_filter == "drop" else "groups trained without anchors"
            logger.warning(
                f"No reference candidate reached anchor_reward_threshold={self.args.anchor_reward_threshold} in this "
                f"round ({effect}; anchor_filter={self.args.anchor_filter!r}). Check the reward functions and the "
                "threshold; armor/anchor_found_frac tracks this (warned once)."
            )
        dropped = 1.0 - has_anchor.mean().item() if self.args.anchor_filter == "drop" else 0.0
        seam.log_metric(self, "armor/groups_dropped_frac", dropped)
        seam.log_metric(self, "armor/anchor_reward_mean", torch.nanmean(gather(self._armor_round["reward"])).item())
        verified = self._armor_round["candidates_verified"]
        verified_sum, verified_count = self.accelerator.reduce(
            torch.stack([verified.sum(), torch.tensor(float(verified.numel()), device=verified.device)]), reduction="sum"
        ).tolist()
        seam.log_metric(self, "armor/candidates_verified_frac", verified_sum / verified_count if verified_count else math.nan)
        if self.anchor_cache is not None:
            hits, groups = self.accelerator.reduce(self._armor_round["cache_hits"], reduction="sum").tolist()
            seam.log_metric(self, "armor/anchor_cache_hit_frac", hits / groups)
            seam.log_metric(self, "armor/anchor_cache_size", len(self.anchor_cache))

    def _log_anchor_advantages(self, output: dict, is_anchor: torch.Tensor) -> None:
        lengths = output["completion_mask"].sum(dim=1).float()
        stats = torch.stack([(output["advantages"] * is_anchor).sum(), (lengths * is_anchor).sum(), is_anchor.sum().float()])
        advantage_sum, length_sum, count = self.accelerator.reduce(stats, reduction="sum").tolist()
        seam.log_metric(self, "armor/anchor_advantage_mean", advantage_sum / count if count else math.nan)
        seam.log_metric(self, "armor/anchor_length_mean", length_sum / count if count else math.nan)

    # --- checkpoints ------------------------------------------------------------------------------------------
    def _armor_fingerprint(self) -> dict:
        """The settings a checkpoint's ARMOR state depends on; resuming with different ones is refused."""
        fields = (
            "use_anchors", "use_mixed_ratio", "num_generations", "anchor_num_samples", "anchor_reward_threshold",
            "anchor_filter", "anchor_cache", "anchor_cache_failures", "ref_reset_steps", "ref_reset_every_step_until",
        )
        fingerprint = {"armor_alpha": self.args.resolved_alpha, **{name: getattr(self.args, name) for name in fields}}
        # Later fields enter only when set, so checkpoints written before they existed still resume.
        defaults = ArmorConfig.__dataclass_fields__
        for name in LOOP_FIELDS:
            if getattr(self.args, name) != defaults[name].default:
                fingerprint[name] = getattr(self.args, name)
        return fingerprint

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if self.reference is not None:
            if resume_from_checkpoint:
                resume_from_checkpoint = self._resolve_checkpoint(resume_from_checkpoint)
            elif not self.args.overwrite_output_dir:
                existing, incomplete = latest_complete_checkpoint(self.args.output_dir)
                if existing or incomplete:
                    raise ValueError(
                        f"output_dir {self.args.output_dir} already holds checkpoints of an earlier run, which this "
                        "run would overwrite. Resume it with train(resume_from_checkpoint=True), choose another "
                        "output_dir, or set overwrite_output_dir=True."
                    )
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _resolve_checkpoint(self, checkpoint) -> str:
        """Pick the newest complete checkpoint for ``True``; check its ARMOR settings match this run's."""
        if checkpoint is True:
            checkpoint, incomplete = latest_complete_checkpoint(self.args.output_dir)
            for path in incomplete:
                logger.warning(f"Skipping {path}: it is incomplete (the run stopped while writing it); left as is.")
            if checkpoint is None:
                raise ValueError(f"No complete ArmorGRPOTrainer checkpoint found in {self.args.output_dir}.")
        state = ReferencePolicy.read_state(checkpoint)
        saved = {"kind": state.get("kind"), **state.get("config", {})}
        expected = {"kind": self.reference.kind, **self._armor_fingerprint()}
        differing = {k: (saved.get(k), v) for k, v in expected.items() if saved.get(k) != v}
        if differing:
            details = ", ".join(f"{k}: checkpoint {old!r} vs now {new!r}" for k, (old, new) in differing.items())
            raise ValueError(
                f"Cannot resume from {checkpoint}: it was written by a different ARMOR configuration ({details}). "
                "Resume with the same settings, or start a new run with the checkpoint as `model`/`ref_model`."
            )
        return checkpoint

    def _checkpoint_dir(self, trial) -> str:
        return os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

    def _save_checkpoint(self, model, trial):
        if self.reference is None:
            super()._save_checkpoint(model, trial)
            if self._refill is not None and self.args.should_save:
                self._refill.save(self._checkpoint_dir(trial))
            if self.collapse_guard is not None and self.args.should_save:
                self.collapse_guard.save(self._checkpoint_dir(trial))
            return
        # Older checkpoints are rotated away only once this one is complete (ARMOR's state file written last), so a
        # run killed in between still has its previous complete checkpoint.
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        run_dir, directory = self._get_output_dir(trial=trial), self._checkpoint_dir(trial)
        if self._refill is not None and self.args.should_save:
            self._refill.save(directory)  # before the reference: its state file marks the checkpoint complete
        extra = {
            "config": self._armor_fingerprint(),
            "anchor_cache": None if self.anchor_cache is None else self.anchor_cache.state_dict(),
        }
        if self._column_anchors is not None:
            extra["column_anchors"] = self._column_anchors.state_dict()
        extra["armor_started_at"] = self.armor_started_at  # None: ARMOR still dormant (collapse_guard="armor")
        if self.collapse_guard is not None:
            extra["collapse_guard"] = self.collapse_guard.state_dict()
        self.reference.save(directory, self._unwrapped_policy(), extra, write=self.args.should_save)
        if self.args.should_save and limit:
            rotate_checkpoints(run_dir, limit, best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self._refill is not None:
            self._refill.load(checkpoint)
        if checkpoint is not None and self.reference is None and self.collapse_guard is not None:
            self.collapse_guard.load(checkpoint)
        if checkpoint is None or self.reference is None:
            return
        state = self.reference.load(checkpoint, self._unwrapped_policy())
        self.armor_started_at = state.get("armor_started_at", 0)
        if self.collapse_guard is not None and state.get("collapse_guard") is not None:
            self.collapse_guard.load_state_dict(state["collapse_guard"])
        if self.anchor_cache is not None and state.get("anchor_cache") is not None:
            self.anchor_cache.load_state_dict(state["anchor_cache"])
        if self._column_anchors is not None and state.get("column_anchors") is not None:
            self._column_anchors.load_state_dict(state["column_anchors"])

    # --- mixed optimization ------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        context = self._armor_loss_ctx
        if context is not None and "logps" not in context:
            # Inside _compute_loss: hand TRL the mixture log-probs, so its ratio becomes r_mix.
            context["logps"] = logps
            logps = mixed_logprobs(logps, context["ref_logps"], self.armor_alpha)
        return logps, entropies, aux_loss

    def _compute_loss(self, model, inputs):
        ref_logps = inputs.get("armor_ref_logps")
        if ref_logps is None or not self.args.use_mixed_ratio or not self.model.training:
            return super()._compute_loss(model, inputs)
        old_logps = inputs.get("old_per_token_logps")
        mixed_old = None if old_logps is None else mixed_logprobs(old_logps, ref_logps, self.armor_alpha)
        if mixed_old is not None:
            inputs = {**inputs, "old_per_token_logps": mixed_old}
        sampling = inputs.get("sampling_per_token_logps")
        if sampling is not None and self.off_policy_mask_threshold is not None:
            # TRL's off-policy mask compares these with the (mixture) log-probs of the loss: mix them too, so it
            # compares like with like; anchor rows (NaN: not sampled by the engine) fall back to the mixed old ones.
            mixed_sampling = mixed_logprobs(sampling, ref_logps, self.armor_alpha)
            if mixed_old is not None:
                mixed_sampling = torch.where(torch.isnan(sampling), mixed_old, mixed_sampling)
            inputs = {**inputs, "sampling_per_token_logps": mixed_sampling}
        self._armor_loss_ctx = {"ref_logps": ref_logps}
        try:
            loss = super()._compute_loss(model, inputs)
            context = self._armor_loss_ctx
        finally:
            self._armor_loss_ctx = None
        self._log_ratio_metrics(inputs, context["logps"].detach(), ref_logps, mixed_old)
        return loss

    @torch.no_grad()
    def _log_ratio_metrics(self, inputs, logps, ref_logps, mixed_old) -> None:
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        mask = mask.bool()
        mixed = mixed_logprobs(logps, ref_logps, self.armor_alpha)
        ratio = torch.exp(mixed - (mixed if mixed_old is None else mixed_old))
        advantages = inputs["advantages"].unsqueeze(1) if inputs["advantages"].dim() == 1 else inputs["advantages"]
        anchor = inputs["armor_is_anchor"].unsqueeze(1) & mask
        policy = ~inputs["armor_is_anchor"].unsqueeze(1) & mask
        low = (ratio < 1 - self.epsilon_low) & (advantages < 0) & mask
        high = (ratio > 1 + self.epsilon_high) & (advantages > 0) & mask
        sums = torch.stack(
            [
                (ratio * policy).sum(),
                policy.sum(),
                (ratio * anchor).sum(),
                anchor.sum(),
                low.sum(),
                high.sum(),
                mask.sum(),
                (k3_kl(logps, ref_logps) * policy).sum(),  # reverse KL(π_θ‖π_ref), on-policy samples
                (k3_kl(ref_logps, logps) * anchor).sum(),  # forward KL(π_ref‖π_θ), anchor samples
            ]
        ).float()
        total = self.accelerator.reduce(sums, reduction="sum").tolist()
        extremes = torch.stack(
            [
                torch.where(policy, ratio, math.inf).min(),
                -torch.where(policy, ratio, -math.inf).max(),
                torch.where(anchor, ratio, math.inf).min(),
                -torch.where(anchor, ratio, -math.inf).max(),
            ]
        ).float()
        policy_min, neg_policy_max, anchor_min, neg_anchor_max = (
            self.accelerator.gather(extremes.unsqueeze(0)).min(dim=0).values.tolist()
        )

        def share(numerator, denominator):
            return numerator / denominator if denominator else math.nan

        seam.log_metric(self, "armor/ratio_policy_mean", share(total[0], total[1]))
        seam.log_metric(self, "armor/ratio_anchor_mean", share(total[2], total[3]))
        for name, value in (
            ("armor/ratio_policy_min", policy_min),
            ("armor/ratio_policy_max", -neg_policy_max),
            ("armor/ratio_anchor_min", anchor_min),
            ("armor/ratio_anchor_max", -neg_anchor_max),
        ):
            seam.log_metric(self, name, value if math.isfinite(value) else math.nan)
        seam.log_metric(self, "armor/clip_low_frac", share(total[4], total[6]))
        seam.log_metric(self, "armor/clip_high_frac", share(total[5], total[6]))
        seam.log_metric(self, "armor/kl_reverse_policy", share(total[7], total[1]))
        seam.log_metric(self, "armor/kl_forward_anchor", share(total[8], total[3]))
