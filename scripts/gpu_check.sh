#!/usr/bin/env bash
# GPU check (needs CUDA): ARMOR vs GRPO(β=0.04) step time and peak memory on a ~0.5B local model,
# full and LoRA, bf16; then the vLLM test if vllm is installed, and with 3 GPUs the vLLM reference-server
# check. Results: $OUT or results/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
pip install --quiet -e ".[test]" >/dev/null
HF_HUB_OFFLINE=1 python scripts/gpu_check.py "$@"
if python -c "import vllm" 2>/dev/null; then
  HF_HUB_OFFLINE=1 python -m pytest -q -m gpu tests/test_vllm_gpu.py
  # vllm_reference_server_*: a second `trl vllm-serve` holds the reference (needs 3 GPUs: trainer, policy server,
  # reference server; NCCL's weight transfer cannot pair two ranks on one GPU).
  if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 3 ]; then
    HF_HUB_OFFLINE=1 python scripts/gpu_check.py --reference_server "$@"
  else
    echo "fewer than 3 GPUs: skipped the reference-server check (scripts/gpu_check.py --reference_server)"
  fi
else
  echo "vllm not installed: skipped tests/test_vllm_gpu.py"
fi
