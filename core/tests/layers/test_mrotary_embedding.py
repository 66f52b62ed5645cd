"""``MRotaryEmbedding`` (Qwen2-VL's M-RoPE) against transformers' rotary and ``apply_rotary_pos_emb``."""

from __future__ import annotations

import pytest
import torch

from engine.layers.rotary_embedding import MRotaryEmbedding, RotaryEmbedding

HEADS, KV_HEADS, HEAD_DIM, T = 4, 2, 16, 11
SECTION = [2, 3, 3]  # temporal, height, width pairs of the 8 rotated pairs


def test_three_section_positions_match_transformers() -> None:
    from transformers import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VLRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = Qwen2VLTextConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": SECTION})
    torch.manual_seed(0)
    positions = torch.randint(0, 200, (3, T))
    q, k = torch.randn(T, HEADS * HEAD_DIM), torch.randn(T, KV_HEADS * HEAD_DIM)
    cos, sin = Qwen2VLRotaryEmbedding(config)(q, positions[:, None, :])
    want_q, want_k = apply_rotary_pos_emb(q.view(1, T, HEADS, HEAD_DIM).transpose(1, 2),
                                          k.view(1, T, KV_HEADS, HEAD_DIM).transpose(1, 2), cos, sin)
    rope = MRotaryEmbedding(HEAD_DIM, HEAD_DIM, 256, 10000.0, {"type": "mrope", "mrope_section": SECTION}, SECTION)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q.transpose(1, 2).reshape(T, -1))
    torch.testing.assert_close(got_k, want_k.transpose(1, 2).reshape(T, -1))


def test_equal_sections_rotate_as_plain_rope() -> None:
    torch.manual_seed(1)
    positions = torch.randint(0, 200, (T,))
    q, k = torch.randn(T, HEADS * HEAD_DIM), torch.randn(T, KV_HEADS * HEAD_DIM)
    rope = MRotaryEmbedding(HEAD_DIM, HEAD_DIM, 256, 10000.0, None, SECTION)
    plain = RotaryEmbedding(HEAD_DIM, HEAD_DIM, 256, 10000.0)
    for got, want in zip(rope(positions.expand(3, -1), q, k), plain(positions, q, k), strict=True):
        torch.testing.assert_close(got, want)
    for got, want in zip(rope(positions, q, k), plain(positions, q, k), strict=True):
        torch.testing.assert_close(got, want)


def test_sections_must_cover_the_rotated_pairs() -> None:
    with pytest.raises(ValueError, match=r"mrope_section: invalid value \[2, 3, 2\].*adding up to .* \(8\)"):
        MRotaryEmbedding(HEAD_DIM, HEAD_DIM, 256, 10000.0, None, [2, 3, 2])
