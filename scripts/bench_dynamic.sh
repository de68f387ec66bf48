#!/usr/bin/env bash
# Issue 45's comparison, one engine per call: ARMOR inside DAPO's dynamic-sampling loop against grpo_dynamic (and
# GRPO β = 0.04, armor_full and armor_lazy without the loop), the gate's paths (armor_dynamic, _eligible, _lazy) and
# anchor_filter=keep's (in-round, deferred, deferred in waves), at mixed shares 0.3 / 0.5 / 0.8 and M = 1 and 16:
# one bench run per share, each in results/bench_dynamic[_vllm]/share_<S>/ (bench.json, bench.md).
#
#   scripts/bench_dynamic.sh            # transformers generation: `make bench`
#   scripts/bench_dynamic.sh --vllm     # TRL's colocated vLLM engine on the CPU: `make bench-vllm` (needs .venv-vllm)
#   SHARES="0.5" scripts/bench_dynamic.sh --regime-reps 1   # fewer shares; further arguments go to the bench
#
# Run it on a quiet machine: the bench repeats a run when the load average exceeds the CPU count.
set -euo pipefail
cd "$(dirname "$0")/.."
target=bench
out=results/bench_dynamic
if [[ "${1:-}" == "--vllm" ]]; then
    target=bench-vllm
    out=results/bench_dynamic_vllm
    shift
fi
configs=grpo_b004,grpo_dynamic,armor_dynamic,armor_dynamic_eligible,armor_dynamic_lazy,armor_dynamic_keep
configs+=,armor_dynamic_deferred,armor_dynamic_deferred_lazy,armor_full,armor_lazy
for share in ${SHARES:-0.3 0.5 0.8}; do
    make "$target" BENCH_ARGS="--configs $configs --mini-batches 1,16 --mixed-share $share --out $out/share_$share $*"
done
