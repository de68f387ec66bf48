"""ArmorGRPOTrainer: TRL's GRPOTrainer with Anchor Rollout, Mixed Optimization and reference resets.

How one generation round differs from GRPO (train mode, ARMOR on):

1. ``_generate_single_turn``: G − m on-policy completions per group, and m anchors per group from π_ref
   (:class:`~armor_trl.rollout.anchor_rollout.AnchorRollout`: sampled, verified with the trainer's reward functions, placed
   in the group's last rows). TRL computes rewards and advantages with the anchors as group members; the anchors keep
   the scores they were verified with, and on-policy rows scored before the candidates were drawn (only groups whose
   fate an anchor can change get candidates, :mod:`~armor_trl.rollout.anchor_waves`) keep theirs (``_calculate_rewards``).
2. ``_generate_and_score_completions``: π_ref's per-token log-probs and an anchor flag join the batch (they travel
   with their rows through TRL's shuffle and split); groups are masked per ``anchor_filter``; dynamic sampling and
   QAE recompute advantages where asked for.
3. ``_compute_loss``: TRL's clipped surrogate is built from mixture log-probs log(α·π_θ + (1−α)·π_ref) for both the
   current and the old policy, which makes TRL's ratio r_mix (``trl_seam.loss_logps_replaced``).
4. After each optimizer step π_ref is reset on schedule (:class:`~armor_trl.reference.policy.ReferenceResetCallback`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass

import torch
from accelerate.utils import is_peft_model
from transformers.utils import logging
from trl import GRPOConfig, GRPOTrainer

from armor_trl.integration import checks
from armor_trl.integration import trl_seam as seam
from armor_trl.integration import trl_generation
from armor_trl.integration import vllm_engine
from armor_trl.rollout.anchor_rollout import reward_func_mask
from armor_trl.algorithm.advantages import total_rewards
from armor_trl.rollout.anchors import AnchorRound
from armor_trl.rollout.batch_logprobs import add_logprobs, skips_round_logps
from armor_trl.integration.metrics import ArmorMetrics
from armor_trl.integration.checkpoint import ArmorState, fingerprint, load_policy_weights, resolve_checkpoint
from armor_trl.callbacks.collapse_guard import CollapseGuard
from armor_trl.config import ArmorConfig
from armor_trl.rollout.dynamic_sampling import DynamicSampling, advantages_across_processes
from armor_trl.rollout.refill import take_rows
from armor_trl.integration.launcher import check_use_cpu
from armor_trl.algorithm.loss_rows import entropy_bonus_correction, kl_beta, micro_batch_share, over_kept_rows
from armor_trl.algorithm.mixture import kl_reference_logps, mixed_logprobs, mixed_old_inputs
from armor_trl.rewards.modes import resolve_classifier, resolve_prompt_classifier
from armor_trl.rollout.multimodal import RowMedia, forward_kwargs
from armor_trl.reference.policy import ReferenceResetCallback, build_reference, copy_model_for_reference
from armor_trl.rewards.checks import checked
from armor_trl.rollout.tool_anchors import ToolLoopHooks, in_tool_turns, new_anchor_rollout
from armor_trl.rewards import math_verify_reward, verifier_timeouts
from armor_trl.reference.vllm_server import ReferenceServer

logger = logging.get_logger(__name__)


@dataclass
class Round:
    """The generation round being built, handed between TRL's hooks."""

    inputs: list[dict] | None = None  # its rows, when it gets anchors
    anchors: AnchorRound | None = None  # set by _generate_single_turn
    rewards: torch.Tensor | None = None  # (all processes' rows, reward functions), set by _calculate_rewards
    media: RowMedia | None = None  # each row's images in a VLM round, set by _generate_single_turn


def model_card_settings(args: ArmorConfig) -> str:
    """The ARMOR settings of a run, as a model-card section."""
    names = ("use_anchors", "use_mixed_ratio", "anchor_num_samples", "anchor_reward_threshold", "anchor_filter",
             "ref_reset_steps", "ref_reset_every_step_until", "num_generations", "beta", "loss_type")
    rows = [("armor_alpha", args.resolved_alpha)] + [(name, getattr(args, name)) for name in names]
    return "\n## ARMOR settings\n\n| field | value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


