"""Parameters that live in shards across processes: DeepSpeed ZeRO-3's partitions and FSDP2's DTensors.

π_ref's copies, comparisons, saves and loads (:mod:`.policy`) go through these, so that one code path serves one
process, DDP, ZeRO-3 and FSDP2.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def gathered(params: list[nn.Parameter], modifier_rank: int | None = None):
    """Gather DeepSpeed ZeRO-3 partitioned parameters for the block (a no-op for ordinary tensors)."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)
    return contextlib.nullcontext()


# FSDP2 (``fully_shard``) keeps each parameter as a DTensor holding this process's shard. The policy is sharded only
# when training starts (accelerate prepares it in train()), π_ref already when it is built, so a copy or comparison
# may meet a DTensor on one side and a plain tensor on the other, which torch refuses. The helpers below make both
# sides alike; those that gather or scatter are collective: every process calls them, in the same order.
def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 shard gathered (collective), anything else as it is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def assign(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` for any mix of FSDP2 shards and plain tensors (collective when they differ)."""
    if is_sharded(target) and not is_sharded(source):
        from torch.distributed.tensor import distribute_tensor

        source = distribute_tensor(source.to(target.device, target.dtype), target.device_mesh, target.placements)
    elif is_sharded(source) and not is_sharded(target):
        source = source.full_tensor()
    target.copy_(source)
