"""The ARMOR math, readable next to the paper (arXiv 2607.10481) and docs/algorithm.md: pure tensor functions.

- ``mixture``: mixed log-probs log(α·π_θ + (1−α)·π_ref), the mixed ratio r_mix and its trust-region bounds (Eq. 2–4).
- ``advantages``: group baselines, group totals and QAE.
- ``loss_rows``: which rows enter TRL's loss and how they are weighted.
"""
