"""Train TRL's plain GRPOTrainer (no ARMOR) on the tiny model for a few steps in several processes and write what
happened: the check that a launch harness really trains TRL's trainer before ARMOR is tried under it (launched by
tests/test_multiprocess_fsdp.py).

    accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 --mixed_precision no \
        tests/scripts/fsdp_on_cpu.py tests/scripts/mp_grpo_script.py --model DIR --out DIR --ddp_backend gloo
    torchrun --nproc_per_node 2 tests/scripts/mp_grpo_script.py --model DIR --out DIR --ddp_backend gloo

Every process writes ``OUT/rank{R}.json``: its distributed type, whether the policy's parameters are sharded
(DTensors), checksums of the initial and final full parameters (shards gathered) and the log history.
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
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]  # the repository root, tests/

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from mp_train_script import checksum, full_params, is_sharded  # noqa: E402
from testing import cpu_args, end_launch, has_digit_reward  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ddp_backend", default=None)
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    args = GRPOConfig(output_dir=os.path.join(cli.out, "trainer"), ddp_backend=cli.ddp_backend, **cpu_args())
    dataset = Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(32)]})
    trainer = GRPOTrainer(model=cli.model, reward_funcs=has_digit_reward, args=args, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(cli.model))
    initial = checksum(full_params(trainer.model))
    trainer.train()
    record = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "policy_sharded": is_sharded(trainer.model_wrapped),
        "initial_checksum": initial,
        "final_checksum": checksum(full_params(trainer.model)),
        "log_history": trainer.state.log_history,
    }
    with open(os.path.join(cli.out, f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)
    end_launch(trainer)


if __name__ == "__main__":
    main()
