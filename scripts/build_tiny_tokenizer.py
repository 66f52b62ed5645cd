"""Rebuilds the tiny test checkpoints' tokenizer (core/src/engine/testing/tiny_tokenizer/).

A byte-level BPE with 2,048 tokens trained on the Python license text and the
Zen of Python, both shipped with CPython, so the result needs no download.
Run: python scripts/build_tiny_tokenizer.py
"""

from __future__ import annotations

import codecs
import json
import os
import sys
import this  # noqa: F401  (prints the Zen once; its text is what we train on)

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = os.path.join(os.path.dirname(__file__), "..", "core", "src", "engine", "testing", "tiny_tokenizer")


def corpus() -> list[str]:
    texts = [codecs.decode(this.s, "rot13")]
    license_path = os.path.join(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}", "LICENSE.txt")
    if os.path.exists(license_path):
        with open(license_path, encoding="utf-8") as f:
            texts.append(f.read())
    texts.append("Hello! How are you? The quick brown fox jumps over the lazy dog. 你好，世界 🎉")
    return texts


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    os.makedirs(OUT, exist_ok=True)
    tok.save(os.path.join(OUT, "tokenizer.json"))
    template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|end_of_text|>",
        "model_max_length": 2048,
        "chat_template": template,
    }
    with open(os.path.join(OUT, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    print("vocab", tok.get_vocab_size())


if __name__ == "__main__":
    main()
