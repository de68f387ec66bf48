"""The reference policy π_ref: build, reset, save and restore.

ARMOR needs π_ref at β = 0, where TRL builds none, so the trainer owns it. Two kinds:

* ``full``: a separate frozen model, built from a path like TRL builds its reference model, or
  from a copy of the initial policy;
* ``lora``: a frozen second adapter ("ref") beside the trained adapter of a PEFT policy. Before the
  first reset it equals the initial adapter; a reset copies adapter-sized weights. Which weights belong to an
  adapter is PEFT's call (its adapter state dict), so every layout is covered: LoRA on linear and embedding
  layers, DoRA, ``trainable_token_indices``, ``modules_to_save``. π_ref is computed in eval mode (no dropout).

A reset makes π_ref an exact copy of the current policy (docs/algorithm.md, "3. The reference and its resets").
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from armor_trl.integration import trl_seam as seam
from armor_trl.reference.shards import assign as _assign, full as _full, gathered as _gathered

REF_ADAPTER = "ref"
REF_WEIGHTS_FILE = "armor_reference.safetensors"
LEGACY_REF_WEIGHTS_FILE = "armor_reference.pt"  # checkpoints written before safetensors


def reset_due(step: int, reset_steps: int | None, every_step_until: int | None, at_steps=None) -> bool:
    """Whether the reference is reset right after optimizer step ``step`` (1-based).

    Up to ``every_step_until`` (inclusive) every step resets; after it, steps that are multiples of
    ``reset_steps`` do; with ``reset_steps=None`` nothing resets after the hybrid phase. Steps listed in
    ``at_steps`` reset too.
    """
    if step < 1:
        return False
    if every_step_until is not None and step <= every_step_until:
        return True
    if at_steps and step in at_steps:
        return True
    return reset_steps is not None and step % reset_steps == 0


def adapter_parameters(peft_model: nn.Module, adapter: str) -> dict[str, nn.Parameter]:
    """The parameters of one adapter of ``peft_model``, keyed by PEFT's adapter-independent state-dict names.

    PEFT's own ``get_peft_model_state_dict`` decides what belongs to the adapter (wherever the adapter name sits in
    a parameter's name); fed the model's parameters instead of its state dict, it hands back the parameters themselves.
    """
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(
        peft_model, state_dict=dict(peft_model.named_parameters()), adapter_name=adapter, save_embedding_layers=False
    )


def cast_lm_head_to_fp32(model: nn.Module) -> None:
    """Give ``model`` the float32 LM head GRPOTrainer gives the policy with ``cast_lm_head_to_fp32=True``.

    The head's weights become float32 and it projects in float32; a tied input embedding (whose weight is the head's)
    still hands the backbone activations of its original dtype. Applied to a separately built reference, a reset then
    copies the policy's float32 head without rounding it to the backbone's dtype.
    """
    head = model.get_output_embeddings()
    embeddings = model.get_input_embeddings()
    original_dtype = head.weight.dtype
    tied = embeddings is not None and embeddings.weight is head.weight
    head.float()

    def project_in_fp32(hidden_states):
        bias = None if head.bias is None else head.bias.float()
        return nn.functional.linear(hidden_states.float(), head.weight.float(), bias)

    head.forward = project_in_fp32
    if tied and original_dtype != torch.float32:
        embeddings.register_forward_hook(lambda module, inputs, output: output.to(original_dtype))


@contextlib.contextmanager
def _evaluating(model: nn.Module):
    """Run ``model`` in eval mode (no dropout) in the block, then give back every module's mode and every
    parameter's ``requires_grad`` as they were (PEFT's adapter switching changes the latter)."""
    modes = [(module, module.training) for module in model.modules()]
    requires_grad = [(param, param.requires_grad) for param in model.parameters()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
        for param, flag in requires_grad:
            param.requires_grad_(flag)


@torch.no_grad()
def copy_parameters(pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Copy each source parameter into its target, in place (``pairs`` = [(target, source), ...])."""
    for target, source in pairs:
        with _gathered([source]), _gathered([target], modifier_rank=0):
            _assign(target.data, source.data)


