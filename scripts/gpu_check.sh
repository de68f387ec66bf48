#!/usr/bin/env bash
# GPU check (needs CUDA): ARMOR vs GRPO(β=0.04) step time and peak memory on a ~0.5B local model,
# full and LoRA, bf16; then the vLLM test if vllm is installed. Results: $OUT or results/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
pip install --quiet -e ".[test]" >/dev/null
HF_HUB_OFFLINE=1 python scripts/gpu_check.py "$@"
if python -c "import vllm" 2>/dev/null; then
  HF_HUB_OFFLINE=1 python -m pytest -q -m gpu tests/test_vllm_gpu.py
else
  echo "vllm not installed: skipped tests/test_vllm_gpu.py"
fi
