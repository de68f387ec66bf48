#!/usr/bin/env bash
# ARMOR inside DAPO's dynamic-sampling loop against grpo_dynamic and ARMOR's floor, one engine per call: GRPO β 0.04,
# grpo_dynamic, the default (the authors' gate, candidates for eligible groups), anchor_filter=keep with deferred
# candidates, lazy waves in the loop and out of it, armor_full; M = 1 and 16, 3 repetitions, the regime runs only, at
# mixed share 0.5 (SHARES="0.3 0.5 0.8" for more): one bench run per share in results/bench_dynamic[_vllm]/share_<S>/.
#
#   scripts/bench_dynamic.sh            # transformers generation: `make bench` (about 6-8 minutes on 2 quiet cores)
#   scripts/bench_dynamic.sh --vllm     # TRL's colocated vLLM engine on the CPU: `make bench-vllm` (needs .venv-vllm;
#                                       # about 30-45 minutes a share (7 variants): every run starts a compiled engine). At share
#                                       # 0.5 `make bench-dynamic-vllm` measures its table (6 variants) and writes it
#   SHARES="0.3 0.5" scripts/bench_dynamic.sh --regime-reps 2   # further arguments go to the bench
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
configs=grpo_b004,grpo_dynamic,armor_dynamic_eligible,armor_dynamic_deferred,armor_dynamic_lazy,armor_full,armor_lazy
for share in ${SHARES:-0.5}; do
    make "$target" BENCH_ARGS="--configs $configs --mini-batches 1,16 --regime-reps 3 --no-main --mixed-share $share --out $out/share_$share $*"
done
