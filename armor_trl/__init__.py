"""armor-trl: ARMOR (Anchor Rollout and Mixed Optimization) for Hugging Face TRL."""

from .config import ArmorConfig
from .mixed_ratio import mixed_logprobs, mixed_ratio, trust_region_bounds
from .trainer import ArmorGRPOTrainer

__version__ = "0.1.0"
__all__ = ["ArmorConfig", "ArmorGRPOTrainer", "mixed_logprobs", "mixed_ratio", "trust_region_bounds"]
