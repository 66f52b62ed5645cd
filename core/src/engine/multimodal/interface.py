"""What a model plugin implements to take images and video (docs/multimodal.md, "Writing a
vision-language model plugin").

A model class is multimodal when it has ``embed_multimodal``. The runtime then builds every
prefill's input embeddings itself: the text embedding (``get_input_embeddings()``) of the
batch's ids, with each item's embedding rows scattered over the positions of its placeholder
run that fall in the chunk being computed. The model's ``forward`` reads them from
``forward_batch.input_embeds`` (None on decode steps: embed ``input_ids`` as usual).

Models whose positions are not one integer per token (Qwen2-VL's M-RoPE) also implement
``mm_positions``; the runtime then passes ``positions`` of shape ``[3, num_tokens]`` to their
forward, on prefill and decode steps alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from engine.multimodal.items import MultimodalItem


@runtime_checkable
class MultimodalModel(Protocol):
    """The methods the runtime calls on a model that takes images or video."""

    def embed_multimodal(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        """One ``[item.length, hidden_size]`` tensor per item, in the model's dtype and device.

        Called once per prefill batch with every item whose embedding is not cached yet (items of
        several requests together: run the vision encoder batched over them).
        """
        ...

    def get_input_embeddings(self) -> Any:
        """The text embedding module: called on a ``[num_tokens]`` id tensor, returns
        ``[num_tokens, hidden_size]``."""
        ...


@runtime_checkable
class MRopeModel(Protocol):
    """A multimodal model with multi-section rotary positions (Qwen2-VL's M-RoPE)."""

    def mm_positions(self, input_ids: list[int], items: list[MultimodalItem]) -> tuple[torch.Tensor, int]:
        """``([3, len(input_ids)]`` int64 positions of the prompt, ``position_delta``).

        ``input_ids`` holds pad ids at the items' placeholder runs (use the items' offsets and
        lengths). After the prompt, token ``i`` (0-based over the whole sequence) has position
        ``i + position_delta`` in all three sections. A text-only request is called with no items.
        """
        ...


def is_multimodal(model: Any) -> bool:
    return callable(getattr(model, "embed_multimodal", None))


def uses_mrope(model: Any) -> bool:
    return is_multimodal(model) and callable(getattr(model, "mm_positions", None))
