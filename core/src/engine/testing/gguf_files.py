"""Tiny GGUF files written the way llama.cpp's converter writes them, for tests (no downloads).

``write_tiny_gguf`` takes a tiny transformers model (``checkpoints.make_tiny_checkpoint``), applies
llama.cpp's Q/K row permutation (Llama only, as ``convert_hf_to_gguf.py`` does), stores every 2-D
weight in the requested GGML type and 1-D ones in F32, and writes the tiny tokenizer's BPE into
the metadata with a ChatML template. Types ``gguf.quants.quantize`` can make are quantized from
the model's weights; the K-quants (which it cannot make) are random but well-formed blocks. It
returns what a correct loader must produce for each Hugging Face parameter, computed here
independently of the engine: the ``gguf`` package's dequantization with the permutation inverted.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


_TOKENIZER_DIR = os.path.join(os.path.dirname(__file__), "tiny_tokenizer")
# GGUF architecture name of each transformers architecture these fixtures cover.
GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Byte offset of the float16 super-block scale(s) in each K-quant block (ggml-common.h layouts);
# the rest of a block is free bits. Q6_K's 16 sub-block scales are int8, kept small.
_K_SCALES = {"Q2_K": (80, 84), "Q3_K": (108, 110), "Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210)}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row order llama.cpp stores Llama's q_proj/k_proj in (rotary halves interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    order = llama_cpp_permute(np.arange(w.shape[0]), n_head)  # stored row i holds source row order[i]
    out = np.empty_like(w)
    out[order] = w
    return out


def _random_k_blocks(shape: tuple[int, ...], qtype: Any, rng: np.random.Generator) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES

    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_elems
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    lo, hi = _K_SCALES[qtype.name]
    scales = rng.uniform(2e-3, 6e-3, size=(n_blocks, (hi - lo) // 2)).astype(np.float16)
    blocks[:, lo:hi] = scales.view(np.uint8)
    if qtype.name == "Q6_K":  # int8 sub-block scales at bytes 192..208: |scale| <= 8
        blocks[:, 192:208] = rng.integers(-8, 9, size=(n_blocks, 16)).astype(np.int8).view(np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // block_elems * block_bytes)


def _stored(w: np.ndarray, qtype: Any, rng: np.random.Generator) -> np.ndarray:
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    if qtype == T.F32:
        return w.astype(np.float32)
    if qtype == T.F16:
        return w.astype(np.float16)
    if qtype.name in _K_SCALES:
        return _random_k_blocks(w.shape, qtype, rng)
    try:
        return quants.quantize(w.astype(np.float32), qtype)
    except NotImplementedError:  # a type gguf cannot make (e.g. Q8_1): random bytes, for error tests
        from gguf import GGML_QUANT_SIZES

        elems, nbytes = GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, size=(w.shape[0], w.shape[1] // elems * nbytes), dtype=np.uint8)


def _write_tokenizer(writer: Any) -> None:
    with open(os.path.join(_TOKENIZER_DIR, "tokenizer.json")) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3 = control
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(3)  # <|im_end|>: ChatML's end of turn
    writer.add_pad_token_id(1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_tiny_gguf(path: str, model: Any, qtype_name: str, seed: int = 0,
                    overrides: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Writes ``model`` (a tiny transformers Llama/Qwen2/Qwen3) to ``path`` as GGUF.

    Args:
        overrides: projection name (``v_proj``, ``down_proj``, ...) -> the GGML type its 2-D
            weights take instead of ``qtype_name`` (mixed files, like llama.cpp's Q4_K_M).

    Returns:
        Hugging Face parameter name -> the float32 array a loader must produce for it.
    """
    import gguf

    config = model.config
    arch_name = GGUF_ARCH[config.architectures[0]]
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    rng = np.random.default_rng(seed)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    writer = gguf.GGUFWriter(path, arch_name)
    writer.add_name(f"tiny-{arch_name}-{qtype_name}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    _write_tokenizer(writer)

    expected: dict[str, np.ndarray] = {}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, param in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp writes no output.weight for tied embeddings
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, f"no GGUF name for {hf_name}"
        w = param.detach().float().numpy()
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        n_head = next((n for key, n in heads.items() if f".{key}." in hf_name), None)
        permuted = arch_name == "llama" and n_head is not None
        if permuted:
            w = llama_cpp_permute(w, n_head)
        this = next((gguf.GGMLQuantizationType[t] for key, t in (overrides or {}).items() if f".{key}." in hf_name),
                    qtype)
        data = _stored(w, this, rng) if w.ndim == 2 else w.astype(np.float32)
        raw = None if data.dtype in (np.float32, np.float16) else this
        writer.add_tensor(f"{gguf_name}.{suffix}", data, raw_dtype=raw)
        try:
            back = gguf.quants.dequantize(data, raw) if raw is not None else data.astype(np.float32)
        except NotImplementedError:
            continue  # no reference for a type gguf cannot dequantize
        expected[hf_name] = _unpermute(back, n_head) if permuted else back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
