#!/usr/bin/env bash
# GPU check, sized for ten minutes on one GPU (the plan and its budgets: scripts/gpu_check_parts.py, which this runs):
# the offline install from a wheelhouse (with its DeepSpeed wheels where it holds them), ARMOR vs GRPO(β=0.04) at 4
# optimizer steps on a ~0.5B random-weight model (full and LoRA, bf16), ZeRO-2 / ZeRO-3 / ZeRO-3 + LoRA and FSDP2 +
# LoRA (one process) under `accelerate launch` with resets, a save and a resume, `armor-trl train` under ZeRO-2 +
# LoRA, and the M = 16 pair.
# Each part stops at its own budget; results: gpu_check.json and gpu_check.md in $OUT or results/gpu_check/.
#   scripts/gpu_check.sh [--wheelhouse DIR] [--dry_run] [--full] [--only PART ...] [--output_dir DIR]
# --wheelhouse DIR (or ARMOR_WHEELHOUSE=DIR): `make wheelhouse` (WHEELHOUSE_DEEPSPEED=1 for the DeepSpeed parts),
# installed with pip --no-index, for GPU machines without network (docs/gpu_study.md). Without one, every module
# must be importable already. --dry_run prints the plan and its budgets (no GPU needed); --full adds the bench's
# whole gpu preset (hours), the vLLM GPU test where vllm is installed and, with 3 GPUs, the reference-server check.
# This checkout's armor_trl is the one that runs (PYTHONPATH). PYTHON: default python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" scripts/gpu_check_parts.py "$@"
