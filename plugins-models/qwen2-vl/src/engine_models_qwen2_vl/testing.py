"""Tiny Qwen2-VL checkpoints for tests, and the processor files that make a config-only directory
servable (``--load-format dummy``, e.g. ``docs/bench_configs/qwen2-vl-7b``)."""

from __future__ import annotations

import json
import os
from typing import Any

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen2-VL's chat template: each image or video part becomes its placeholder between the vision tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Tiny shapes: a 2-layer decoder of width 64 (16-wide heads: 8 rotated pairs in M-RoPE sections
# 2/3/3) and a 2-block tower on 4x4-pixel patches.
TINY_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=0, eos_token_id=3,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
TINY_VISION = {
    "Qwen2VLForConditionalGeneration": dict(depth=2, embed_dim=32, num_heads=2, hidden_size=64, patch_size=4),
    # windows of 2x2 merged tokens; block 1 attends to whole frames
    "Qwen2_5_VLForConditionalGeneration": dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                                               patch_size=4, window_size=16, out_hidden_size=64,
                                               fullatt_block_indexes=[1], tokens_per_second=2),
}


def write_processor_files(directory: str, patch_size: int | None = None, min_pixels: int | None = None,
                          max_pixels: int | None = None) -> Any:
    """The test tokenizer with the vision tokens and chat template, and ``preprocessor_config.json``
    (patch size and pixel limits default to the directory's config.json, else 14 and 56x56 to
    448x448 pixels). Returns the tokenizer."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from engine.testing.checkpoints import copy_tokenizer

    if patch_size is None:
        try:
            with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
                patch_size = int(json.load(f)["vision_config"]["patch_size"])
        except (OSError, KeyError, ValueError):
            patch_size = 14
    factor = 2 * patch_size  # one merged token
    copy_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels or (2 * factor) ** 2, max_pixels=max_pixels or (16 * factor) ** 2,
                             patch_size=patch_size, merge_size=2, temporal_patch_size=2).save_pretrained(directory)
    return tokenizer


def make_tiny_checkpoint(directory: str, architecture: str = "Qwen2VLForConditionalGeneration",
                         seed: int = 0) -> str:
    """A random tiny Qwen2-VL or Qwen2.5-VL checkpoint with its processor files (images of 8x8 to
    32x32 pixels: 1 to 16 tokens)."""
    import torch
    import transformers

    os.makedirs(directory, exist_ok=True)
    tokenizer = write_processor_files(directory, patch_size=4, min_pixels=64, max_pixels=32 * 32)
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    config_cls = getattr(transformers, architecture.replace("ForConditionalGeneration", "Config"))
    config = config_cls(text_config={**TINY_TEXT, "vocab_size": len(tokenizer)}, vision_config=TINY_VISION[architecture],
                        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image,
                        video_token_id=video)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)  # logits far from ties, so greedy choices are stable
    model.save_pretrained(directory)
    return directory
