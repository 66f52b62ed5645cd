"""Links each activation producer (RMSNorm, SiLU-and-mul) to the quantization its consumer wants.

A model declares, on any module, ``activation_consumers``: producer submodule -> the linear
layer that is the only reader of its output (for Llama's decoder layer: ``input_layernorm`` ->
``self_attn.qkv_proj``, ``post_attention_layernorm`` -> ``mlp.gate_up_proj``, ``mlp.act_fn`` ->
``mlp.down_proj``). The declaration says nothing about quantization; the consumer's linear method
decides (``LinearMethodBase.activation_quantizer``), so a model plugin never knows which method
runs.

The same declaration, with ``norm_consumers`` (RMSNorm -> the linear layer that reads its output
first, where others read it after that layer ran, e.g. the MoE router before the experts), links
each RMSNorm to the linear layer that may compute the norm itself (``link_norm_consumers``).
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


def link_norm_consumers(model: nn.Module) -> int:
    """Sets ``fuse_into`` of every declared RMSNorm producer (``activation_consumers`` and
    ``norm_consumers``) to its consumer where the consumer can compute the norm itself
    (``LinearBase.can_fuse_norm``: unquantized, the platform's skinny GEMM offers norm fusion) and
    the norm's output does not come quantized (``out_quant``: that fused path stays); returns how
    many were linked. Call after the platform's kernels were installed and
    ``link_activation_quantizers``."""
    linked = 0
    for module in model.modules():
        pairs = {**(getattr(module, "activation_consumers", None) or {}),
                 **(getattr(module, "norm_consumers", None) or {})}
        for producer_name, consumer_name in pairs.items():
            producer = module.get_submodule(producer_name)
            if not hasattr(producer, "fuse_into"):
                continue  # not an RMSNorm
            consumer = module.get_submodule(consumer_name)
            can_fuse = getattr(consumer, "can_fuse_norm", None)
            fuse = producer.out_quant is None and callable(can_fuse) and can_fuse()
            producer.fuse_into = consumer if fuse else None
            linked += fuse
    if linked:
        logger.info("RMSNorm fused into the following linear layer's skinny GEMM at %d places", linked)
    return linked
