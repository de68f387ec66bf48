"""What the bench trains: the task, the reward, the tiny model, the pre-generated anchors and one trainer per
variant. The functions taking a ``settings`` dict run in worker processes."""

from __future__ import annotations

import contextlib

import os
import random

from benchmarks.config import BenchConfig, Variant


def make_prompts(n: int, seed: int, mixed_share: float | None = None) -> list[dict]:
    """``n`` arithmetic prompts. With ``mixed_share`` every prompt also gets a ``settled`` column: None for the first
    round(share × n) prompts of a seeded shuffle ("live": the 0/1 reward depends on the completion), else 1.0 or 0.0
    (alternately): the 0/1 reward of every completion of that prompt, so its group is all correct or all wrong and
    dynamic sampling drops it whatever its anchor (the workload knob for the share of groups with mixed outcomes)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    if mixed_share is not None:
        order = list(range(n))
        random.Random(seed + 7).shuffle(order)
        live = round(mixed_share * n)
        for position, index in enumerate(order):
            rows[index]["settled"] = None if position < live else float((position - live) % 2)
    return rows


def digit_reward(completions, **kwargs):
    """Graded arithmetic-style reward: the share of digits in the completion (an answer should be a number).

    With ``anchor_reward_threshold`` calibrated on the initial model (see ``build_and_calibrate``), a realistic share of
    reference candidates counts as verified, and rewards within a group almost never tie.
    """
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def reward_for(variant: Variant, threshold: float):
    """The variant's reward function: the digit share, or (digit_01) that share thresholded to 0/1 so that groups can
    tie (all right / all wrong) as with a verifier."""
    if variant.reward == "digit":
        return digit_reward

    def digit_reward_01(completions, settled=None, **kwargs):
        rewards = [float(r >= threshold) for r in digit_reward(completions)]
        if settled is None:  # no mixed_share knob: every prompt is live
            return rewards
        return [r if fixed is None else fixed for r, fixed in zip(rewards, settled)]

    return digit_reward_01


def quiet(log_path: str | None, threads: int) -> None:
    """Worker set-up: output to ``log_path``, ``threads`` torch threads, no progress bars or warnings."""
    import logging
    import warnings

    import datasets
    import torch
    import transformers

    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore")
    logging.getLogger("accelerate").setLevel(logging.ERROR)


def build_model(settings: dict) -> str:
    """Write the bench's model with random weights: armor_trl.app.tiny's Llama, or (arch qwen2) a Qwen2 with
    Qwen2.5-0.5B's proportions at ``hidden`` x ``layers`` (896 x 24: its shapes, ~0.5B parameters)."""
    import torch

    from armor_trl.app.tiny import build_tiny_model, build_tokenizer

    if settings.get("arch", "llama") == "llama":
        return build_tiny_model(settings["model_dir"], hidden_size=settings["hidden"], num_layers=settings["layers"],
                                seed=settings["seed"])
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer, hidden = build_tokenizer(), settings["hidden"]
    heads = max(1, hidden // 64)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 4864 // 896,
        num_hidden_layers=settings["layers"], num_attention_heads=heads, num_key_value_heads=max(1, heads // 7),
        max_position_embeddings=2048, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(settings["seed"])
    Qwen2ForCausalLM(config).save_pretrained(settings["model_dir"])
    tokenizer.save_pretrained(settings["model_dir"])
    return settings["model_dir"]


def build_and_calibrate(settings: dict) -> dict:
    """Worker task: write the tiny model and pick ``anchor_reward_threshold`` on the initial model.

    The threshold is chosen so that about ``target_found`` of the groups have at least one of K reference
    candidates at or above it (sampled as TRL samples: temperature 1, no top-k/top-p).
    """
    quiet(settings.get("log"), settings["threads"])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_model(settings)
    device = settings.get("device", "cpu")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    k, draws = settings["k"], settings["calibration_draws"]
    prompts = [row["prompt"] for row in make_prompts(settings["prompts"], settings["seed"])]
    group_max = []
    torch.manual_seed(settings["seed"] + 1)
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]] * (k * draws), device=device)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=settings["completion"], pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        texts = tokenizer.batch_decode(out[:, ids.size(1):], skip_special_tokens=True)
        rewards = digit_reward(texts)
        group_max += [max(rewards[d * k : (d + 1) * k]) for d in range(draws)]
    group_max.sort()
    # threshold = the (1 - target_found) quantile of the per-group best candidate reward
    index = min(len(group_max) - 1, max(0, int(round((1 - settings["target_found"]) * len(group_max)))))
    threshold = group_max[index]
    found = sum(v >= threshold for v in group_max) / len(group_max)
    return {"model_path": path, "threshold": threshold, "calibration_found_frac": found, "groups": len(group_max)}


