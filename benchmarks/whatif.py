"""Measurements after training, on the trained instance: what would another generation layout cost?"""

from __future__ import annotations

import statistics
import time


def _policy(trainer):
    return trainer.accelerator.unwrap_model(trainer.model_wrapped)


def _prompt_ids(trainer, rows: int):
    import torch

    return torch.tensor([trainer.processing_class("12+34=")["input_ids"]] * rows, device=_policy(trainer).device)


def generate_rows(trainer, rows_list: list[int], repeats: int) -> dict:
    """Generate time vs batch rows (full length) with the policy: is generation latency- or throughput-bound here?"""
    import torch

    model, tok = _policy(trainer), trainer.processing_class
    length = trainer.max_completion_length
    was_training = model.training
    model.eval()
    times = {}
    with torch.no_grad():
        for rows in rows_list:
            ids = _prompt_ids(trainer, rows)
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                    top_p=1.0, max_new_tokens=length, min_new_tokens=length, pad_token_id=tok.pad_token_id,
                )
                samples.append(time.perf_counter() - start)
            times[str(rows)] = statistics.median(samples)
    model.train(was_training)
    return times


def merged_generation(trainer, policy_rows: int, anchor_rows: int, repeats: int) -> dict:
    """LoRA only: two generate calls (policy rows, then reference rows) vs ONE mixed-adapter call (PEFT adapter_names).

    Quantifies the fix suggested for the anchor generation cost: the LoRA reference is a second adapter of the same
    model, so candidates can be sampled in the same batch as the on-policy completions.
    """
    import torch

    from armor_trl.reference.policy import REF_ADAPTER

    model, tok = _policy(trainer), trainer.processing_class
    gen = dict(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=trainer.max_completion_length,
        min_new_tokens=trainer.max_completion_length, pad_token_id=tok.pad_token_id,
    )
    trained = trainer.reference.trained_adapter
    was_training = model.training
    model.eval()
    ids_p, ids_a = _prompt_ids(trainer, policy_rows), _prompt_ids(trainer, anchor_rows)
    ids_m = _prompt_ids(trainer, policy_rows + anchor_rows)
    names = [trained] * policy_rows + [REF_ADAPTER] * anchor_rows
    separate, merged = [], []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(input_ids=ids_p, attention_mask=torch.ones_like(ids_p), **gen)
            model.set_adapter(REF_ADAPTER)
            model.generate(input_ids=ids_a, attention_mask=torch.ones_like(ids_a), **gen)
            model.set_adapter(trained)
            separate.append(time.perf_counter() - start)
            start = time.perf_counter()
            model.generate(input_ids=ids_m, attention_mask=torch.ones_like(ids_m), adapter_names=names, **gen)
            merged.append(time.perf_counter() - start)
    for name, param in model.named_parameters():  # set_adapter may flip requires_grad; restore ARMOR's state
        param.requires_grad_(f".{trained}." in name)
    model.train(was_training)
    return {"separate_s": statistics.median(separate), "merged_s": statistics.median(merged),
            "rows": [policy_rows, anchor_rows]}
