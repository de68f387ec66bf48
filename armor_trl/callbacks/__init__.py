"""Trainer callbacks: validation (avg@k, pass@k, solution modes) and the collapse guard."""
