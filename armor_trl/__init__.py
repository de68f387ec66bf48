"""armor-trl: ARMOR (Anchor Rollout and Mixed Optimization) for Hugging Face TRL.

The public names are imported on first use, so that ``import armor_trl.rewards`` (used in verifier worker
processes) does not pull in torch, transformers and TRL. No public name may equal a submodule's name: importing
the submodule would replace the package attribute (hence the math lives in ``mixture``, not ``mixed_ratio``).
"""

import logging
import sys
from importlib import import_module

from ._moved import MovedModules


class _NoCpuAcceleratorNotice(logging.Filter):
    """DeepSpeed logs "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    when it is imported on a machine without a GPU; accelerate and transformers import it wherever it is installed
    (the ``deepspeed`` extra), so every CPU run printed it. Dropped here; its other messages pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Setting accelerator to CPU")


logging.getLogger("DeepSpeed").addFilter(_NoCpuAcceleratorNotice())  # the logger deepspeed.utils.logger creates

if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
    # first: under a moved package (armor_trl.experiments.stats) the path finder would load a second copy
    sys.meta_path.insert(0, MovedModules(__name__))  # the flat layout's import paths (armor_trl.mixture, ...)

__version__ = "0.1.0"
_PUBLIC = {
    "ArmorConfig": ".config",
    "ArmorGRPOTrainer": ".trainer",
    "generate_completions": ".rollout.rollout_func",
    "mixed_logprobs": ".algorithm.mixture",
    "mixed_ratio": ".algorithm.mixture",
    "trust_region_bounds": ".algorithm.mixture",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_PUBLIC))
