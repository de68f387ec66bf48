"""An agent (TRL's tool loop, ``tools=[multiply]``) trained by ArmorGRPOTrainer in several processes, its processes
making different numbers of tool turns (launched by tests/test_multiprocess_agent.py).

The tiny tool model generates through a deterministic fake at the model (testing.ToolFake; TRL's generation path, its
ZeRO-3 parameter gathering included, runs around it; under FSDP2 the fake makes one sharded forward per call, the
collective that transformers' ``generate`` makes there), and how many tools a trajectory calls depends on the process:

* rank 0: the policy calls ``multiply`` once, then answers "7" (wrong); π_ref calls it once, then answers 3n (right);
* rank 1: the policy answers "7" at once; π_ref answers 3n at once.

So in every loop rank 0 needs one more turn than rank 1 (the policy's rows and π_ref's candidates: 1 against 0; the
prompts, with the tool's schema, leave no room for a second call in the tiny model's 512 positions). Every process
writes ``OUT/rank{R}.json``: its generation calls, the throw-away turns it made to keep them equal, the anchors and
tool masks of its rounds, its anchor-cache hits per round, whether its parameters are sharded, a checksum of its final
parameters (ZeRO-3 and FSDP2 shards gathered) and its log history.

    accelerate launch --config_file configs/accelerate/zero3.yaml --num_processes 2 --mixed_precision no \
        tests/scripts/mp_agent_script.py --model DIR --out DIR --ddp_backend gloo --no_cpu
    accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 --mixed_precision no \
        tests/scripts/fsdp_on_cpu.py tests/scripts/mp_agent_script.py --model DIR --out DIR --ddp_backend gloo
    torchrun --nproc_per_node 2 tests/scripts/mp_agent_script.py --model DIR --out DIR --ddp_backend gloo
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]  # the repository root, tests/

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from armor_trl import ArmorConfig, ArmorGRPOTrainer  # noqa: E402
from mp_train_script import checksum, full_params, is_sharded, skip_deepspeed_shm_comm_op  # noqa: E402
from testing import ToolFake, answer_reward, chat_numbers, end_launch, multiply, tool_call  # noqa: E402


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def turn(prompt_text: str, reference: bool) -> str:
    """What the model says on "n*3?" after the tool results so far (module docstring)."""
    found = re.search(r"u:(\d+)\*", prompt_text)
    if found is None:  # a throw-away turn (its prompt: one token of a row's)
        return "</s>"
    n = int(found.group(1))
    calls = 1 if rank() == 0 else 0  # (the policy's and π_ref's alike)
    if prompt_text.count("\nt:") < calls:
        return tool_call("multiply", a=n, b=3)
    return f"{3 * n}</s>" if reference else "7</s>"


class RankFake(ToolFake):
    """ToolFake whose turns depend on the process; π_ref is any model but the policy's (ZeRO-3 unwraps engines)."""

    def __init__(self, tokenizer, trainer):
        super().__init__(tokenizer, trainer, reference_turn=lambda text: turn(text, True),
                         policy_turn=lambda text: turn(text, False), policy_tools=True)

    def is_reference(self, model) -> bool:
        return model is not self.trainer.model

    def completions(self, model, prompts):
        if self.trainer.is_fsdp_enabled:
            # TRL gathers nothing around FSDP2's generate: its sharded forwards are the collective (each all-gathers
            # the layers' shards); one forward per call stands for them, so unequal calls here fail as they would
            with torch.no_grad():
                model(input_ids=torch.tensor([prompts[0][:1]]))
        return super().completions(model, prompts)


class Recording(ArmorGRPOTrainer):
    def __init__(self, *args, **kwargs):
        self.rounds, self.cache_hits = [], []
        super().__init__(*args, **kwargs)
        if self.anchor_rollout is not None:  # this process's own cache hits per round (the log gathers them)
            sample = self.anchor_rollout.sample

            def recorded(*sample_args, **sample_kwargs):
                anchors, anchor_round = sample(*sample_args, **sample_kwargs)
                self.cache_hits.append(int(anchor_round.cache_hits[0]))
                return anchors, anchor_round

            self.anchor_rollout.sample = recorded

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            is_anchor = output["armor_is_anchor"]
            self.rounds.append({
                "anchors": int(is_anchor.sum()),
                "anchor_tool_tokens": [int((output["tool_mask"][row] == 0).sum()) for row in is_anchor.nonzero().flatten().tolist()],
            })
        return output


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ddp_backend", default=None)
    parser.add_argument("--no_cpu", action="store_true", help="use_cpu=False (needed for DeepSpeed on a CPU host)")
    parser.add_argument("--max_steps", type=int, default=2)
    parser.add_argument("--no_anchors", action="store_true", help="use_anchors=False (TRL's loop, the mixed ratio)")
    parser.add_argument("--prompts", type=int, default=16, help="the dataset's prompts (4: every step revisits all)")
    parser.add_argument("--anchor_cache", action="store_true", help="anchor_cache=True (a hit needs a prompt back)")
    parser.add_argument("--seed", type=int, default=42, help="the seed (the sampler's order of the prompts)")
    cli = parser.parse_args()
    if cli.no_cpu:
        skip_deepspeed_shm_comm_op()
    os.makedirs(cli.out, exist_ok=True)
    args = ArmorConfig(
        output_dir=os.path.join(cli.out, "trainer"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=96, max_steps=cli.max_steps, learning_rate=1e-2, use_cpu=not cli.no_cpu,
        ddp_backend=cli.ddp_backend, bf16=False, gradient_checkpointing=False, report_to="none", logging_steps=1,
        save_strategy="no", seed=cli.seed, disable_tqdm=True, anchor_num_samples=2, use_anchors=not cli.no_anchors,
        anchor_cache=cli.anchor_cache,
    )
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    trainer = Recording(model=cli.model, reward_funcs=answer_reward, args=args,
                        train_dataset=chat_numbers(range(cli.prompts)), processing_class=tokenizer, tools=[multiply])
    initial = checksum(full_params(trainer.accelerator.unwrap_model(trainer.model_wrapped)))
    monkeypatch = pytest.MonkeyPatch()
    fake = RankFake(tokenizer, trainer).install(monkeypatch)
    trainer.train()
    monkeypatch.undo()
    final = full_params(trainer.accelerator.unwrap_model(trainer.model_wrapped))
    process = trainer.accelerator.process_index
    record = {
        "rank": process,
        "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "sharded": is_sharded(trainer.model_wrapped),
        "cache_hits": trainer.cache_hits,
        "generation_calls": [[is_reference, len(texts)] for is_reference, texts in fake.calls],
        "throwaway_turns": getattr(trainer, "_armor_throwaway_turns", 0),
        "rounds": trainer.rounds,
        "initial_checksum": initial,
        "final_checksum": checksum(final),
        "log_history": trainer.state.log_history,
    }
    with open(os.path.join(cli.out, f"rank{process}.json"), "w") as f:
        json.dump(record, f)
    end_launch(trainer)


if __name__ == "__main__":
    main()
