"""Dynamic sampling with refill in one process of a multi-process run (launched by tests/test_multiprocess_dynamic_sampling.py).

Writes ``rank<N>.json`` with what this process saw: the prompts of every generation round it scored, which groups
of its final batches were kept, its final weights' checksum and the log history.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for testing.py

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from armor_trl import ArmorConfig, ArmorGRPOTrainer  # noqa: E402
from testing import DrawToolFake, answer_reward, chat_numbers, end_launch, multiply, scripted  # noqa: E402


class Recording(ArmorGRPOTrainer):
    def __init__(self, *args, **kwargs):
        self.round_prompts, self.batches = [], []
        super().__init__(*args, **kwargs)

    def _score_round(self, inputs):
        self.round_prompts.append([row["prompt"] for row in inputs][:: self.num_generations])
        return super()._score_round(inputs)

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.model.training:
            mask = batch["completion_mask"].view(-1, self.num_generations, batch["completion_mask"].size(1))
            self.batches.append({"step": self.state.global_step + 1, "kept": (mask.sum(dim=(1, 2)) > 0).tolist()})
        return batch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--anchor-filter", default="drop")  # keep: mixed groups draw their anchors after the loop
    # TRL's tool loop on the tiny tool model (--model), generation faked at the model (testing.DrawToolFake): mixed
    # groups; π_ref's candidates call multiply and answer with its result
    parser.add_argument("--tools", action="store_true")
    cli = parser.parse_args()
    args = ArmorConfig(
        output_dir=os.path.join(cli.out, "trainer"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=96 if cli.tools else 8, max_steps=4, learning_rate=1e-2, use_cpu=True, ddp_backend="gloo", bf16=False,
        gradient_checkpointing=False, report_to="none", logging_steps=1, save_strategy="steps", save_steps=2,
        seed=42, disable_tqdm=True, dynamic_sampling=True, anchor_num_samples=2, anchor_filter=cli.anchor_filter,
        **({"anchor_same_call": False} if cli.tools else {}),
    )
    dataset = Dataset.from_dict({"prompt": [f"{n}+{n + 1}=" for n in range(30)], "answer": [str(2 * n + 1) for n in range(30)]})
    if cli.tools:
        dataset = chat_numbers(range(30))
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    trainer = Recording(
        model=cli.model, reward_funcs=answer_reward if cli.tools else scripted, args=args, train_dataset=dataset,
        processing_class=tokenizer, tools=[multiply] if cli.tools else None,
    )
    if cli.tools:
        from transformers import LlamaForCausalLM

        class Patch:  # what DrawToolFake.install needs of pytest's monkeypatch
            setattr = staticmethod(setattr)

        DrawToolFake(tokenizer, trainer).install(Patch(), LlamaForCausalLM).hook(trainer)
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    policy = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    result = {
        "rank": trainer.accelerator.process_index,
        "round_prompts": trainer.round_prompts,
        "batches": trainer.batches,
        "checksum": float(sum(p.detach().double().abs().sum() for p in policy.parameters())),
        "params": {n: p.detach().flatten()[:64].tolist() for n, p in policy.named_parameters()},
        "refill_drawn": trainer.dynamic_sampling.refill.drawn,
        "anchor_counts": dict(trainer.anchor_rollout.counts),
        "log_history": trainer.state.log_history,
    }
    with open(os.path.join(cli.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)
    end_launch(trainer)


if __name__ == "__main__":
    main()
