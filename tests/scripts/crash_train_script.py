"""Trains ArmorGRPOTrainer with a checkpoint every step; used by test_crash.py in a subprocess it kills."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for testing.py

from transformers import AutoTokenizer, TrainerCallback  # noqa: E402

from armor_trl import ArmorConfig, ArmorGRPOTrainer  # noqa: E402
from testing import cpu_args, digit_share_reward  # noqa: E402
from datasets import Dataset  # noqa: E402


class Slow(TrainerCallback):
    def __init__(self, seconds):
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--vllm", action="store_true", help="generate with TRL's colocated vLLM engine (eager)")
    cli = parser.parse_args()
    dataset = Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(16)]})
    engine = dict(use_vllm=True, vllm_mode="colocate", vllm_enforce_eager=True, vllm_max_model_length=256) if cli.vllm else {}
    args = ArmorConfig(
        output_dir=cli.output_dir,
        **cpu_args(max_steps=cli.max_steps, save_strategy="steps", save_steps=1, ref_reset_steps=2, anchor_reward_threshold=0.1,
                   **engine),
    )
    trainer = ArmorGRPOTrainer(
        model=cli.model, reward_funcs=digit_share_reward, args=args, train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(cli.model), callbacks=[Slow(cli.sleep)],
    )
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    print(f"FINISHED step={trainer.state.global_step} resets={trainer.reference.resets}")


if __name__ == "__main__":  # (a vLLM engine starts processes that import this file again)
    main()
