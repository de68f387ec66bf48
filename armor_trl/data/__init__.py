"""RLVR datasets (GSM8K, MATH, DAPO-Math, AIME, the arithmetic testbed) and pre-generated anchor sets."""
