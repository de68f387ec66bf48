"""How ARMOR trains at M optimizer steps per rollout batch, on the tiny CPU model (docs/configuration.md, the
`steps_per_generation` row, reports a run of it). Each optimizer step takes 8 rows (2 prompts x G = 4, one micro-batch),
a rollout batch holds M of them (steps_per_generation = M); the reward is 1.0 when the completion holds a "7" (the
random tiny model's completions do about one time in eight, so it can learn it), lr 1e-2, 48 optimizer steps.

    PYTHONPATH=. python scripts/measure_update_regime.py --m 1 4 8 --seeds 0 1 2 --output_dir /tmp/regime

Prints one JSON line per run and a table of the median [min-max] per M: seconds per optimizer step, the on-policy
reward (armor/policy_reward_mean) of the first rollout batch and of the rollout batches of the last third of the
steps, the share of tokens the mixed clip bounds, mean |r_mix - 1|, the reverse KL to the reference over the last
third of the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def has_a_seven(completions, **kwargs):
    return [float("7" in text) for text in completions]


def run(m: int, seed: int, steps: int, output_dir: str, model: str) -> dict:
    from datasets import Dataset

    from transformers import PrinterCallback

    from armor_trl import ArmorConfig, ArmorGRPOTrainer

    data = Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(64)]})
    args = ArmorConfig(output_dir=os.path.join(output_dir, f"M{m}-seed{seed}"), per_device_train_batch_size=8,
                       num_generations=4, gradient_accumulation_steps=1, steps_per_generation=m,
                       max_completion_length=8, max_steps=steps, learning_rate=1e-2, use_cpu=True,
                       gradient_checkpointing=False, report_to="none", logging_steps=1, save_strategy="no", seed=seed,
                       disable_tqdm=True, overwrite_output_dir=True)
    trainer = ArmorGRPOTrainer(model=model, reward_funcs=has_a_seven, args=args, train_dataset=data)
    trainer.remove_callback(PrinterCallback)  # one JSON line per run, not one dict per step
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]

    def series(key, after=0):
        return [entry[key] for entry in logs
                if entry["step"] > after and entry.get(key) is not None and entry[key] == entry[key]]

    reward = series("armor/policy_reward_mean")  # logged at the steps that generate: one per rollout batch
    return dict(M=m, seed=seed, s_per_step=seconds / trainer.state.global_step, reward_first_rollout=reward[0],
                reward_last_third=statistics.mean(series("armor/policy_reward_mean", after=steps * 2 // 3)),
                clip_frac=statistics.mean(series("armor/clip_low_frac")) + statistics.mean(series("armor/clip_high_frac")),
                mixed_ratio_dev=statistics.mean(series("armor/policy_abs_mixed_ratio_dev_mean")),
                kl_reverse_last_third=statistics.mean(series("armor/kl_reverse_policy", after=steps * 2 // 3)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--output_dir", default="results/update_regime")
    cli = parser.parse_args()
    import torch

    from armor_trl.app.tiny import build_tiny_model

    torch.set_num_threads(1)
    model = build_tiny_model(os.path.join(cli.output_dir, "tiny-model"))
    results = []
    for seed in cli.seeds:
        for m in cli.m:
            results.append(run(m, seed, cli.steps, cli.output_dir, model))
            print(json.dumps(results[-1]), flush=True)
    keys = ["s_per_step", "reward_first_rollout", "reward_last_third", "clip_frac", "mixed_ratio_dev",
            "kl_reverse_last_third"]
    print("| M | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for m in cli.m:
        rows = [r for r in results if r["M"] == m]
        cells = []
        for key in keys:
            values = sorted(r[key] for r in rows)
            cells.append(f"{statistics.median(values):.3g} [{values[0]:.3g}–{values[-1]:.3g}]")
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
