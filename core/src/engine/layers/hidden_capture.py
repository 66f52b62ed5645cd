"""Hidden-state capture for speculative proposers that read the target's features (EAGLE).

A proposer asks the core for the target's hidden states through
``ForwardBatch.capture_hidden`` (set by the ``ModelRunner`` on every forward while a proposer
wants them); the model hands them back in ``LogitsProcessorOutput.hidden_states``, one row per
new token of the forward:

- ``capture_hidden == ()``: the final hidden states, the LM head's input (after the last
  norm), as EAGLE-1/2 heads are trained on;
- ``capture_hidden == (a, b, c)``: the outputs of decoder layers ``a``, ``b``, ``c`` (the
  residual stream after each layer, before any norm), concatenated in that order along the
  hidden dimension, as EAGLE-3 heads read them (low, middle and high features).

A model built on the layer SDK supports both by calling ``record_layer_output`` after each
decoder layer (``LlamaModel`` does) and projecting through ``LogitsProcessor``, which calls
``captured_hidden_states``. A model that never records layers still supports the first form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from engine.layers.forward_batch import ForwardBatch


def record_layer_output(forward_batch: ForwardBatch, layer_id: int, hidden: torch.Tensor,
                        residual: torch.Tensor | None) -> None:
    """Keeps decoder layer ``layer_id``'s output when the forward captures that layer.

    ``hidden``/``residual`` are the layer's two outputs in the fused-residual form (the
    residual stream is their sum; ``residual`` None: ``hidden`` is the stream itself).
    """
    layers = forward_batch.capture_hidden
    if not layers or layer_id not in layers:
        return
    forward_batch.captured_layers[layer_id] = hidden if residual is None else hidden + residual


def captured_hidden_states(forward_batch: ForwardBatch, final_hidden: torch.Tensor) -> torch.Tensor | None:
    """What ``LogitsProcessorOutput.hidden_states`` carries for this forward (None: nothing asked).

    Args:
        final_hidden: ``[num_tokens, hidden]``, the LM head's input at every new position.
    """
    layers = forward_batch.capture_hidden
    if layers is None:
        return None
    if not layers:
        return final_hidden
    got = forward_batch.captured_layers
    missing = [i for i in layers if i not in got]
    if missing:
        raise ModelLoadError(f"hidden-state capture: the model recorded no output of decoder layer(s) {missing} "
                             f"(asked: {list(layers)}); a model plugin supports layer capture by calling "
                             "engine.layers.hidden_capture.record_layer_output after each decoder layer")
    return torch.cat([got[i] for i in layers], dim=-1)


__all__ = ["captured_hidden_states", "record_layer_output"]
