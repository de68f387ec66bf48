"""The reference policy π_ref: build (a copy, a LoRA adapter, an instance), reset on schedule, save and restore
(``policy``); its weights pushed into a colocated vLLM engine for the anchor candidates (``vllm_swap``); a second vLLM
server holding π_ref (``vllm_server``)."""

from armor_trl.reference.policy import (ReferencePolicy, ReferenceResetCallback, build_reference,
                                        copy_model_for_reference, reset_due)

__all__ = ["ReferencePolicy", "ReferenceResetCallback", "build_reference", "copy_model_for_reference", "reset_due"]
