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


def build_tokenizer(chars: str = CHARS):
    """A character-level ``PreTrainedTokenizerFast`` with pad/bos/eos and a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(chars))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(path: str | os.PathLike, hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                     tools: bool = False) -> str:
    """Write a randomly initialised tiny Llama model and its tokenizer to ``path``; return the path. ``tools``: with
    :func:`build_tool_tokenizer` (tool calls in its chat template, parsed back by its response template)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.fspath(path)
    tokenizer = build_tool_tokenizer() if tools else build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512 if tools else 256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    return _save_initialised(LlamaForCausalLM, config, tokenizer, path, seed)


# --- tool calling -----------------------------------------------------------------------------------------------------
TOOL_CHARS = CHARS + '{}[]"_<>!'
# Qwen-like: a tool call is <tool_call>{"name": ..., "arguments": {...}}</tool_call> in the assistant's turn, which ends
# in eos (TRL cuts the tool-result suffix it builds at the last eos); a tool result is a "t:" line.
# Content is text or a list of parts (a vision-language model's prompts and tool results: images as Qwen2-VL's tokens).
TOOL_CHAT_TEMPLATE = (
    "{% macro render(content) %}{% if content is string %}{{ content }}{% else %}{% for part in content %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}a:{{ render(message['content']) }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}</s>\n"
    "{% elif message['role'] == 'tool' %}t:{{ render(message['content']) }}\n"
    "{% else %}{{ message['role'][0] }}:{{ render(message['content']) }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
# transformers' response template for it (parse_response): tool calls as JSON between the tags, then text up to eos
TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "a:",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"</s>\s*", "content": "text"},
    },
}


def build_tool_tokenizer():
    """The character-level tokenizer with JSON's characters, a chat template that renders tool calls and tool results
    (TRL's ``supports_tool_calling`` accepts it) and a ``response_template`` that parses them back (TRL's tool loop)."""
    tokenizer = build_tokenizer(TOOL_CHARS)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    return tokenizer


# --- a tiny vision-language model (Qwen2-VL shapes) --------------------------------------------------------------------
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'][0] }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def build_vlm_tokenizer(tools: bool = False):
    """The character-level tokenizer with Qwen2-VL's vision tokens and a chat template that renders image parts
    (``tools``: :func:`build_tool_tokenizer`'s, with them)."""
    tokenizer = build_tool_tokenizer() if tools else build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    if not tools:
        tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def build_tiny_vlm_processor(min_pixels: int = 28 * 28 * 4, max_pixels: int = 28 * 28 * 16, tools: bool = False):
    """A Qwen2-VL processor for images only (Qwen2-VL's image processor, PIL backend, and :func:`build_vlm_tokenizer`),
    built locally: Qwen2-VL's own processor also wants a video processor, which needs torchvision. Images are resized
    to ``min_pixels`` .. ``max_pixels`` (a 56×56 image: 16 patches, 4 image tokens)."""
    from transformers import ProcessorMixin, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageQwen2VLProcessor(Qwen2VLProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = build_vlm_tokenizer(tools)
    tokenizer.padding_side = "left"  # as GRPOTrainer loads a processor: prompts are left-padded
    image_processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    return ImageQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 chat_template=tokenizer.chat_template)


def build_tiny_vlm(path: str | os.PathLike, seed: int = 0, tools: bool = False) -> str:
    """Write a randomly initialised tiny Qwen2-VL model (a 1-layer vision tower, a 2-layer language model) to
    ``path``; return the path. Its processor: :func:`build_tiny_vlm_processor` (with the same ``tools``)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    path = os.fspath(path)
    tokenizer = build_vlm_tokenizer(tools)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, tie_word_embeddings=True,
                         **special),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, **special,
    )
    return _save_initialised(Qwen2VLForConditionalGeneration, config, tokenizer, path, seed)


def _save_initialised(model_class, config, tokenizer, path: str, seed: int) -> str:
    """A randomly initialised ``model_class(config)`` (seeded), generating with the tokenizer's pad and eos tokens,
    saved with the tokenizer (or processor) in ``path``."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
