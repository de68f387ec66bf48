"""Where armor-trl meets TRL, transformers and accelerate: the TRL seam (every private name used anywhere, with its
surface test), checkpoint state and fingerprint, construction checks, launcher checks and the ``armor/*`` metrics."""
