"""Where armor-trl meets TRL, transformers and accelerate: the TRL seam (every private name used anywhere, with its
surface test: ``trl_seam``, and ``vllm_engine`` for TRL's vLLM engine), checkpoint state and fingerprint, construction
checks, launcher checks and the ``armor/*`` metrics."""
