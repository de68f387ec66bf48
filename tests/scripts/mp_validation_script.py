"""Validate through the trainer's generation path in one or several processes, and write what each process saw.

Launched by tests/test_multiprocess_validation.py, e.g.

    torchrun --nproc_per_node 2 tests/scripts/mp_validation_script.py --model DIR --out DIR --ddp_backend gloo
    accelerate launch --config_file configs/accelerate/zero3.yaml --num_processes 2 --mixed_precision no \
        tests/scripts/mp_validation_script.py --model DIR --out DIR --ddp_backend gloo --no_cpu
    python tests/scripts/mp_validation_script.py --model DIR --out DIR   # one process

A GRPOTrainer trains one step at learning rate 0 (the weights stay the initial ones, so every run validates the
same model) with a ValidationCallback attached (validation at steps 0 and 1), then calls evaluate_with_trainer
once sampled and once greedy. Every process writes ``OUT/rank{R}.json``: its log history, the callback's history,
both direct results, its number of generation calls and the sampling settings before and after validation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from armor_trl import trl_seam  # noqa: E402
from armor_trl.evaluation import ValidationCallback, evaluate_with_trainer  # noqa: E402

NUM_PROBLEMS = 7  # odd: with 2 processes the last shard is padded
VALIDATION = dict(k=2, num_samples=4, max_new_tokens=6, top_p=0.9, batch_size=4)  # one problem per call


def has_digit(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(any(ch.isdigit() for ch in text)) for text in texts]


def sampling_settings(trainer) -> dict:
    config = trainer.generation_config
    return {"temperature": config.temperature, "top_p": config.top_p, "max_new_tokens": config.max_new_tokens,
            "do_sample": config.do_sample}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ddp_backend", default=None)
    parser.add_argument("--no_cpu", action="store_true", help="use_cpu=False (needed for DeepSpeed on a CPU host)")
    cli = parser.parse_args(argv)
    os.makedirs(cli.out, exist_ok=True)

    calls = []
    generate = trl_seam.generate

    def counting_generate(trainer, prompt_ids, num_generations):
        calls.append(len(prompt_ids))
        return generate(trainer, prompt_ids, num_generations)

    trl_seam.generate = counting_generate

    args = GRPOConfig(
        output_dir=os.path.join(cli.out, "trainer"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, temperature=0.7, max_steps=1, learning_rate=0.0, use_cpu=not cli.no_cpu,
        ddp_backend=cli.ddp_backend, bf16=False, gradient_checkpointing=False, report_to="none", logging_steps=1,
        save_strategy="no", seed=42, disable_tqdm=True,
    )  # fmt: skip
    problems = Dataset.from_dict(
        {"prompt": [f"{i}+{i + 1}=" for i in range(32)], "answer": [str(2 * i + 1) for i in range(32)]}
    )
    held_out = problems.select(range(NUM_PROBLEMS))
    trainer = GRPOTrainer(model=cli.model, reward_funcs=has_digit, args=args, train_dataset=problems)
    training_settings = sampling_settings(trainer)
    callback = ValidationCallback(held_out, has_digit, every_steps=1, temperature=1.0, seed=5,
                                  **VALIDATION).attach(trainer)
    trainer.train()
    generation_calls_in_training = len(calls)
    sampled = evaluate_with_trainer(trainer, held_out, has_digit, temperature=1.0, seed=11, **VALIDATION)
    greedy = evaluate_with_trainer(trainer, held_out, has_digit, temperature=0.0, **VALIDATION)
    result = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "deepspeed_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None,
        "sharded": any(hasattr(p, "ds_id") for p in trainer.model.parameters()),
        "on_every_process": callback.on_every_process,
        "log_history": trainer.state.log_history,
        "callback_history": callback.history,
        "sampled": sampled,
        "greedy": greedy,
        "generation_calls": calls,
        "generation_calls_in_training": generation_calls_in_training,
        "settings_before": training_settings,
        "settings_after": sampling_settings(trainer),
    }
    with open(os.path.join(cli.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    # Tear the process group down in step on both processes: left to interpreter exit, a DeepSpeed/gloo run
    # occasionally aborted one process ("terminate called without an active exception") after its work was done.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
