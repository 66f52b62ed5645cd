"""LlavaForConditionalGeneration: image features from a vision tower, projected onto a
Llama-family decoder's embedding space, replace the prompt's image placeholder tokens.

The vision tower is transformers' own module for the checkpoint's ``vision_config``
(``CLIPVisionModel`` or ``SiglipVisionModel``) with the checkpoint's weights, run once per prefill
batch over every image not cached yet; the projector and the decoder are the engine's.
Checkpoints in both layouts load: transformers 5's (``model.language_model.*``,
``model.vision_tower.*``, ``lm_head.*``) and the earlier one (``language_model.model.*``,
``vision_tower.vision_model.*``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.quantization import QuantizationConfig
from engine.model_executor.forward_batch import ForwardBatch
from engine.multimodal import MultimodalItem
from engine_models_llama.llama import LlamaForCausalLM

_ACTIVATIONS = {"gelu": nn.GELU, "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU,
                "silu": nn.SiLU, "quick_gelu": None}


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def _activation(name: str) -> nn.Module:
    if name == "quick_gelu":
        return QuickGELU()
    make = _ACTIVATIONS.get(name)
    if make is None:
        raise ModelLoadError(f"LLaVA projector_hidden_act '{name}' is not supported; accepted: "
                             f"{', '.join(sorted(_ACTIVATIONS))}")
    return make()


class LlavaProjector(nn.Module):
    """Two linear layers with an activation between: vision features -> decoder hidden size."""

    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.act = _activation(act)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        from transformers import AutoModel

        self.config = config
        text_config = config.text_config
        self.language_model = LlamaForCausalLM(text_config, quant_config)
        self.vision_tower = AutoModel.from_config(config.vision_config)
        layers = config.vision_feature_layer
        self.feature_layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
        self.select_strategy = config.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise ModelLoadError(f"LLaVA vision_feature_select_strategy '{self.select_strategy}' is not supported; "
                                 "accepted: default, full")
        self.multi_modal_projector = LlavaProjector(
            config.vision_config.hidden_size * len(self.feature_layers), text_config.hidden_size,
            config.projector_hidden_act, bool(getattr(config, "multimodal_projector_bias", True)))

    # -- engine.multimodal.MultimodalModel --------------------------------------
    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.model.embed_tokens

    @torch.no_grad()
    def embed_multimodal(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        """Every image's tower features in one batched tower call, then the projector."""
        param = next(self.multi_modal_projector.parameters())
        pixels = torch.cat([it.features["pixel_values"] for it in items]).to(param.device, param.dtype)
        out = self.vision_tower(pixel_values=pixels, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i] for i in self.feature_layers], dim=-1)
        if self.select_strategy == "default":
            feats = feats[:, 1:]  # the CLS position is not an image token
        embeds = self.multi_modal_projector(feats)
        return list(embeds.unbind(0))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> Any:
        return self.language_model(input_ids, positions, forward_batch)

    # -- weights ------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = dict(self.vision_tower.named_parameters(prefix="vision_tower"))
        own.update(self.multi_modal_projector.named_parameters(prefix="multi_modal_projector"))
        own.update((f"vision_tower.{n}", b) for n, b in self.vision_tower.named_buffers()
                   if not n.endswith("position_ids"))
        loaded: set[str] = set()

        def decoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                target = _decoder_name(name)
                if target is not None:
                    yield target, tensor
                    continue
                key = self._tower_name(name, own)
                if key is None:
                    if name.endswith("position_ids"):
                        continue
                    raise ModelLoadError(f"checkpoint tensor '{name}' has no matching parameter in "
                                         f"{type(self).__name__}")
                own[key].data.copy_(tensor)
                loaded.add(key)

        self.language_model.load_weights(decoder_weights())
        missing = sorted(k for k in own if k not in loaded)
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} vision parameters, e.g. {', '.join(missing[:3])}")

    @staticmethod
    def _tower_name(name: str, own: dict[str, Any]) -> str | None:
        name = name.removeprefix("model.")
        if name in own:
            return name
        # transformers' tower classes differ in whether the weights sit under "vision_model."
        alt = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
        if alt in own:
            return alt
        alt = name.replace("vision_tower.", "vision_tower.vision_model.", 1)
        return alt if alt in own else None


def _decoder_name(name: str) -> str | None:
    """The decoder's name for a checkpoint tensor (``model.layers...``, ``lm_head...``), else None."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model."):
        return name[len("language_model."):]
    if name.startswith("lm_head."):
        return name
    return None


def model_class_for(architecture: str) -> type[nn.Module]:
    return LlavaForConditionalGeneration
