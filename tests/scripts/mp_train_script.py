"""Train ArmorGRPOTrainer on the tiny model for a few steps, in one or several processes, and write what happened.

Launched by tests/test_multiprocess.py, e.g.

    torchrun --nproc_per_node 2 tests/scripts/mp_train_script.py --model DIR --out DIR --ddp_backend gloo
    accelerate launch --config_file configs/accelerate/zero3.yaml --num_processes 2 --mixed_precision no \
        tests/scripts/mp_train_script.py --model DIR --out DIR --ddp_backend gloo --no_cpu
    accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 --mixed_precision no \
        tests/scripts/fsdp_on_cpu.py tests/scripts/mp_train_script.py --model DIR --out DIR --ddp_backend gloo
    python tests/scripts/mp_train_script.py --model DIR --out DIR --per_device_train_batch_size 16   # one process

Every process writes ``OUT/rank{R}.json`` with its own observations:

* ``rounds``: per generation round, what this process saw: its groups' prompts, whether its reward function
  (called on this process only) verified one of the group's reference candidates, whether the trainer found an
  anchor for the group, whether the anchor sits in the group's last row on this process, the rewards this
  process scored for its rows, and the rows whose anchor slot was empty;
* ``steps``: after each optimizer step (after the reference reset, if one was due): whether a reset happened and
  the largest |π_ref − π_θ| over all parameters (ZeRO-3 shards are gathered first), plus parameter checksums;
* ``final``: how far the policy moved from the initial weights, checksums of policy and reference;
* ``log_history``: the trainer's log history (the logged metrics are already gathered over processes).

With ``--validate``, validation through the trainer's generation path rides along (what
tests/test_multiprocess.py compares between backends and with one process): a ValidationCallback (7 problems, so
one shard is padded; n = 4; one problem per generation call, seeded from it) at step 0 and at the last step, and
at step 0 -- the initial weights, sharded under ZeRO-3 -- evaluate_with_trainer once sampled and once greedy.
``validation`` then holds the callback's history, both direct results, the generation calls validation made and
the sampling settings before and after. Validation restores the RNG, so training draws what it would without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]  # the repository root, tests/

import contextlib  # noqa: E402

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402

from armor_trl import ArmorConfig, ArmorGRPOTrainer

from armor_trl.callbacks import evaluation, validation  # noqa: E402
from testing import end_launch  # noqa: E402

# What the reward function saw on this process: the phase is "candidates" while the trainer scores reference
# candidates for anchors and "rollout" otherwise.
RECORD = {"phase": "rollout", "calls": []}


def digit_verifier(completions, **kwargs):
    """1.0 when the completion contains a digit (a random tiny model hits it about half the time); validation's
    verifier, not recorded."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(any(ch.isdigit() for ch in text)) for text in texts]


def has_digit(completions, **kwargs):
    """The training reward: digit_verifier, each call recorded in RECORD (the training rounds' own)."""
    rewards = digit_verifier(completions)
    RECORD["calls"].append({"phase": RECORD["phase"], "prompts": list(kwargs["prompts"]), "rewards": rewards})
    return rewards


NUM_VAL_PROBLEMS = 7  # odd: with 2 processes the last shard is padded
VALIDATION = dict(k=2, num_samples=4, max_new_tokens=6, top_p=0.9, batch_size=4)  # one problem per call


class CountingGeneration:
    """evaluation.py's view of trl_generation, its generation calls counted (the anchors' calls go around it)."""

    def __init__(self, generation):
        self.generation, self.calls = generation, []

    def generate(self, trainer, prompt_ids, num_generations):
        self.calls.append(len(prompt_ids))
        return self.generation.generate(trainer, prompt_ids, num_generations)

    def __getattr__(self, name):
        return getattr(self.generation, name)


def sampling_settings(trainer) -> dict:
    config = trainer.generation_config
    return {"temperature": config.temperature, "top_p": config.top_p, "max_new_tokens": config.max_new_tokens,
            "do_sample": config.do_sample}


