"""Links each activation producer (RMSNorm, SiLU-and-mul) to the quantization its consumer wants.

A model declares, on any module, ``activation_consumers``: producer submodule -> the linear
layer that is the only reader of its output (for Llama's decoder layer: ``input_layernorm`` ->
``self_attn.qkv_proj``, ``post_attention_layernorm`` -> ``mlp.gate_up_proj``, ``mlp.act_fn`` ->
``mlp.down_proj``). The declaration says nothing about quantization; the consumer's linear method
decides (``LinearMethodBase.activation_quantizer``), so a model plugin never knows which method
runs.
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)


def link_activation_quantizers(model: nn.Module) -> int:
    """Gives every declared producer that can fuse (has an ``out_quant`` slot) its consumer's
    ``ActivationQuantizer``, where the consumer's method offers one; returns how many were linked."""
    linked = 0
    for module in model.modules():
        pairs = getattr(module, "activation_consumers", None)
        if not pairs:
            continue
        for producer_name, consumer_name in pairs.items():
            producer = module.get_submodule(producer_name)
            consumer = module.get_submodule(consumer_name)
            method = getattr(consumer, "quant_method", None)
            if method is None or not hasattr(producer, "out_quant"):
                continue
            quantizer = method.activation_quantizer(consumer)
            producer.out_quant = quantizer
            linked += quantizer is not None
    if linked:
        logger.info("activation quantization fused into %d producing layers (RMSNorm, SiLU-and-mul)", linked)
    return linked
