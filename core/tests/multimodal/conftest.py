"""A tiny random LLaVA checkpoint with its processor, built locally (no downloads).

CLIP tower: 42x42 images in 14-pixel patches (9 patches, the CLS row dropped: 9 image tokens per
image), 2 layers of width 32; Llama decoder: 2 layers, hidden 64, the repo's tiny tokenizer with
an ``<image>`` token added.
"""

from __future__ import annotations

import base64
import io
import os

import pytest

IMAGE_SIZE = 42
PATCH = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2


def make_tiny_llava(directory: str, seed: int = 0, chat_template: bool = False) -> str:
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from engine.testing.checkpoints import copy_tokenizer

    os.makedirs(directory, exist_ok=True)
    copy_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=3, tie_word_embeddings=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         image_seq_length=IMAGE_TOKENS, vision_feature_layer=-2,
                         vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # larger weights: greedy choices far from ties
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    model.save_pretrained(directory, safe_serialization=True)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>\n"
                "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}") if chat_template else None
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                               vision_feature_select_strategy="default", image_token="<image>",
                               num_additional_image_tokens=1, chat_template=template)
    processor.save_pretrained(directory)
    return directory


def png_data_url(seed: int, size: int = 30) -> str:
    """A random RGB PNG as a data: URL (not square, not the crop size: the processor resizes)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (size, size + 7, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="session")
def llava_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava(str(tmp_path_factory.mktemp("llava")))