def pregenerate_anchors(settings: dict) -> dict:
    """Worker task: ``armor-trl anchors``' code on the bench prompts (the bulk pass column variants train on)."""
    quiet(settings.get("log"), settings["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer

    from armor_trl.data.pregenerate import AnchorSettings, TransformersSampler, finalize, generate_shards, prepare_output

    anchor_settings = AnchorSettings(
        reference=settings["model_path"], num_candidates=2 * settings["k"], max_anchors_per_prompt=settings["k"],
        threshold=settings["threshold"], reward_funcs=["digit_reward"], max_completion_length=settings["completion"],
        seed=settings["seed"], shard_size=settings["prompts"],
    )
    tokenizer = AutoTokenizer.from_pretrained(settings["model_path"])
    dataset = Dataset.from_list(make_prompts(settings["prompts"], settings["seed"]))
    prepare_output(settings["output"], anchor_settings, is_main=True)
    sampler = TransformersSampler(settings["model_path"], anchor_settings, tokenizer, settings.get("device", "cpu"),
                                  batch_size=settings["prompts"])
    counts = generate_shards(dataset, anchor_settings, [digit_reward], tokenizer, sampler, settings["output"], progress=False)
    metadata = finalize(settings["output"], anchor_settings, len(dataset), counts["prompts"] / counts["seconds"])
    return {"path": settings["output"], "seconds": counts["seconds"], "prompts": counts["prompts"],
            "prompts_per_s": metadata["prompts_per_second"], "share_with_anchor": metadata["share_with_anchor"],
            "num_candidates": anchor_settings.num_candidates}


# The tool workload (variants with tools: true): the tiny tool agent of armor_trl.app.tool_testbed at the bench's shape,
# warm-started once per bench (TOOL_WARM_STEPS supervised steps) beside the bench's model, so that it calls add(a, b)
# through TRL's loop; each trajectory is a tool call, its result and an answer, TOOL_COMPLETION tokens at most.
TOOL_WARM_STEPS = 150
TOOL_COMPLETION = 160
TOOL_ITERATIONS = 2


def tool_functions(variant: Variant) -> list | None:
    from armor_trl.app.tool_testbed import TOOLS

    return [TOOLS["add"]] if variant.tools else None


def tool_agent(task: dict) -> str:
    """The bench's tool agent, written next to its model the first time a tools variant needs it (the runs are one
    after another), then reused."""
    from armor_trl.app.tool_testbed import build_tool_agent

    path = task["model_path"].rstrip("/") + "-tool-agent"
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_tool_agent(path + ".tmp", steps=TOOL_WARM_STEPS, seed=task["seed"], hidden_size=task["hidden"],
                         num_layers=task["layers"], threads=task["threads"])
        os.replace(path + ".tmp", path)
    return path


def build_trainer(task: dict, variant: Variant, bench: BenchConfig):
    """The variant's trainer on the tiny model (not yet trained), with the console callbacks removed, and the
    seconds its constructor took."""
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from armor_trl import ArmorConfig, ArmorGRPOTrainer
    from armor_trl.integration import vllm_engine

    torch.manual_seed(task["seed"])
    common = dict(
        bench.training, **task.get("training", {}), output_dir=task["output_dir"], per_device_train_batch_size=task["batch"],
        num_generations=task["g"], max_completion_length=task["completion"], max_steps=task["steps"],
        learning_rate=task["lr_lora"] if variant.lora else task["lr"], beta=variant.beta, seed=task["seed"],
    )
    if "mini_batches" in task:  # a regime run: M optimizer steps per rollout batch
        common["steps_per_generation"] = task["mini_batches"]
    model_path = task["model_path"]
    if variant.tools:
        model_path = tool_agent(task)
        common.update(max_completion_length=max(task["completion"], TOOL_COMPLETION),
                      max_tool_calling_iterations=TOOL_ITERATIONS)
    if variant.trainer == "armor_trl":
        args = ArmorConfig(
            **common, anchor_num_samples=task["k"], anchor_reward_threshold=task["threshold"],
            use_anchors=variant.armor, use_mixed_ratio=variant.armor, **variant.args,
        )
    else:
        args = GRPOConfig(**common)
    peft_config = None
    if variant.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(**bench.lora)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    mixed_share = task.get("mixed_share") if variant.reward == "digit_01" else None
    rows = make_prompts(task["prompts"], task["seed"], mixed_share)
    if variant.tools:  # TRL's tool loop takes chat prompts
        rows = [{**row, "prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows]
    dataset = Dataset.from_list(rows)
    if variant.column:
        from armor_trl.data.pregenerate import attach_anchors

        dataset = attach_anchors(dataset, task["anchors_path"])
    cls = ArmorGRPOTrainer if variant.trainer == "armor_trl" else GRPOTrainer
    reward = reward_for(variant, task["threshold"])
    start = time.perf_counter()
    # TRL's colocated engine as ArmorGRPOTrainer builds it (on a CPU: linear weights TRL's sync can reach), for both
    with vllm_engine.colocated_engine_built(args) if cls is GRPOTrainer else contextlib.nullcontext():
        trainer = cls(
            model=model_path, reward_funcs=reward, args=args, train_dataset=dataset,
            processing_class=tokenizer, peft_config=peft_config, tools=tool_functions(variant),
        )
    build_s = time.perf_counter() - start
    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)
    return trainer, build_s
