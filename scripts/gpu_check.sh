#!/usr/bin/env bash
# GPU check (needs CUDA): ARMOR vs GRPO(β=0.04) step time and peak memory on a ~0.5B local model,
# full and LoRA, bf16; the bench's gpu preset (python -m benchmarks --preset gpu: per optimizer step at M = 1, 4, 16,
# same-call and column anchors, the LoRA mixed-adapter what-if; also with --vllm where vllm is installed); then the
# vLLM test if vllm is installed, and with 3 GPUs the vLLM reference-server
# check. Results: $OUT or results/gpu_check/.
#   scripts/gpu_check.sh [--wheelhouse DIR] [--steps N] [--vllm]
# Installing: --wheelhouse DIR (or ARMOR_WHEELHOUSE=DIR) installs armor-trl and what the machine lacks from that
# folder (`make wheelhouse`, docs/gpu_study.md) with pip --no-index, for GPU machines without network. Without one,
# nothing is installed when the dependencies are importable already, else `pip install -e ".[test]"` from the
# network. Either way this checkout's armor_trl is the one that runs (PYTHONPATH). PYTHON: default python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
wheelhouse=${ARMOR_WHEELHOUSE:-}
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheelhouse)
      [ $# -ge 2 ] || { echo "gpu_check.sh: error: --wheelhouse needs a folder (make wheelhouse)" >&2; exit 2; }
      wheelhouse=$2; shift 2 ;;
    --wheelhouse=*) wheelhouse=${1#*=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
if [ -n "$wheelhouse" ]; then
  "$PYTHON" scripts/wheelhouse.py install "$wheelhouse"
elif ! "$PYTHON" scripts/wheelhouse.py missing; then
  "$PYTHON" -m pip install --quiet -e ".[test]" >/dev/null || {
    echo "gpu_check.sh: error: pip install from the network failed; on a machine without network build a wheelhouse" \
         "with \`make wheelhouse\` elsewhere, copy it with the repository and pass --wheelhouse wheelhouse" >&2; exit 1; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
HF_HUB_OFFLINE=1 "$PYTHON" scripts/gpu_check.py ${args[@]+"${args[@]}"}
# issue 20: the bench's tables (one optimizer step per rollout batch, and the paper's regime at M = 1, 4, 16) for a
# ~0.5B model on this GPU, transformers generation; with vllm installed again with TRL's colocated engine
bench_out=${OUT:-results/gpu_check}
HF_HUB_OFFLINE=1 "$PYTHON" -m benchmarks --preset gpu --out "$bench_out/bench"
if "$PYTHON" -c "import vllm" 2>/dev/null; then
  HF_HUB_OFFLINE=1 "$PYTHON" -m benchmarks --preset gpu --vllm --out "$bench_out/bench_vllm"
fi
if "$PYTHON" -c "import vllm" 2>/dev/null; then
  HF_HUB_OFFLINE=1 "$PYTHON" -m pytest -q -m gpu tests/test_vllm_gpu.py
  # vllm_reference_server_*: a second `trl vllm-serve` holds the reference (needs 3 GPUs: trainer, policy server,
  # reference server; NCCL's weight transfer cannot pair two ranks on one GPU).
  if [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -ge 3 ]; then
    HF_HUB_OFFLINE=1 "$PYTHON" scripts/gpu_check.py --reference_server ${args[@]+"${args[@]}"}
  else
    echo "fewer than 3 GPUs: skipped the reference-server check (scripts/gpu_check.py --reference_server)"
  fi
else
  echo "vllm not installed: skipped tests/test_vllm_gpu.py"
fi
