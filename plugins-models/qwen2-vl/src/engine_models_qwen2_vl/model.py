"""Qwen2-VL and Qwen2.5-VL: the vision tower (``vision.py``) over Qwen2's decoder with M-RoPE.

The decoder is the Llama-family plugin's, with q/k/v biases (Qwen2) and one
``MRotaryEmbedding`` shared by its layers. The runtime (``engine.multimodal``) calls
``embed_multimodal`` on the images and videos of a prefill batch, scatters their rows over the
placeholder tokens, and passes ``[3, T]`` positions from ``mm_positions``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from engine_models_llama.llama import LlamaForCausalLM, LlamaModel
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.quantization import QuantizationConfig
from engine.layers.rotary_embedding import MRotaryEmbedding, rope_parameters
from engine.model_executor.forward_batch import ForwardBatch
from engine_models_qwen2_vl.positions import item_grid, mrope_positions
from engine_models_qwen2_vl.vision import VisionTransformer

# transformers' default when a config gives none (Qwen2-VL-7B's: 128-wide heads).
_DEFAULT_MROPE_SECTION = [16, 24, 24]


def decoder_config(config: Any) -> Any:
    """The text config as the Llama-family decoder reads it: Qwen2's (q/k/v with biases), and the
    top-level ``tie_word_embeddings`` (transformers 5 keeps it there)."""
    text = copy.copy(config.get_text_config())
    text.model_type = "qwen2"
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text


def mrope_for(text: Any) -> MRotaryEmbedding:
    theta, scaling = rope_parameters(text)
    section = scaling.get("mrope_section") or _DEFAULT_MROPE_SECTION
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    try:
        return MRotaryEmbedding(head_dim, head_dim, text.max_position_embeddings, theta, scaling, list(section))
    except ValueError as exc:
        raise ModelLoadError(f"config.json rope_scaling: {exc}") from None


class Qwen2VLTextModel(LlamaModel):
    """Qwen2's decoder stack whose layers rotate q and k with one shared M-RoPE."""

    def __init__(self, config: Any, quant_config: QuantizationConfig | None) -> None:
        super().__init__(config, quant_config)
        rope = mrope_for(config)
        for layer in self.layers:
            attn = getattr(layer, "self_attn", None)  # a PPMissingLayer on another stage has none
            if attn is not None:
                attn.rotary_emb = rope


class Qwen2VLLanguageModel(LlamaForCausalLM):
    model_cls = Qwen2VLTextModel


class Qwen2VLForConditionalGeneration(nn.Module):
    #: True: Qwen2.5-VL's tower (RMSNorm, gated MLP, window attention) and time-spaced video
    #: positions; False: Qwen2-VL's.
    windowed = False

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        vision = config.vision_config
        self.merge = int(vision.spatial_merge_size)
        # Qwen2.5-VL spaces a video's frames by their time (positions.time_interval).
        self.tokens_per_second = getattr(vision, "tokens_per_second", None) if self.windowed else None
        self.visual = VisionTransformer(vision, self.windowed)
        self.language_model = Qwen2VLLanguageModel(decoder_config(config), quant_config)

    @staticmethod
    def load_processor(path: str, trust_remote_code: bool = False) -> Any:
        """The tokenizer side's processor (``engine.multimodal``): transformers' Qwen2-VL processor
        needs torchvision, so the plugin's PIL one (``processor.py``) stands in for it."""
        from engine_models_qwen2_vl.processor import Qwen2VLProcessorPil

        return Qwen2VLProcessorPil.from_pretrained(path, trust_remote_code)

    @property
    def has_lm_head(self) -> bool:
        return getattr(self.language_model, "has_lm_head", True)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.model.embed_tokens

    @torch.no_grad()
    def embed_multimodal(self, items: list[Any]) -> list[torch.Tensor]:
        """All items' patches through the vision tower in one pass; one ``[length, hidden]``
        tensor per item."""
        param = self.visual.patch_embed.proj.weight
        pixels, grids = [], []
        for item in items:
            key = "pixel_values_videos" if "pixel_values_videos" in item.features else "pixel_values"
            if key not in item.features:
                raise ValueError(f"a {item.modality} item carries no pixel_values "
                                 f"(features: {', '.join(sorted(item.features))})")
            grid = item_grid(item)
            t, h, w = grid
            if t * h * w // self.merge**2 != item.length:
                raise ValueError(f"{item.modality} with grid {grid} gives {t * h * w // self.merge**2} tokens, "
                                 f"not its {item.length} placeholder tokens")
            pixels.append(item.features[key].reshape(t * h * w, -1))
            grids.append(grid)
        merged = self.visual(torch.cat(pixels).to(param.device, param.dtype), grids)
        return list(merged.split([item.length for item in items]))

    def mm_positions(self, input_ids: list[int], items: list[Any]) -> tuple[torch.Tensor, int]:
        return mrope_positions(len(input_ids), items, self.merge, self.tokens_per_second)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> Any:
        return self.language_model(input_ids, positions, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoints name the tower ``visual.`` (or ``model.visual.``) and the decoder ``model.``
        (or ``model.language_model.``); the decoder's tensors go to the Llama-family loader."""
        params = dict(self.visual.named_parameters())
        loaded: set[str] = set()

        def decoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("model.visual."):
                    name = name[len("model."):]
                if name.startswith("visual."):
                    target = params.get(name[len("visual."):])
                    if target is None:
                        raise ModelLoadError(f"checkpoint tensor '{name}' has no matching parameter in the vision tower")
                    target.data.copy_(tensor)
                    loaded.add(name[len("visual."):])
                    continue
                if name.startswith("model.language_model."):
                    name = "model." + name[len("model.language_model."):]
                yield name, tensor

        self.language_model.load_weights(decoder_weights())
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} vision-tower parameters, e.g. "
                                 f"visual.{', visual.'.join(missing[:3])}")


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    windowed = True


_CLASSES = {cls.__name__: cls for cls in (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration)}


def model_class_for(architecture: str) -> type[nn.Module]:
    return _CLASSES[architecture]
