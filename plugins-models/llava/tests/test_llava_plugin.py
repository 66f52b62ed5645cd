"""The LLaVA plugin without a scheduler: image embeddings equal transformers' for CLIP and SigLIP
towers, one or several feature layers, both select strategies; checkpoints in both weight
layouts load to the same parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.errors import ModelLoadError
from engine.multimodal import MultimodalItem
from engine_models_llava.llava import LlavaForConditionalGeneration


def _config(tower: str, layers: Any, strategy: str) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, SiglipVisionConfig

    shapes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=14)
    vision = CLIPVisionConfig(**shapes) if tower == "clip" else SiglipVisionConfig(**shapes)
    text = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=127, vision_feature_layer=layers,
                       vision_feature_select_strategy=strategy, projector_hidden_act="gelu")


def _pair(tower: str, layers: Any, strategy: str) -> tuple[Any, LlavaForConditionalGeneration]:
    from transformers import LlavaForConditionalGeneration as HFLlava

    config = _config(tower, layers, strategy)
    torch.manual_seed(0)
    hf = HFLlava(config).eval()
    ours = LlavaForConditionalGeneration(config)
    ours.load_weights(iter(hf.state_dict().items()))
    return hf, ours.eval()


@pytest.mark.parametrize("tower, layers, strategy", [("siglip", -1, "full"), ("clip", [-2, -1], "full")])
def test_image_embeddings_equal_transformers(tower: str, layers: Any, strategy: str) -> None:
    hf, ours = _pair(tower, layers, strategy)
    pixels = torch.randn(3, 3, 28, 28)
    items = [MultimodalItem("image", i, 0, 0, {"pixel_values": pixels[i:i + 1]}) for i in range(3)]
    got = ours.embed_multimodal(items)
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=pixels)
    want = want.pooler_output if hasattr(want, "pooler_output") else want
    want = torch.stack(list(want)) if isinstance(want, (list, tuple)) else want
    tokens = 4 + (tower == "clip" and strategy == "full")  # 2x2 patches, and CLIP's CLS position
    assert [g.shape for g in got] == [torch.Size([tokens, 64])] * 3
    torch.testing.assert_close(torch.stack(got), want.reshape(3, tokens, 64), rtol=1e-5, atol=1e-5)


def test_the_earlier_weight_layout_loads_the_same_parameters() -> None:
    hf, ours = _pair("clip", -2, "default")
    earlier = {}
    for name, tensor in hf.state_dict().items():  # transformers 4's names, as llava-hf checkpoints have them
        name = name.replace("model.language_model.", "language_model.model.")
        name = name.replace("model.vision_tower.", "vision_tower.vision_model.")
        name = name.replace("model.multi_modal_projector.", "multi_modal_projector.")
        name = name.replace("lm_head.", "language_model.lm_head.") if name.startswith("lm_head.") else name
        earlier[name] = tensor
    again = LlavaForConditionalGeneration(hf.config)
    again.load_weights(iter(earlier.items()))
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ModelLoadError, match="no matching parameter"):
        LlavaForConditionalGeneration(hf.config).load_weights(iter([("model.resampler.weight", torch.zeros(1))]))
