"""A tiny Llama-type model and a character-level tokenizer, built locally with no hub access.

Tests, the offline demo and the benchmark all use it: it is small enough to train on two CPU cores
in seconds, and it is saved with ``save_pretrained`` so every code path that loads a model from a
path (the policy, the reference, a resumed checkpoint) is exercised exactly as with a hub model.
"""

from __future__ import annotations

import os
import string

CHARS = string.digits + string.ascii_letters + " +-*/=()?.,:#\n"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'][0] }}:{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` with pad/bos/eos and a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(path: str | os.PathLike, hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> str:
    """Write a randomly initialised tiny Llama model and its tokenizer to ``path``; return the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.fspath(path)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
