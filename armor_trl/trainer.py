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
from .anchors import AnchorCache, anchor_rows, fill_groups, policy_rows, select_anchors, verified_mask
from .config import ArmorConfig
from .mixed_ratio import k3_kl, mixed_logprobs
from .reference import ReferencePolicy, ReferenceResetCallback, copy_model_for_reference, latest_complete_checkpoint
from .reward_checks import checked
from .vllm_swap import neutral_sampling_logprobs, reference_in_engine

logger = logging.get_logger(__name__)


class ArmorGRPOTrainer(GRPOTrainer):
    """Drop-in replacement for ``trl.GRPOTrainer`` that trains with ARMOR (arXiv 2607.10481).

    Takes every argument of ``GRPOTrainer`` (with an [`ArmorConfig`] as ``args``) plus ``ref_model``:
    the initial reference policy, as a path, hub id or model instance. ``None`` means a copy of the
    initial policy (for LoRA: a frozen copy of the initial adapter).
    """

    _tag_names = ["trl", "grpo", "armor"]

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
        self.anchor_cache = AnchorCache(args.anchor_cache_size) if args.anchor_cache and args.use_anchors else None
        self._armor_inputs = None  # the rows of the generation round being built (anchor rounds only)
        self._armor_round = None  # anchors found in that round
        self._armor_loss_ctx = None  # reference log-probs of the micro-batch whose loss is being computed
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
        if not args.armor_enabled:
            return  # both ablation switches off: exactly GRPOTrainer
        self.reward_funcs = [
            func if isinstance(func, torch.nn.Module) or inspect.iscoroutinefunction(func) else checked(func, name)
            for func, name in zip(self.reward_funcs, self.reward_func_names)
        ]
        self._warned_no_anchor = False
        if args.use_anchors and self._is_vlm:
            raise ValueError("use_anchors=True does not support vision-language models (multimodal prompts) yet.")
        self.armor_alpha = args.resolved_alpha
        if is_peft_model(self.model):
            self.reference = ReferencePolicy.lora(self.model)
        else:
            self.reference = ReferencePolicy.full(self._build_reference_model(ref_model, ref_copy, quantization_config))
            if ref_model is None:
                self.reference.synced_step = 0  # a copy of the initial policy
        self.add_callback(
            ReferenceResetCallback(
                self.reference, self._unwrapped_policy, args.ref_reset_steps, args.ref_reset_every_step_until
            )
        )

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

    # --- anchor rollout ----------------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        training = self.reference is not None and self.model.training
        self._armor_inputs = inputs if training and self.args.use_anchors else None
        self._armor_round = None
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._armor_inputs = None
        if training:
            output = self._add_armor_fields(output)
        self._armor_round = None
        return output

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.reference is not None:
            self._check_prompt_lengths(prompt_ids)
        if self._armor_inputs is None:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        rows, group_size = len(prompt_ids), num_generations
        on_policy_ids, on_policy_logprobs = super()._generate_single_turn(
            [prompt_ids[i] for i in policy_rows(rows, group_size)], images, multimodal_fields, group_size - 1
        )
        slots = anchor_rows(rows, group_size)
        anchor_ids = self._sample_anchors([prompt_ids[i] for i in slots], [self._armor_inputs[i] for i in slots])
        logprobs = None
        if on_policy_logprobs is not None:  # vLLM: anchors were not sampled by the policy engine
            logprobs = fill_groups(on_policy_logprobs, neutral_sampling_logprobs(anchor_ids), group_size)
        return fill_groups(on_policy_ids, anchor_ids, group_size), logprobs

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

    def _sample_anchors(self, group_prompt_ids: list, group_inputs: list[dict]) -> list:
        """Return one anchor completion per group: from the cache, or the first verified of K reference candidates.

        Where no candidate is verified the group's slot still gets a candidate (so shapes stay fixed)
        and ``_armor_round["found"]`` marks it; it is then excluded from its group.
        """
        k, threshold = self.args.anchor_num_samples, self.args.anchor_reward_threshold
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

        anchors, rewards_out = [None] * groups, torch.full((groups,), float("nan"))
        for g in range(groups):
            if cached[g] is not None:
                anchors[g], rewards_out[g] = cached[g]
            elif known_failures[g] is not None and g not in retried:
                anchors[g] = known_failures[g]  # fills the slot; the group has no anchor this round
        verified_frac = torch.empty(0)
        if sampled:
            candidate_prompt_ids = [group_prompt_ids[g] for g in sampled for _ in range(k)]
            candidate_inputs = [group_inputs[g] for g in sampled for _ in range(k)]
            with self._reference_generation():
                candidate_ids = seam.generate(self, candidate_prompt_ids, k)
            prompts = [row["prompt"] for row in candidate_inputs]
            completions = seam.decode(self, candidate_ids, seam.is_conversational_prompt(prompts[0]))
            rewards = seam.score_quietly(self, candidate_inputs, prompts, completions, candidate_ids)
            weights = self.reward_weights.to(rewards.device)
            chosen, chosen_reward = select_anchors(rewards, weights, k, threshold)
            verified_frac = verified_mask(rewards, weights, threshold).float()[: len(used) * k]
            for position, g in enumerate(used):
                index = int(chosen[position])
                anchors[g] = candidate_ids[position * k + max(index, 0)]
                if index >= 0:
                    rewards_out[g] = chosen_reward[position].item()
                    if self.anchor_cache is not None:
                        self.anchor_cache.put(group_prompt_ids[g], anchors[g], rewards_out[g])
                elif self.args.anchor_cache_failures:
                    self.anchor_cache.put_failure(group_prompt_ids[g], anchors[g])
        device = self.accelerator.device
        self._armor_round = {
            "found": ~torch.isnan(rewards_out).to(device),
            "reward": rewards_out.to(device),
            "candidates_verified": verified_frac.to(device),
            "cache_hits": torch.tensor(
                [sum(hit is not None for hit in cached), groups], device=device, dtype=torch.float
            ),
        }
        return anchors

    def _empty_slots(self, rows: int, device) -> torch.Tensor:
        """Local rows whose anchor slot holds no verified anchor."""
        empty = torch.zeros(rows, dtype=torch.bool, device=device)
        if self._armor_round is not None:
            slots = torch.tensor(anchor_rows(rows, self.num_generations), device=device)
            empty[slots[~self._armor_round["found"].to(device)]] = True
        return empty

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._armor_round is None:
            return rewards
        rows, device = len(prompts), rewards.device
        # An empty anchor slot is no member of its group: NaN keeps it out of TRL's group mean/std (nan-aware).
        empty = gather(self._empty_slots(rows, device).int()).bool()
        rewards[empty] = float("nan")
        is_policy = torch.ones(rows, dtype=torch.bool, device=device)
        is_policy[anchor_rows(rows, self.num_generations)] = False
        # Like TRL's `reward`: weighted sum with None counted as 0; rows no function could score are left out.
        total = (rewards * self.reward_weights.to(device)).nansum(dim=1)
        total[torch.isnan(rewards).all(dim=1)] = float("nan")
        policy_rewards = total[is_policy.repeat(len(rewards) // rows)]
        seam.log_metric(self, "armor/policy_reward_mean", torch.nanmean(policy_rewards).item())
        return rewards

    def _add_armor_fields(self, output: dict) -> dict:
        device = output["completion_ids"].device
        rows, group_size = output["completion_ids"].size(0), self.num_generations
        completion_mask = output["completion_mask"]
        if self.args.use_mixed_ratio:
            input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention_mask = torch.cat([output["prompt_mask"], completion_mask], dim=1)
            with torch.no_grad(), self._reference_ready():
                output["armor_ref_logps"] = seam.per_token_logps(
                    self,
                    self._reference_model(),
                    input_ids,
                    attention_mask,
                    output["completion_ids"].size(1),
                    self.args.per_device_train_batch_size,
                )
        is_anchor = torch.zeros(rows, dtype=torch.bool, device=device)
        if self._armor_round is not None:
            found = self._armor_round["found"].to(device)
            slots = torch.tensor(anchor_rows(rows, group_size), device=device)
            is_anchor[slots[found]] = True
            keep = ~self._empty_slots(rows, device)
            if self.args.anchor_filter == "drop":
                keep &= found.repeat_interleave(group_size)
            output["advantages"] = output["advantages"] * keep
            if "importance_sampling_ratio" in output:  # vLLM correction: anchors were sampled by π_ref, not the engine
                output["importance_sampling_ratio"][slots] = 1.0
            output["completion_mask"] = completion_mask * keep.unsqueeze(1).to(completion_mask.dtype)
            loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
            output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
            self._log_anchor_metrics(output, found, is_anchor)
        output["armor_is_anchor"] = is_anchor
        seam.log_metric(self, "armor/ref_resets", self.reference.resets)
        return output

    def _log_anchor_metrics(self, output: dict, found: torch.Tensor, is_anchor: torch.Tensor) -> None:
        all_found = gather(found.float())
        seam.log_metric(self, "armor/anchor_found_frac", all_found.mean().item())
        if all_found.sum() == 0 and not self._warned_no_anchor:
            self._warned_no_anchor = True
            effect = "nothing was trained" if self.args.anchor_filter == "drop" else "groups trained without anchors"
            logger.warning(
                f"No reference candidate reached anchor_reward_threshold={self.args.anchor_reward_threshold} in this "
                f"round ({effect}; anchor_filter={self.args.anchor_filter!r}). Check the reward functions and the "
                "threshold; armor/anchor_found_frac tracks this (warned once)."
            )
        dropped = 1.0 - all_found.mean().item() if self.args.anchor_filter == "drop" else 0.0
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
        lengths = output["completion_mask"].sum(dim=1).float()
        stats = torch.stack(
            [
                (output["advantages"] * is_anchor).sum(),
                (lengths * is_anchor).sum(),
                is_anchor.sum().float(),
            ]
        )
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
        return {"armor_alpha": self.armor_alpha, **{name: getattr(self.args, name) for name in fields}}

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

    def _save_checkpoint(self, model, trial):
        if self.reference is None:
            return super()._save_checkpoint(model, trial)
        # Older checkpoints are rotated away only once this one is complete (ARMOR's state file written last), so a
        # run killed in between still has its previous complete checkpoint.
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        run_dir = self._get_output_dir(trial=trial)
        directory = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        extra = {
            "config": self._armor_fingerprint(),
            "anchor_cache": None if self.anchor_cache is None else self.anchor_cache.state_dict(),
        }
        self.reference.save(directory, self._unwrapped_policy(), extra, write=self.args.should_save)
        if self.args.should_save and limit:
            rotate_checkpoints(run_dir, limit, best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.reference is None:
            return
        state = self.reference.load(checkpoint, self._unwrapped_policy())
        if self.anchor_cache is not None and state.get("anchor_cache") is not None:
            self.anchor_cache.load_state_dict(state["anchor_cache"])

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
        if ref_logps is None or not self.model.training:
            return super()._compute_loss(model, inputs)
        old_logps = inputs.get("old_per_token_logps")
        mixed_old = None if old_logps is None else mixed_logprobs(old_logps, ref_logps, self.armor_alpha)
        if mixed_old is not None:
            inputs = {**inputs, "old_per_token_logps": mixed_old}
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
