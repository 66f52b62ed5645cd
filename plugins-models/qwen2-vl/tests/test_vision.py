"""The vision towers against transformers' (tiny random configs, float32): Qwen2-VL's (LayerNorm,
fc MLP, attention within frames) and Qwen2.5-VL's (RMSNorm, gated MLP, window attention with a
full-attention block), over images of different sizes and a two-frame video in one batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_models_qwen2_vl.vision import VisionTransformer, window_order

# 8x10 patches (4x5 merged: windows of 2x2 merged tokens and a column of 2x1 at the right edge),
# a 2-frame 4x4 video, a 6x6 image.
GRID = [(1, 8, 10), (2, 4, 4), (1, 6, 6)]


def _reference(windowed: bool) -> tuple[Any, Any]:
    if windowed:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        config = Qwen2_5_VLVisionConfig(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
                                        window_size=16, out_hidden_size=40, fullatt_block_indexes=[1])
        return config, Qwen2_5_VisionTransformerPretrainedModel._from_config(config)
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=40, num_heads=2, patch_size=4)
    return config, Qwen2VisionTransformerPretrainedModel._from_config(config)


@pytest.mark.parametrize("windowed", [False, True], ids=["qwen2-vl", "qwen2.5-vl"])
def test_tower_matches_transformers(windowed: bool) -> None:
    torch.manual_seed(0)
    config, ref = _reference(windowed)
    ref = ref.float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)  # random norms and biases too, so every parameter matters
    ours = VisionTransformer(config, windowed)
    ours.load_state_dict(ref.state_dict(), strict=True)  # Hugging Face's parameter names
    pixels = torch.randn(sum(t * h * w for t, h, w in GRID), 3 * 2 * 4 * 4)
    with torch.no_grad():
        want = ref(pixels, grid_thw=torch.tensor(GRID)).pooler_output
    got = ours(pixels, GRID)
    assert got.shape == want.shape == (sum(t * h * w for t, h, w in GRID) // 4, 40)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # One image alone gives its rows of the batched run: attention never crosses items.
    alone = ours(pixels[: 8 * 10], GRID[:1])
    torch.testing.assert_close(alone, got[: 8 * 10 // 4], atol=2e-5, rtol=1e-5)


def test_windows_cover_each_frame_once() -> None:
    order, lengths = window_order([(2, 6, 10)], merge=2, window=2)
    assert sorted(order.tolist()) == list(range(2 * 3 * 5))
    # Per frame: 3x5 merged tokens in windows of 2x2 (4 patches each), 2x1 at the right edge,
    # 1x2 and 1x1 along the bottom.
    assert lengths == [16, 16, 8, 8, 8, 4] * 2