class ReferencePolicy:
    """π_ref for ARMOR, either a separate frozen model (``kind="full"``) or a LoRA adapter (``kind="lora"``)."""

    def __init__(self, kind: str, model: nn.Module | None = None, trained_adapter: str | None = None):
        if kind not in ("full", "lora"):
            raise ValueError(f"kind must be 'full' or 'lora', got {kind!r}")
        self.kind = kind
        self.model = model
        self.trained_adapter = trained_adapter
        self.resets = 0
        self.last_reset_step = 0
        # a reset the schedule placed inside a rollout batch, waiting for the batch's end (ReferenceResetCallback)
        self.reset_pending = False
        # optimizer step after which π_ref was last made equal to the policy (None: never, e.g. a given ref_model)
        self.synced_step: int | None = None
        # Identity of weights, not step arithmetic (a second train(), a rollback or a resume make step numbers lie):
        # the policy's weights get a new version at every optimizer step and every load; π_ref remembers the version
        # it copied (None: weights of unknown relation to the policy's, e.g. a given ref_model).
        self.policy_version = 0
        self.copied_version: int | None = None
        # Changes outside the trainer (load_adapter, load_state_dict, a parameter replaced between train() calls) bump
        # no version: the identity and in-place version counter of every parameter on both sides, recorded when π_ref
        # was made equal to the policy, catch them. ``policy_getter`` gives the unwrapped policy (None: not checked).
        self.policy_getter = None
        self.copied_weights: tuple | None = None
        # The record is compared only between train() calls: inside one, the launcher's own set-up (DDP's broadcast
        # from rank 0, DeepSpeed's partitioning) writes the parameters in place without changing their values, and
        # every change the trainer makes bumps policy_version.
        self.training = False
        # optimizer step of this run whose policy weights π_ref holds (differs from synced_step after a rollback, e.g.
        # the collapse guard's); with validation at that step it gives the reference's own accuracy. None: unknown
        self.weights_step: int | None = None

    # --- build -------------------------------------------------------------------------------------------------
    @classmethod
    def full(cls, model: nn.Module) -> "ReferencePolicy":
        model.eval()
        for param in model.parameters():
            param.requires_grad_(False)
        return cls("full", model=model)

    @classmethod
    def lora(cls, peft_model: nn.Module) -> "ReferencePolicy":
        """Add a frozen "ref" adapter that copies the policy's active adapter."""
        trained = peft_model.active_adapter
        if REF_ADAPTER in peft_model.peft_config:
            raise ValueError(
                f"The PEFT model already has an adapter named {REF_ADAPTER!r}; ARMOR uses that name for the reference "
                "adapter. Rename or delete it first."
            )
        # π_ref only ever runs in eval mode, so its adapter's dropout never acts; built without it, no dropout module
        # of an inactive adapter makes the policy look as if it generated with dropout (anchor_same_call)
        config = copy.copy(peft_model.peft_config[trained])
        if getattr(config, "lora_dropout", 0.0):
            config.lora_dropout = 0.0
        peft_model.add_adapter(REF_ADAPTER, config)
        reference = cls("lora", model=None, trained_adapter=trained)
        for param in adapter_parameters(peft_model, REF_ADAPTER).values():
            param.requires_grad_(False)
        reference.copy_from(peft_model)
        reference.synced_step = reference.weights_step = 0
        reference.mark_copied(peft_model)
        return reference

    # --- reset -------------------------------------------------------------------------------------------------
    def _pairs(self, policy: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
        return list(self._named_pairs(policy).values())

    def _named_pairs(self, policy: nn.Module) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
        """{name: (reference parameter, policy parameter)}; names are the policy's, or PEFT's adapter-free ones."""
        if self.kind == "lora":
            pairs = self._adapter_pairs(policy)
        else:
            # A DeepSpeed engine (ZeRO) names its parameters "module.…": compare the wrapped modules
            ref_params = dict(getattr(self.model, "module", self.model).named_parameters())
            pol_params = dict(policy.named_parameters())
            if ref_params.keys() != pol_params.keys():
                only_ref = sorted(set(ref_params) - set(pol_params))[:3]
                only_policy = sorted(set(pol_params) - set(ref_params))[:3]
                raise ValueError(
                    "The reference's parameters do not match the policy's (only in the reference: "
                    f"{only_ref}; only in the policy: {only_policy}). ref_model must have the policy's architecture."
                )
            pairs = {name: (ref_params[name], p) for name, p in pol_params.items()}
        if not pairs:
            raise ValueError("Cannot reset the reference: found no parameters to copy.")
        return pairs

    def _adapter_pairs(self, policy: nn.Module) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
        """{key: (ref adapter parameter, trained adapter parameter)} for every parameter of the trained adapter."""
        trained = adapter_parameters(policy, self.trained_adapter)
        ref = adapter_parameters(policy, REF_ADAPTER)
        if trained.keys() != ref.keys():
            only_trained = sorted(set(trained) - set(ref))[:3]
            only_ref = sorted(set(ref) - set(trained))[:3]
            raise ValueError(
                f"The reference adapter {REF_ADAPTER!r} does not mirror the trained adapter {self.trained_adapter!r} "
                f"(only in the trained adapter: {only_trained}; only in the reference adapter: {only_ref}), so a reset "
                "cannot copy it. Both adapters must be created from the same PEFT config."
            )
        copied = {id(param) for param in trained.values()}
        uncopied = [n for n, param in policy.named_parameters() if param.requires_grad and id(param) not in copied]
        if uncopied:
            raise ValueError(
                f"Trainable parameters outside the adapter {self.trained_adapter!r} ({uncopied[:3]}, {len(uncopied)} "
                "in all) have no copy in the reference adapter, so π_ref would move with the policy. Train only "
                "adapter weights (put extra trained modules in the PEFT config's modules_to_save), or freeze them."
            )
        return {key: (ref[key], trained[key]) for key in trained}

    def copy_from(self, policy: nn.Module) -> None:
        """Make the reference an exact copy of ``policy`` (the unwrapped policy model)."""
        copy_parameters(self._pairs(policy))

    def reset(self, policy: nn.Module, step: int, weights_step: int | None = None) -> None:
        """π_ref ← ``policy`` after optimizer step ``step``; ``weights_step``: the step whose weights the policy
        holds, when it was rolled back to an earlier checkpoint (default ``step``)."""
        self.copy_from(policy)
        self.resets += 1
        self.reset_pending = False
        self.last_reset_step = step
        self.synced_step = step
        self.weights_step = step if weights_step is None else weights_step
        self.mark_copied(policy)

    def mark_copied(self, policy: nn.Module | None) -> None:
        """π_ref now holds exactly ``policy``'s weights (the unwrapped policy; None: do not record its parameters)."""
        self.copied_version = self.policy_version
        self.copied_weights = None if policy is None else self._weights_record(policy)

    def _weights_record(self, policy: nn.Module) -> tuple:
        """Identity and in-place version counter (``Tensor._version``) of every parameter π_ref and the policy share."""
        return tuple((id(p), p._version) for pair in self._pairs(policy) for p in pair)

    def policy_changed(self) -> None:
        """The policy's weights changed (an optimizer step, weights loaded into it): they get a new version."""
        self.policy_version += 1

    def holds_policy_weights(self) -> bool:
        """True when π_ref holds exactly the policy's current weights: it copied them and they have not changed since,
        neither by the trainer (versions) nor outside it between train() calls (the parameters' record, then their
        values: a write through ``.data``, as ``vector_to_parameters`` makes, moves no version counter)."""
        if self.copied_version is None or self.copied_version != self.policy_version:
            return False
        if self.training or self.copied_weights is None or self.policy_getter is None:
            return True
        policy = self.policy_getter()
        return self._weights_record(policy) == self.copied_weights and self._same_values(policy)

    def _same_values(self, policy: nn.Module) -> bool:
        """Whether every parameter π_ref and the policy share is equal, value for value (one pass over them, made
        only between train() calls)."""
        for ref, own in self._pairs(policy):
            with _gathered([ref, own]):
                if not torch.equal(_full(ref.data), _full(own.data).to(ref.device)):
                    return False
        return True

    @contextlib.contextmanager
    def training_call(self):
        """Around one train() call: weights changed outside the trainer since π_ref copied them end the equality at
        its start; at its end the parameters are recorded as they are, to compare before the next call."""
        if not self.holds_policy_weights():
            self.copied_version = None
        self.training = True
        try:
            yield
        finally:
            self.training = False
            if self.copied_version is not None and self.copied_version == self.policy_version:
                self.mark_copied(None if self.policy_getter is None else self.policy_getter())

    # --- use ---------------------------------------------------------------------------------------------------
    @property
    def full_model(self) -> nn.Module | None:
        """The separate reference model (None for a LoRA reference, which runs inside the policy)."""
        return self.model if self.kind == "full" else None

    @contextlib.contextmanager
    def active(self, policy: nn.Module):
        """Within the block, a LoRA policy runs as the reference: the "ref" adapter is active and the model is in
        eval mode, so π_ref has no dropout (like a full reference, which is always in eval mode)."""
        if self.kind != "lora":
            yield
            return
        with _evaluating(policy), seam.adapter_active(policy, REF_ADAPTER):
            yield

    @contextlib.contextmanager
    def left_out_of_saves(self, policy: nn.Module):
        """Within the block, saving the PEFT policy writes the trained adapter only: PEFT saves every adapter it lists,
        and the frozen "ref" adapter belongs in checkpoints' ARMOR state, not in a model that is shared or pushed."""
        if self.kind != "lora":
            yield
            return
        config = policy.peft_config.pop(REF_ADAPTER)
        try:
            yield
        finally:
            policy.peft_config[REF_ADAPTER] = config

    def parameters_of(self, policy: nn.Module) -> list[nn.Parameter]:
        """The reference's own parameters (for tests and checkpoints)."""
        return [target for target, _ in self._pairs(policy)]

    # --- save / restore ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "resets": self.resets, "last_reset_step": self.last_reset_step,
                "synced_step": self.synced_step, "weights_step": self.weights_step,
                "policy_version": self.policy_version, "copied_version": self.copied_version,
                "reset_pending": self.reset_pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(
                f"The checkpoint holds a {state.get('kind')!r} reference but this run uses a {self.kind!r} one "
                "(LoRA and full-model runs cannot resume each other)."
            )
        self.resets = state["resets"]
        self.last_reset_step = state["last_reset_step"]
        self.synced_step = state.get("synced_step")
        self.weights_step = state.get("weights_step")
        self.reset_pending = state.get("reset_pending", False)
        # Loaded with the policy's weights of the same checkpoint (resume, rollback): those get a version not used
        # before in this process, and π_ref equals them iff it equalled them when saved. Checkpoints written before
        # versions existed do not say, so π_ref counts as different (a separate reference call, always exact).
        saved_policy, saved_copy = state.get("policy_version"), state.get("copied_version")
        self.policy_version = max(self.policy_version, saved_policy or 0) + 1
        same = saved_policy is not None and saved_copy == saved_policy
        self.copied_version, self.copied_weights = None, None
        if same:  # (the policy's weights are loaded before the ARMOR state: transformers' resume, the rollback)
            self.mark_copied(None if self.policy_getter is None else self.policy_getter())

    def save_weights(self, directory: str, policy: nn.Module, write: bool = True) -> None:
        """Write the reference's weights (or the "ref" adapter's) as safetensors. Collective under ZeRO-3 and FSDP2
        (parameters are gathered): call on every process, with ``write`` on one."""
        from safetensors.torch import save_file

        tensors = {}
        for name, (target, _) in self._named_pairs(policy).items():
            with _gathered([target]):
                full = _full(target.detach())
                if write:
                    tensors[name] = full.cpu().contiguous().clone()
        if write:
            save_file(tensors, os.path.join(directory, REF_WEIGHTS_FILE))

    def load_weights(self, directory: str, policy: nn.Module) -> None:
        """Restore the weights written by :meth:`save_weights` (or by a FORMAT 1 checkpoint, without pickle)."""
        tensors = _read_weights(directory)
        targets = {name: target for name, (target, _) in self._named_pairs(policy).items()}
        if tensors.keys() != targets.keys():
            only_saved = sorted(map(str, set(tensors) - set(targets)))[:3]
            only_here = sorted(set(targets) - set(tensors))[:3]
            raise ValueError(
                f"Checkpoint {directory} holds a reference with other weights than this run's (only in the "
                f"checkpoint: {only_saved}; only in this run: {only_here}): resume with the model and PEFT config it "
                "was written with."
            )
        with torch.no_grad():
            for name, target in targets.items():
                with _gathered([target], modifier_rank=0):
                    if target.shape != tensors[name].shape:
                        raise ValueError(
                            f"Checkpoint {directory} holds a reference whose {name} has shape "
                            f"{tuple(tensors[name].shape)}; this run's has {tuple(target.shape)}."
                        )
                    _assign(target.data, tensors[name])


def _read_weights(directory: str) -> dict[str, torch.Tensor]:
    path = os.path.join(directory, REF_WEIGHTS_FILE)
    if os.path.exists(path):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    legacy = os.path.join(directory, LEGACY_REF_WEIGHTS_FILE)
    if os.path.exists(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise ValueError(f"Checkpoint {directory} has no {REF_WEIGHTS_FILE}: the reference's weights cannot be restored.")


def copy_model_for_reference(model: nn.Module) -> nn.Module:
    """A detached copy of a policy instance, taken before TRL patches the policy's forward."""
    return copy.deepcopy(model)


class ReferenceResetCallback(TrainerCallback):
    """Resets the reference on ARMOR's schedule, right after an optimizer step that ends a rollout batch.

    A rollout batch's rows carry π_ref's log-probs from the batch's start (the mixed ratio, the KL's target), and its
    anchors were drawn by that π_ref: a reset the schedule places inside a batch waits for the batch's end
    (``rollout_ended()``: TRL generates a new batch for the next micro-batch), so every step of a batch trains against
    the π_ref it was built with. ``start_step()`` gives the optimizer step ARMOR started at (the schedule counts from
    there), or None while ARMOR is dormant (no resets); by default 0.
    """

    def __init__(self, reference: ReferencePolicy, get_policy, reset_steps: int | None, every_step_until: int | None,
                 at_steps=None, start_step=lambda: 0, rollout_ended=lambda: True):
        self.reference = reference
        self.get_policy = get_policy
        self.reset_steps = reset_steps
        self.every_step_until = every_step_until
        self.at_steps = set(at_steps or ())
        self.start_step = start_step
        self.rollout_ended = rollout_ended

    @classmethod
    def of(cls, trainer) -> ReferenceResetCallback:
        """An ArmorGRPOTrainer's: its π_ref and schedule (counted from the step ARMOR started at), reset at the ends
        of TRL's rollout batches."""
        args = trainer.args
        return cls(trainer.reference, trainer.unwrapped_policy, args.ref_reset_steps, args.ref_reset_every_step_until,
                   args.ref_reset_at_steps, start_step=lambda: trainer.armor_started_at,
                   rollout_ended=lambda: seam.rollout_batch_ended(trainer))

    def on_train_begin(self, args, state, control, **kwargs):
        # a reset left waiting in a checkpoint written inside a rollout batch: the resumed run starts a new batch
        if self.reference.reset_pending and self.start_step() is not None:
            self.reference.reset(self.get_policy(), state.global_step)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.reference.policy_changed()
        start = self.start_step()
        if start is None:
            return control
        if reset_due(state.global_step - start, self.reset_steps, self.every_step_until, self.at_steps):
            self.reference.reset_pending = True
        if self.reference.reset_pending and self.rollout_ended():
            self.reference.reset(self.get_policy(), state.global_step)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if args.load_best_model_at_end:  # transformers may just have loaded the best checkpoint's weights
            self.reference.policy_changed()
        return control


def build_reference(trainer, ref_model, ref_copy: nn.Module | None, quantization_config) -> ReferencePolicy:
    """π_ref for ``trainer``: a frozen "ref" adapter for a PEFT policy; otherwise a separate model, built like
    GRPOTrainer builds its reference model from ``ref_model`` (a model, a path), the copy of the initial policy
    ``ref_copy`` or the policy's own path, and prepared for DeepSpeed / FSDP / accelerate like it."""
    from accelerate.utils import is_peft_model

    if is_peft_model(trainer.model):
        reference = ReferencePolicy.lora(trainer.model)
        reference.policy_getter = trainer.unwrapped_policy
        return reference
    args = trainer.args
    if isinstance(ref_model, nn.Module):
        model = ref_model
    elif ref_copy is not None:
        model = ref_copy
    else:
        source = ref_model if isinstance(ref_model, str) else seam.model_id(trainer.model)
        init_kwargs = dict(args.model_init_kwargs or {})
        if quantization_config is not None:
            init_kwargs["quantization_config"] = quantization_config
        if args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
            init_kwargs["device_map"] = None
        init_kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        init_kwargs.setdefault("dtype", trainer.model.dtype)
        try:
            model = seam.load_causal_lm(source, **init_kwargs)
        except (OSError, ValueError) as error:
            raise ValueError(f"ref_model {source!r} could not be loaded as a causal LM: {error}") from error
    if args.cast_lm_head_to_fp32:  # as GRPOTrainer casts the policy's head, so a reset copies it exactly
        cast_lm_head_to_fp32(model)
    reference = ReferencePolicy.full(seam.prepare_like_reference_model(trainer, model, args.cast_lm_head_to_fp32))
    reference.policy_getter = trainer.unwrapped_policy
    if ref_model is None:  # a copy of the initial policy
        reference.synced_step = reference.weights_step = 0
        reference.mark_copied(trainer.unwrapped_policy())
    return reference
