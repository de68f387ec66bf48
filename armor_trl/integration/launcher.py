"""``use_cpu`` against the launcher: a recipe that says ``use_cpu: true`` started by ``accelerate launch`` on GPUs.

Under DeepSpeed or FSDP the engine moves the model to the GPU while transformers, told ``use_cpu``, keeps TRL's
inputs on the CPU: the run crashes deep in the first forward ("Expected all tensors to be on the same device, but got
index is on cpu, different from other tensors on cuda:0"). Under plain DDP it trains one CPU process per GPU while
the GPUs idle. :func:`check_use_cpu` refuses the first (the CLI at parse time, ArmorGRPOTrainer at construction)
and warns about the second, naming the fix: ``--use_cpu false`` (``use_cpu=False``), or a recipe without ``use_cpu``.
"""

from __future__ import annotations

import os

from transformers.utils import logging, strtobool

logger = logging.get_logger(__name__)

FIX = "Set use_cpu=False (--use_cpu false), or leave use_cpu out of the recipe: it trains on the GPUs then."


def _flag(name: str) -> bool:
    return bool(strtobool(os.environ.get(name, "False")))


def launcher_engine(args) -> str | None:
    """The distributed engine this process was started under: "DeepSpeed", "FSDP" (the training arguments' own
    ``deepspeed`` / ``fsdp``, or ``accelerate launch``'s config), "DDP" (several processes, neither of those), or None
    (one process)."""
    if getattr(args, "deepspeed", None) or _flag("ACCELERATE_USE_DEEPSPEED"):
        return "DeepSpeed"
    if getattr(args, "fsdp", None) or _flag("ACCELERATE_USE_FSDP"):
        return "FSDP"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "DDP"
    return None


def check_use_cpu(args) -> None:
    """Refuse ``use_cpu`` under DeepSpeed or FSDP on a machine with a CUDA GPU (a ``ValueError`` naming the fix); under
    DDP there, warn that the GPUs idle. Nothing without ``use_cpu``, without a GPU, or in one process."""
    import torch

    if not getattr(args, "use_cpu", False) or not torch.cuda.is_available():
        return
    engine = launcher_engine(args)
    if engine in ("DeepSpeed", "FSDP"):
        raise ValueError(
            f"use_cpu=True under {engine} on a machine with a GPU: {engine} moves the model to the GPU while the "
            "inputs stay on the CPU, and the first forward fails ('Expected all tensors to be on the same device'). "
            + FIX
        )
    if engine == "DDP":
        logger.warning(f"use_cpu=True with {os.environ.get('WORLD_SIZE')} processes on a machine with a GPU: each "
                       f"process trains on the CPU while the GPUs idle. {FIX}")