# tools / environment_factory: ToolLoopHooks (rollout/tool_anchors.py) overrides five hooks, one chain in TRL's order
class ArmorGRPOTrainer(ToolLoopHooks, GRPOTrainer):
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
            "    author        = {Kexin Huang and Junkang Wu and Jinda Lu and Shuo Yang and Chiyu Ma and Jiancan Wu and "
            "Xiang Wang and Xiangnan He and Guoyin Wang and Jingren Zhou},\n"
            "    year          = 2026,\n"
            "    eprint        = {2607.10481},\n"
            "    archivePrefix = {arXiv},\n"
            "    url           = {https://arxiv.org/abs/2607.10481},\n"
            "}\n\n"
            + seam.grpo_citation()  # GRPO, which ARMOR trains with (TRL cites it in GRPOTrainer's cards)
        ),
    }

    def __init__(self, model, reward_funcs=None, args: ArmorConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None, ref_model=None):
        args = self._armor_config(model, args)
        uses_peft = peft_config is not None or (not isinstance(model, str) and is_peft_model(model))
        checks.check_arguments(args, processing_class, tools, rollout_func, environment_factory, ref_model, uses_peft,
                               train_dataset)
        checks.check_vllm_device(args)
        check_use_cpu(args)  # use_cpu under a launcher's DeepSpeed / FSDP on GPUs: refused before anything is built
        self.reference = self.reference_server = self.anchor_rollout = self.group_resets = None
        # optimizer step ARMOR started at: 0, or None while it is dormant (collapse_guard="armor" before the switch)
        self.armor_started_at: int | None = None if args.collapse_guard == "armor" else 0
        self._round = Round()
        self._user_rollout_func = rollout_func  # wrapped by ARMOR when anchors are on (armor_trl.rollout.rollout_func)
        # A policy instance is copied before TRL patches its forward (a later deep copy would keep that patch).
        ref_copy = None
        if args.armor_enabled and not uses_peft and ref_model is None and not isinstance(model, str):
            ref_copy = copy_model_for_reference(model)
        # ArmorConfig's engine options (on a CPU, weights TRL can sync); with ARMOR + KL no reference model of TRL's
        kl_reference = seam.no_kl_reference_built(args) if args.armor_enabled else contextlib.nullcontext()
        with vllm_engine.colocated_engine_built(args), kl_reference:
            super().__init__(
                model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                eval_dataset=eval_dataset, processing_class=processing_class,
                reward_processing_classes=reward_processing_classes, callbacks=callbacks, optimizers=optimizers,
                quantization_config=quantization_config, peft_config=peft_config, tools=tools, rollout_func=rollout_func,
                environment_factory=environment_factory,
            )
        self.armor_state = ArmorState()
        self.armor_state.register("schedule", lambda: {"armor_started_at": self.armor_started_at},
                                  lambda state: setattr(self, "armor_started_at", state["armor_started_at"]))
        self.armor_metrics = ArmorMetrics(self)
        if self.accelerator.is_main_process:
            checks.log_update_regime(args, logger)
        self.dynamic_sampling = DynamicSampling(self, train_dataset) if args.dynamic_sampling else None
        self.collapse_guard = CollapseGuard(self) if args.collapse_guard else None
        for part in (self.dynamic_sampling, self.collapse_guard):
            if part is not None:
                part.register(self.armor_state)
        # the reward functions that judge correctness (anchors, dynamic sampling); None: all of them
        self.verifier_funcs = reward_func_mask(args.anchor_reward_funcs, self.reward_func_names)
        self._uses_verifier = any(getattr(f, "__wrapped__", f) is math_verify_reward for f in self.reward_funcs)
        self._verifier_timeouts_seen = verifier_timeouts()
        if args.armor_enabled:  # else both ablation switches are off: GRPOTrainer (plus dynamic sampling / QAE)
            self._build_armor(train_dataset, ref_model, ref_copy, quantization_config)

    @staticmethod
    def _armor_config(model, args) -> ArmorConfig:
        """``args`` as an ArmorConfig: a default one named after the model, a GRPOConfig converted, else refused."""
        if args is None:
            name = model if isinstance(model, str) else seam.model_id(model)
            return ArmorConfig(f"{name.split('/')[-1]}-ARMOR")
        if isinstance(args, GRPOConfig) and not isinstance(args, ArmorConfig):
            logger.warning("args is a GRPOConfig: converted to an ArmorConfig with the fields you set and ARMOR's defaults "
                           "for the rest (e.g. beta=0, loss_type='dapo'). Pass ArmorConfig(...) to set ARMOR's fields.")
            return ArmorConfig.from_grpo_config(args)
        if not isinstance(args, ArmorConfig):
            raise ValueError(f"args must be an armor_trl.ArmorConfig (or a trl.GRPOConfig), got {type(args).__name__}.")
        return args

    def _build_armor(self, train_dataset, ref_model, ref_copy, quantization_config) -> None:
        """What ARMOR adds once GRPOTrainer is built: checked rewards, the anchor rollout, π_ref with its checkpoint
        part and reset schedule, and the reference server where one is used."""
        args = self.args
        self.reward_funcs = [
            func if isinstance(func, torch.nn.Module) or inspect.iscoroutinefunction(func) else checked(func, name)
            for func, name in zip(self.reward_funcs, self.reward_func_names)
        ]
        checks.check_built(self)
        if args.use_anchors:  # a rollout_func's, the tool loop's or TRL's single-turn generation's
            self.anchor_rollout = new_anchor_rollout(self, train_dataset, self._user_rollout_func)
            if self._user_rollout_func is not None:
                self.rollout_func = self._armor_rollout_func  # (TRL calls self.rollout_func(prompts, self))
        if self.anchor_rollout is not None:
            self.anchor_rollout.register(self.armor_state)
        self.reference = build_reference(self, ref_model, ref_copy, quantization_config)
        self.armor_state.register(
            "reference", self.reference.state_dict, self.reference.load_state_dict,
            save_files=lambda directory, write: self.reference.save_weights(directory, self.unwrapped_policy(), write),
            load_files=lambda directory: self.reference.load_weights(directory, self.unwrapped_policy()),
        )
        self.add_callback(ReferenceResetCallback.of(self))
        if args.vllm_reference_server_url is not None:
            # A reference built from a path is assumed to be what the server was started with; otherwise it is pushed.
            from_path = self.reference.kind == "full" and ref_copy is None and not isinstance(ref_model, torch.nn.Module)
            self.reference_server = ReferenceServer.connect(self, holds_initial_reference=from_path)

    @property
    def armor_alpha(self) -> float:
        """α of the mixture at the current optimizer step (constant unless `armor_alpha_decay_steps` is set)."""
        return self.args.alpha_at(self.state.global_step - (self.armor_started_at or 0))

    @property
    def armor_active(self) -> bool:
        """Whether ARMOR acts now: a reference exists and ARMOR is not dormant (see `collapse_guard`)."""
        return self.reference is not None and self.armor_started_at is not None

    @property
    def anchor_cache(self):
        return None if self.anchor_rollout is None else self.anchor_rollout.cache

    def unwrapped_policy(self):
        return self.accelerator.unwrap_model(self.model_wrapped)

    # --- one generation batch --------------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return self._score_round(inputs)[0]
        if self.dynamic_sampling is not None:
            complete = None if self.anchor_rollout is None else self._place_deferred_anchors
            output = self.dynamic_sampling.batch(self._score_round, inputs, complete)
        else:
            output, anchors, _ = self._score_round(inputs)
            if self.args.advantage_quantile is not None:
                keep = output["advantages"].new_ones(len(inputs) // self.num_generations, dtype=torch.bool)
                if anchors is not None and self.args.anchor_filter == "drop":
                    keep = anchors.has_anchor.to(keep.device)
                output["advantages"] = advantages_across_processes(self, output["armor_reward"], keep)
        del output["armor_reward"], output["armor_correctness"]
        add_logprobs(self, output)
        if "armor_is_anchor" in output:
            self._shape_anchor_advantages(output)
        return output

    def _score_round(self, inputs):
        """One round generated and scored by TRL, with ARMOR's fields: (output, its anchors or None, anchor slots).
        Log-probs are not computed here for the rows that will train (``batch_logprobs.add_logprobs``)."""
        training = self.model.training
        anchored = training and self.armor_active and self.args.use_anchors
        self._round = Round(inputs=inputs if anchored else None)
        with trl_generation.round_logps_skipped(self) if skips_round_logps(self) else contextlib.nullcontext():
            output = super()._generate_and_score_completions(inputs)
        current, self._round = self._round, Round()
        if not training:
            return output, None, 0
        if self.armor_active:
            output = self._add_armor_fields(output, current.anchors)
        rows, rank = len(inputs), self.accelerator.process_index
        totals = total_rewards(current.rewards, self.reward_weights)
        correctness, verifier = totals, self.verifier_funcs
        if verifier is not None:  # dynamic sampling judges correctness by the verifier alone
            correctness = total_rewards(current.rewards[:, verifier.to(current.rewards.device)],
                                        self.reward_weights[verifier.to(self.reward_weights.device)])
        output["armor_reward"] = totals[rank * rows : (rank + 1) * rows]
        output["armor_correctness"] = correctness[rank * rows : (rank + 1) * rows]
        slots = 0 if self.anchor_rollout is None else self.anchor_rollout.slots_per_group
        return output, current.anchors, slots

    def _place_deferred_anchors(self, batch: dict, group_inputs: list[dict], kept: int) -> None:
        """The anchors of the batch's groups that waited for the refill loop (``anchor_deferred``), drawn in one call
        and put in their slots before dynamic sampling computes the batch's advantages."""
        placed = self.anchor_rollout.deferred_anchors(batch, group_inputs, kept)
        if placed is None:
            return
        anchors, rows = placed
        self.armor_metrics.anchor_round(anchors, self.args.anchor_filter, self.args.anchor_reward_threshold,
                                        self.anchor_rollout.cache)
        if rows and "old_per_token_logps" in batch:  # their rounds computed them for the fillers (vLLM's correction)
            batch["old_per_token_logps"][rows] = self._completion_logps(self.model, take_rows(batch, rows))

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        parent, tool_turn = super()._generate_single_turn, in_tool_turns(self)  # (tool_turn: after a tool result)
        if self.reference is not None and not tool_turn:  # (TRL's loop keeps tool turns within the context itself)
            checks.check_prompt_lengths(self.model, prompt_ids, self.max_completion_length)
        if self._round.inputs is None or tool_turn:  # (π_ref's candidates' tool turns: π_ref is routed in)
            return parent(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if images is not None or multimodal_fields:  # a VLM round: each call gets its own rows' images
            self._round.media = RowMedia(prompt_ids, images, multimodal_fields)

        def policy(ids, n):
            completion_ids, logprobs = parent(ids, *self.media_for(ids), n)
            trl_generation.check_row_count(completion_ids, ids)
            return completion_ids, logprobs

        ids, logprobs, self._round.anchors = self.anchor_rollout.generate(policy, prompt_ids, num_generations,
                                                                          self._round.inputs)
        return ids, logprobs

    def media_for(self, prompt_ids: list) -> tuple[list | None, dict]:
        """(images, multimodal fields) of the rows of this round whose prompt ids are given (none outside a VLM
        round): what TRL's generation path gets with them."""
        media = self._round.media
        return (None, {}) if media is None else media.select(prompt_ids)

    def _armor_rollout_func(self, prompts, trainer):
        """The user's rollout_func, called by ARMOR for the policy's rows and π_ref's candidates (anchored rounds)."""
        output, anchors = self.anchor_rollout.rollout(prompts, self._round.inputs)
        if self._round.inputs is not None:
            self._round.anchors = anchors
        return output

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        anchors, rollout = self._round.anchors, self.anchor_rollout
        score = super()._calculate_rewards if rollout is None else rollout.reusing_scores(super()._calculate_rewards)
        if anchors is not None and anchors.rewards_per_func is not None and rollout.slots_per_group:
            rewards = rollout.score_round(score, inputs, prompts, completions, completion_ids_list, anchors)
        else:
            rewards = score(inputs, prompts, completions, completion_ids_list)
        self._round.rewards = rewards
        if self._uses_verifier:  # completions math-verify could not judge in time (scored None), all processes
            seen, self._verifier_timeouts_seen = self._verifier_timeouts_seen, verifier_timeouts()
            new = torch.tensor(float(self._verifier_timeouts_seen - seen), device=rewards.device)
            seam.log_metric(self, "rewards/verifier_timeouts", self.accelerator.reduce(new, reduction="sum").item())
        if rollout is not None and self.armor_active:
            rollout.settle_rewards(rewards, len(prompts), anchors)
        return rewards

    def _add_armor_fields(self, output: dict, anchors: AnchorRound | None) -> dict:
        """A round's anchor flag and the masks of ``anchor_filter`` (π_ref's log-probs: ``batch_logprobs``)."""
        args = self.args
        is_anchor = torch.zeros(output["completion_ids"].size(0), dtype=torch.bool, device=output["completion_ids"].device)
        if anchors is not None:
            is_anchor = self.anchor_rollout.mask_groups(output, anchors)
            self.armor_metrics.anchor_round(anchors, args.anchor_filter, args.anchor_reward_threshold,
                                            self.anchor_rollout.cache)
        output["armor_is_anchor"] = is_anchor
        seam.log_metric(self, "armor/ref_resets", self.reference.resets)
        if self.reference.weights_step is not None:
            seam.log_metric(self, "armor/ref_weights_step", self.reference.weights_step)
        return output

    @torch.no_grad()
    def _completion_logps(self, model, output: dict) -> torch.Tensor:
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        return trl_generation.per_token_logps(self, model, input_ids, attention_mask, output["completion_ids"].size(1),
                                              self.args.per_device_train_batch_size, **forward_kwargs(output))

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
        if self.anchor_rollout is not None and self.anchor_rollout.slots_per_group:
            self.armor_metrics.rows_by_type(output, is_anchor)
            if self.args.anchor_mode_classifier is not None:
                prompt_types = self.args.anchor_mode_prompt_classifier
                self.armor_metrics.anchor_modes(output, is_anchor, resolve_classifier(self.args.anchor_mode_classifier),
                                                None if prompt_types is None else resolve_prompt_classifier(prompt_types))

    # --- mixed optimization ----------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if trl_generation.logps_call_skipped(self):  # a round's old log-probs, made for the batch that trains
            return None, None, None
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        return seam.replaced_loss_logps(self, logps, entropies), entropies, aux_loss

    def _compute_loss(self, model, inputs):
        if not self.model.training:
            return super()._compute_loss(model, inputs)
        ref_logps = inputs.get("armor_ref_logps") if self.args.use_mixed_ratio else None
        alpha, replace, loss_inputs = self.armor_alpha, (lambda logps: logps), inputs  # identity: plain ratio
        if ref_logps is not None:
            loss_inputs = mixed_old_inputs(inputs, ref_logps, alpha, self.off_policy_mask_threshold is not None)
            replace = lambda logps: mixed_logprobs(logps, ref_logps, alpha)  # noqa: E731
        micro_batches, coef = seam.step_micro_batches(self, inputs), seam.entropy_bonus_coef(self)  # (coef: pre-loss)
        held = micro_batch_share(self, inputs, micro_batches, seam.entropy_bonus_enabled(self))
        loss_inputs = over_kept_rows(self.loss_type, loss_inputs, held)  # rows out of the loss leave its normaliser
        beta = kl_beta(self, inputs, micro_batches) if "armor_ref_logps" in inputs else 0.0  # per on-policy token
        if beta:  # ARMOR + KL: TRL's KL term, of π_θ against π_ref on the on-policy rows (mixture.kl_reference_logps)
            loss_inputs, mixed = dict(loss_inputs), replace
            on_policy = ~inputs["armor_is_anchor"]

            def replace(logps):
                loss_logps = mixed(logps)
                loss_inputs[seam.KL_REFERENCE_INPUT] = kl_reference_logps(inputs["armor_ref_logps"], logps,
                                                                          loss_logps, on_policy)
                return loss_logps
        with seam.kl_term(self, beta), seam.loss_logps_replaced(self, replace) as policy:  # (logps kept: metrics)
            loss = super()._compute_loss(model, loss_inputs)
        loss = loss + entropy_bonus_correction(self, loss_inputs, policy["entropies"], held, coef)
        self.armor_metrics.loss_ratios(inputs, policy["logps"].detach(), policy["entropies"], ref_logps, alpha,
                                       self.epsilon_low, self.epsilon_high, self.importance_sampling_level)
        return loss

    def save_model(self, output_dir: str | None = None, *args, **kwargs):
        if self.reference is None:
            return super().save_model(output_dir, *args, **kwargs)
        with self.reference.left_out_of_saves(self.unwrapped_policy()):  # the policy only (π_ref: in checkpoints)
            return super().save_model(output_dir, *args, **kwargs)

    def create_model_card(self, *args, **kwargs):
        super().create_model_card(*args, **kwargs)
        if self.is_world_process_zero():
            with open(os.path.join(self.args.output_dir, "README.md"), "a") as card:
                card.write(model_card_settings(self.args))

    def log(self, logs: dict, start_time: float | None = None) -> None:
        seam.drop_metrics_without_values(self, "train" if self.model.training else "eval")
        super().log(logs, start_time)

    # --- checkpoints -----------------------------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        """The settings a checkpoint's ARMOR state depends on; resuming with different ones is refused."""
        return fingerprint(self.args, None if self.reference is None else self.reference.kind)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """TRL's ``train``. Called again without resuming, training goes on from the current weights (as with any
        transformers Trainer, whose step count restarts at 0) and ARMOR's α and reset schedules go on from where they
        were, counted in optimizer steps of all calls; π_ref, its resets and the anchor cache stay as they are."""
        checkpoint = self._resolve_checkpoint(resume_from_checkpoint)
        if not checkpoint and self.state.global_step > 0:
            if self.collapse_guard is not None:
                raise ValueError("This trainer has trained already, and collapse_guard keeps its validation history by "
                                 "optimizer step, which a second train() would count from 0 again. Resume with "
                                 "train(resume_from_checkpoint=True), or build a new ArmorGRPOTrainer.")
            if self.armor_started_at is not None:
                self.armor_started_at -= self.state.global_step  # schedules count global_step - armor_started_at
        if self.state.global_step > 0:  # trained before (resuming or not): TRL's buffered rows, and vLLM's weights,
            seam.discard_rollouts(self)  # are the last call's, made by weights this call does not start from
        with self.reference.training_call() if self.reference is not None else contextlib.nullcontext():
            output = super().train(checkpoint, *args, **kwargs)
        if self.args.load_best_model_at_end:  # transformers may have loaded the best checkpoint's weights: vLLM's
            seam.discard_rollouts(self)  # engine holds the final ones, and TRL pushes only at a new global_step
        return output

    def _resolve_checkpoint(self, checkpoint):
        """The newest complete checkpoint for ``True``; refuse one written with other ARMOR settings, or (ARMOR on)
        a fresh run into an output_dir holding an earlier run's checkpoints."""
        return resolve_checkpoint(self.args, checkpoint, self._fingerprint(),
                                  guard_output_dir=self.reference is not None)

    def _save_checkpoint(self, model, trial):
        # Older checkpoints are rotated away only once this one is complete (ARMOR's state file written last), so a
        # run killed in between still has its previous complete checkpoint.
        with seam.rotation_deferred(self):
            super()._save_checkpoint(model, trial)
        directory = seam.checkpoint_dir(self, self.state.global_step, trial)
        self.armor_state.save(directory, self._fingerprint(), write=self.args.should_save)
        seam.rotate(self, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):  # (a VLM's weights: under their saved names)
        load_policy_weights(self, super()._load_from_checkpoint, resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.armor_state.load(checkpoint)
