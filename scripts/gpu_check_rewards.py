"""A reward a random-weight model can satisfy, for the GPU check's CLI part (``--reward_funcs
gpu_check_rewards:has_digit``, with scripts/ on PYTHONPATH): 1.0 for a completion holding a digit, else 0.0. The
model samples characters at random, so some candidates of every group pass and some fail: anchors are found and the
check for rewards that cannot say "incorrect" stays quiet. Standard library only."""


def has_digit(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(any(ch.isdigit() for ch in text)) for text in texts]
