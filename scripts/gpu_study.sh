#!/usr/bin/env bash
# The GPU study (docs/gpu_study.md): grpo, grpo_small_lr, grpo_kl_0.04 and armor x 2 seeds on a local ~0.5B instruct
# model and local GSM8K files, one GPU, no network, no vLLM; ~8 min on one H200 (estimated, not measured).
#   scripts/gpu_study.sh --model DIR --train FILE --test FILE [--wheelhouse DIR] [--output_dir DIR] [--seeds N] [--dry_run]
# Everything is in scripts/gpu_study.py (--help); PYTHON picks the interpreter (default python3, the one with torch).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_study.py "$@"
