"""ARMOR with a real vLLM engine (colocate mode). Runs only where CUDA and vllm are installed."""

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm is not installed (it needs CUDA)")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_armor_trains_with_vllm_colocate(tiny_model_path, tiny_tokenizer, prompt_dataset, tmp_path):
    from armor_trl import ArmorConfig, ArmorGRPOTrainer
    from testing import cpu_args, digit_share_reward

    args = ArmorConfig(
        output_dir=str(tmp_path),
        **cpu_args(use_cpu=False, bf16=True, max_steps=3, anchor_reward_threshold=0.1),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.2,
    )
    trainer = ArmorGRPOTrainer(
        model=tiny_model_path, reward_funcs=digit_share_reward, args=args, train_dataset=prompt_dataset,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    found = [h["armor/anchor_found_frac"] for h in trainer.state.log_history if "armor/anchor_found_frac" in h]
    assert len(found) == 3 and max(found) > 0
