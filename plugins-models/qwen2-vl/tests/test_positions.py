"""``mm_positions`` equals transformers' ``get_rope_index`` (Qwen2-VL, and Qwen2.5-VL whose video
frames are spaced by time), for images, video and several items in one prompt, and text alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_models_qwen2_vl.positions import mrope_positions

_TEXT = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=64)


def _reference(qwen25: bool) -> Any:
    if qwen25:
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        vision = dict(depth=1, num_heads=2, patch_size=4, hidden_size=16, out_hidden_size=16, intermediate_size=16,
                      tokens_per_second=2)
        return Qwen2_5_VLModel(Qwen2_5_VLConfig(text_config=_TEXT, vision_config=vision))
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    vision = dict(depth=1, num_heads=2, patch_size=4, embed_dim=16, hidden_size=16)
    return Qwen2VLModel(Qwen2VLConfig(text_config=_TEXT, vision_config=vision))


LAYOUTS = {
    "one image": [("text", 3), ("image", (1, 4, 6)), ("text", 5)],
    "video": [("text", 2), ("video", (3, 4, 4)), ("text", 4)],
    # a video longer in time than wide, between images of other shapes (items are apart by at
    # least one token: a prompt has its vision end and start tokens between two)
    "several": [("text", 3), ("image", (1, 4, 6)), ("text", 2), ("video", (5, 4, 4)), ("text", 4),
                ("image", (1, 8, 4)), ("text", 2), ("image", (1, 2, 2)), ("text", 1)],
}


@pytest.mark.parametrize("qwen25", [False, True], ids=["qwen2-vl", "qwen2.5-vl"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_positions_match_get_rope_index(qwen25: bool, layout: str) -> None:
    ids: list[int] = []
    types: list[int] = []
    items, grids, seconds = [], {"image": [], "video": []}, []
    for kind, value in LAYOUTS[layout]:
        if kind == "text":
            ids += [5] * value
            types += [0] * value
            continue
        t, h, w = value
        features = {f"{kind}_grid_thw": torch.tensor([value])}
        if kind == "video":
            seconds.append(0.7 * len(seconds) + 0.7)
            features["second_per_grid_ts"] = torch.tensor([seconds[-1]])
        items.append(SimpleNamespace(modality=kind, offset=len(ids), length=t * h * w // 4, features=features))
        ids += [9] * (t * h * w // 4)
        types += [1 if kind == "image" else 2] * (t * h * w // 4)
        grids[kind].append(value)
    kwargs: dict[str, Any] = {"mm_token_type_ids": torch.tensor([types])}
    for kind in ("image", "video"):
        if grids[kind]:
            kwargs[f"{kind}_grid_thw"] = torch.tensor(grids[kind])
    if qwen25 and seconds:
        kwargs["second_per_grid_ts"] = torch.tensor(seconds)
    want, want_delta = _reference(qwen25).get_rope_index(torch.tensor([ids]), **kwargs)
    got, delta = mrope_positions(len(ids), items, merge=2, tokens_per_second=2 if qwen25 else None)
    assert torch.equal(got, want[:, 0])
    assert delta == int(want_delta)


def test_text_alone_counts_up() -> None:
    positions, delta = mrope_positions(6, [], merge=2)
    assert torch.equal(positions, torch.arange(6).expand(3, -1))
    assert delta == 0


def test_placeholder_run_of_the_wrong_length_is_refused() -> None:
    item = SimpleNamespace(modality="image", offset=1, length=5, features={"image_grid_thw": torch.tensor([[1, 4, 6]])})
    with pytest.raises(ValueError, match="6 merged tokens but 5 placeholder tokens"):
        mrope_positions(8, [item], merge=2)
