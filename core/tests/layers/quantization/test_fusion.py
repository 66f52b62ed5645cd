"""The producer-fused activation quantization contract (``engine.layers.quantization``)."""

from __future__ import annotations

import torch
from engine.layers.activation import GeluAndMul, SiluAndMul
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import ReplicatedLinear
from engine.layers.quantization import ActivationQuantizer, QuantizedActivation
from engine.layers.quantization.fusion import link_activation_quantizers


class _Quantizer(ActivationQuantizer):
    """Fuses above 2 tokens; records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def wants(self, x: torch.Tensor) -> bool:
        return x.shape[0] > 2

    def rms_norm(self, x, weight, eps, residual):  # type: ignore[no-untyped-def]
        self.calls.append("rms_norm")
        out = QuantizedActivation(x.sign().to(torch.int8), torch.ones(x.shape[0], 1), x.dtype)
        return out if residual is None else (out, x + residual)

    def silu_and_mul(self, x):  # type: ignore[no-untyped-def]
        self.calls.append("silu_and_mul")
        d = x.shape[-1] // 2
        return QuantizedActivation(x[:, :d].sign().to(torch.int8), torch.ones(x.shape[0], 1), x.dtype)


class _Model(torch.nn.Module):
    activation_consumers = {"norm": "proj", "act": "down", "gelu": "other"}

    def __init__(self, quantizer: ActivationQuantizer | None) -> None:
        super().__init__()
        self.norm, self.act, self.gelu = RMSNorm(8), SiluAndMul(), GeluAndMul()
        self.proj, self.down, self.other = ReplicatedLinear(8, 8), ReplicatedLinear(4, 8), ReplicatedLinear(4, 8)
        for layer in (self.proj, self.down, self.other):
            layer.quant_method.activation_quantizer = lambda layer, q=quantizer: q  # type: ignore[method-assign]


def test_producers_get_their_consumers_quantizer() -> None:
    quantizer = _Quantizer()
    model = _Model(quantizer)
    # GeluAndMul has no out_quant slot: it is never linked.
    assert link_activation_quantizers(model) == 2
    assert model.norm.out_quant is quantizer and model.act.out_quant is quantizer


def test_unquantized_linears_link_nothing() -> None:
    model = _Model(None)
    assert link_activation_quantizers(model) == 0
    assert model.norm.out_quant is None and model.act.out_quant is None


def test_producers_call_the_quantizer_only_where_it_wants() -> None:
    quantizer = _Quantizer()
    model = _Model(quantizer)
    link_activation_quantizers(model)
    small, large = torch.randn(2, 8), torch.randn(5, 8)
    assert isinstance(model.norm(small), torch.Tensor) and isinstance(model.act(small), torch.Tensor)
    assert quantizer.calls == []
    out, residual = model.norm(large, large)
    assert isinstance(out, QuantizedActivation) and torch.equal(residual, 2 * large)
    assert isinstance(model.act(large), QuantizedActivation)
    assert quantizer.calls == ["rms_norm", "silu_and_mul"]


def test_the_llama_decoder_layer_declares_resolvable_pairs() -> None:
    from engine_models_llama.llama import LlamaDecoderLayer
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=64)
    layer = LlamaDecoderLayer(config, 0, None, "model.layers.0")
    for producer, consumer in LlamaDecoderLayer.activation_consumers.items():
        assert hasattr(layer.get_submodule(producer), "out_quant")
        assert isinstance(layer.get_submodule(consumer), torch.nn.Module)