class DirectValidation(TrainerCallback):
    """At step 0, after the ValidationCallback: evaluate_with_trainer sampled and greedy on the initial weights."""

    def __init__(self, trainer, held_out, generation: CountingGeneration):
        self.trainer, self.held_out, self.generation, self.result = trainer, held_out, generation, {}

    def on_train_begin(self, args, state, control, **kwargs):
        before, calls = sampling_settings(self.trainer), len(self.generation.calls)
        self.result = {
            "settings_before": before,
            "sampled": evaluation.evaluate_with_trainer(self.trainer, self.held_out, digit_verifier, temperature=1.0,
                                                        seed=11, **VALIDATION),
            "greedy": evaluation.evaluate_with_trainer(self.trainer, self.held_out, digit_verifier, temperature=0.0,
                                                       **VALIDATION),
            "settings_after": sampling_settings(self.trainer),
            "direct_calls": len(self.generation.calls) - calls,
        }


def _gathered(params):
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params)
    return contextlib.nullcontext()


def full_params(module) -> dict[str, torch.Tensor]:
    """name -> full fp32 CPU copy of every parameter (ZeRO-3 and FSDP2 shards gathered one at a time)."""
    return full_params_of(dict(module.named_parameters()))


@torch.no_grad()
def full_params_of(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in params.items():
        with _gathered([param]):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[name] = full.detach().float().cpu().clone()
    return out


def reference_and_policy(trainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(π_ref, π_θ) as full fp32 copies, keyed alike: the reference's parameters and the policy's that a reset copies
    into them (all of a full reference's, the trained adapter's for a LoRA one). Collective when sharded."""
    pairs = trainer.reference._named_pairs(trainer.unwrapped_policy())
    reference = full_params_of({name: ref for name, (ref, _) in pairs.items()})
    return reference, full_params_of({name: own for name, (_, own) in pairs.items()})


def is_sharded(module) -> bool:
    """Whether the module's parameters are ZeRO-3 partitions or FSDP2 shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(hasattr(p, "ds_id") or isinstance(p, DTensor) for p in module.parameters())


def checksum(params: dict[str, torch.Tensor]) -> float:
    return float(sum(p.double().sum().item() + (p.double() ** 2).sum().item() for p in params.values()))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in b)


class RecordingTrainer(ArmorGRPOTrainer):
    """ArmorGRPOTrainer that records, on each process, which groups it held and what their anchors were."""

    def __init__(self, *args, **kwargs):
        self.rounds = []
        self._pending_round = None
        super().__init__(*args, **kwargs)
        if self.anchor_rollout is not None:
            sample = self.anchor_rollout.sample
            self.anchor_rollout.sample = lambda ids, inputs, candidates=None, **kw: self._sample_anchors(
                sample, ids, inputs, candidates, **kw)

    def _sample_anchors(self, sample, group_prompt_ids, group_inputs, candidates=None, **kw):
        calls_before = len(RECORD["calls"])
        RECORD["phase"] = "candidates"
        try:
            anchors, anchor_round = sample(group_prompt_ids, group_inputs, candidates, **kw)
        finally:
            RECORD["phase"] = "rollout"
        k = self.args.anchor_num_samples
        candidate_rewards = [r for call in RECORD["calls"][calls_before:] for r in call["rewards"]]
        candidate_prompts = [p for call in RECORD["calls"][calls_before:] for p in call["prompts"]]
        self._pending_round = {
            "group_prompts": [row["prompt"] for row in group_inputs],
            "group_prompt_ids": [list(ids) for ids in group_prompt_ids],
            "anchor_ids": [list(ids) for ids in anchors],
            # whether this process's own reward calls verified a candidate of each of its groups
            "locally_verified": [
                any(r >= self.args.anchor_reward_threshold for r in candidate_rewards[g * k : (g + 1) * k])
                for g in range(len(group_prompt_ids))
            ],
            "candidate_prompts_match": candidate_prompts
            == [row["prompt"] for row in group_inputs for _ in range(k)],
            "found": anchor_round.found.tolist(),
        }
        return anchors, anchor_round

    def _generate_and_score_completions(self, inputs):
        calls_before = len(RECORD["calls"])
        self._pending_round = None
        output = super()._generate_and_score_completions(inputs)
        if not self.model.training or self._pending_round is None:
            return output
        info = self._pending_round
        self._pending_round = None
        rows, group_size = output["completion_ids"].size(0), self.num_generations
        pad = self.processing_class.pad_token_id
        prompts_whole, anchor_in_last_row = [], []
        for group in range(rows // group_size):
            first, last = group * group_size, (group + 1) * group_size - 1
            group_prompts = [
                output["prompt_ids"][row][output["prompt_mask"][row].bool()].tolist() for row in range(first, last + 1)
            ]
            prompts_whole.append(all(ids == info["group_prompt_ids"][group] for ids in group_prompts))
            anchor = info["anchor_ids"][group]
            completion = output["completion_ids"][last].tolist()
            anchor_in_last_row.append(
                completion[: len(anchor)] == anchor and all(t == pad for t in completion[len(anchor) :])
            )
        rollout_calls = [c for c in RECORD["calls"][calls_before:] if c["phase"] == "rollout"]
        is_anchor = output["armor_is_anchor"].tolist()
        self.rounds.append(
            {
                "step": self.state.global_step + 1,
                "rank": self.accelerator.process_index,
                "rows": rows,
                "groups": rows // group_size,
                "group_prompts": info["group_prompts"],
                "found": info["found"],
                "locally_verified": info["locally_verified"],
                "candidate_prompts_match": info["candidate_prompts_match"],
                "prompts_whole": prompts_whole,
                "anchor_in_last_row": anchor_in_last_row,
                "is_anchor": is_anchor,
                "is_anchor_matches_found": [
                    is_anchor[(g + 1) * group_size - 1] == info["found"][g] for g in range(rows // group_size)
                ],
                "rollout_rewards": [r for c in rollout_calls for r in c["rewards"]],
                "rollout_reward_calls": len(rollout_calls),
            }
        )
        return output


class StepRecorder(TrainerCallback):
    """After each optimizer step (added after ARMOR's reset callback, so it sees the reset's result)."""

    def __init__(self, trainer: RecordingTrainer):
        self.trainer = trainer
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        reference, policy = reference_and_policy(trainer)
        self.steps.append(
            {
                "step": state.global_step,
                "reset_now": trainer.reference.last_reset_step == state.global_step and trainer.reference.resets > 0,
                "resets": trainer.reference.resets,
                "ref_policy_max_diff": max_diff(reference, policy),
                "policy_checksum": checksum(policy),
                "reference_checksum": checksum(reference),
            }
        )
        return control


def read_checkpoints(output_dir: str) -> dict:
    """What ARMOR wrote beside each checkpoint: its state file and a checksum of the saved reference weights."""
    from safetensors.torch import load_file

    from armor_trl.integration.checkpoint import STATE_FILE, read_state
    from armor_trl.reference.policy import REF_WEIGHTS_FILE

    found = {}
    if not os.path.isdir(output_dir):
        return found
    for name in sorted(os.listdir(output_dir)):
        directory = os.path.join(output_dir, name)
        if not name.startswith("checkpoint-"):
            continue
        entry = {"files": sorted(os.listdir(directory))}
        if os.path.exists(os.path.join(directory, STATE_FILE)):
            entry["state"] = read_state(directory)["parts"]["reference"]
        if os.path.exists(os.path.join(directory, REF_WEIGHTS_FILE)):
            tensors = load_file(os.path.join(directory, REF_WEIGHTS_FILE))
            entry["reference_checksum"] = checksum({str(k): v.float() for k, v in tensors.items()})
        found[name] = entry
    return found


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--ref_reset_steps", type=int, default=2)
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--anchor_filter", default="drop")
    parser.add_argument("--anchor_num_samples", type=int, default=4)
    parser.add_argument("--ddp_backend", default=None)
    parser.add_argument("--no_cpu", action="store_true", help="use_cpu=False (needed for DeepSpeed on a CPU host)")
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--save_steps", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    parser.add_argument("--resume_from", default=None, help="a checkpoint directory to resume from")
    parser.add_argument("--validate", action="store_true", help="validate at steps 0 and max_steps (module docstring)")
    parser.add_argument("--lora", action="store_true", help="a LoRA policy (π_ref: its frozen reference adapter)")
    parser.add_argument("--ref_reset_at_steps", type=int, nargs="*", default=None)
    return parser.parse_args(argv)


def skip_deepspeed_shm_comm_op() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory all-reduce op at its first launch on a machine (about 60 s on
    2 cores) that only its ``inference_all_reduce`` (tensor-parallel inference) uses; ZeRO training reduces through
    torch.distributed (gloo here), so marked unavailable the op is neither built nor missed. DeepSpeed keeps the
    table of available ops in one dict for edits like this one (deepspeed/ops/__init__.py); should it move, the op
    is compiled again and the runs only take longer."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def main(argv=None):
    started = time.time()
    cli = parse_args(argv)
    if cli.no_cpu:  # DeepSpeed, before accelerate starts its communication backend
        skip_deepspeed_shm_comm_op()
    os.makedirs(cli.out, exist_ok=True)
    args = ArmorConfig(
        output_dir=os.path.join(cli.out, "trainer"),
        per_device_train_batch_size=cli.per_device_train_batch_size,
        num_generations=cli.num_generations,
        max_completion_length=8,
        max_steps=cli.max_steps,
        learning_rate=cli.learning_rate,
        use_cpu=not cli.no_cpu,
        ddp_backend=cli.ddp_backend,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_steps=1,
        save_strategy="steps" if cli.save_steps else "no",
        save_steps=cli.save_steps or 500,
        seed=42,
        disable_tqdm=True,
        ref_reset_steps=cli.ref_reset_steps,
        ref_reset_at_steps=cli.ref_reset_at_steps,
        anchor_filter=cli.anchor_filter,
        anchor_num_samples=cli.anchor_num_samples,
    )
    dataset = Dataset.from_dict(
        {"prompt": [f"{i}+{i + 1}=" for i in range(32)], "answer": [str(2 * i + 1) for i in range(32)]}
    )
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    peft_config = None
    if cli.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainer = RecordingTrainer(
        model=cli.model, reward_funcs=has_digit, args=args, train_dataset=dataset, processing_class=tokenizer,
        peft_config=peft_config,
    )
    recorder = StepRecorder(trainer)
    trainer.add_callback(recorder)  # after ReferenceResetCallback: sees the reference right after a reset
    if cli.validate:
        generation = evaluation.trl_generation = CountingGeneration(evaluation.trl_generation)
        held_out = dataset.select(range(NUM_VAL_PROBLEMS))
        callback = validation.ValidationCallback(held_out, digit_verifier, every_steps=cli.max_steps, temperature=1.0,
                                                 seed=5, **VALIDATION).attach(trainer)
        direct = DirectValidation(trainer, held_out, generation)
        trainer.add_callback(direct)  # after the callback: its step-0 validation comes first

    reference_at_start, initial = reference_and_policy(trainer)
    trainer.train(resume_from_checkpoint=cli.resume_from)

    reference, policy = reference_and_policy(trainer)
    common = list(initial)
    result = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "deepspeed_stage": (
            trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None
        ),
        "reference_type": type(trainer.reference.model).__name__ if trainer.reference.model is not None else "lora",
        "reference_sharded": is_sharded(trainer.reference.model or trainer.model_wrapped),
        "reference_start_equals_initial": max_diff(reference_at_start, initial) == 0.0,
        "rounds": trainer.rounds,
        "steps": recorder.steps,
        "final": {
            "params_compared": len(common),
            "policy_change": max((policy[n] - initial[n]).abs().max().item() for n in common),
            "policy_checksum": checksum(policy),
            "reference_checksum": checksum(reference),
            "resets": trainer.reference.resets,
        },
        "log_history": trainer.state.log_history,
        "checkpoints": read_checkpoints(args.output_dir),
        "seconds": time.time() - started,
    }
    if cli.validate:
        result["validation"] = {
            **direct.result, "on_every_process": callback.on_every_process, "callback_history": callback.history,
            "generation_calls": generation.calls,
            "generation_calls_in_training": len(generation.calls) - direct.result["direct_calls"],
            "policy_sharded": is_sharded(trainer.model_wrapped),
        }
    with open(os.path.join(cli.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    end_launch(trainer)


if __name__ == "__main__":
    main()
