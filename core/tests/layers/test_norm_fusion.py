"""RMSNorm folded into the linear layer after it (``PendingNorm``, ``RMSNorm.fuse_into``,
``LinearBase.takes_pending_norm``, ``quantization.fusion.link_norm_consumers``), on the CPU.

The platform's kernel is a PyTorch stand-in (``_TorchNormKernel``) that computes the norm as
``RMSNorm`` does and multiplies by ``F.linear``, so a fused layer must give the unfused layer's
outputs bit for bit: what is checked is the plumbing (who hands what to whom, the residual sum
filled before it is read), not the kernel (plugins/platform-cuda/tests/test_gemv_norm.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.layernorm import PendingNorm, RMSNorm, normed_tensor
from engine.layers.linear import ReplicatedLinear, RowParallelLinear
from engine.layers.quantization import LinearMethodBase
from engine.layers.quantization.fusion import link_norm_consumers

DTYPE = torch.bfloat16


class _TorchNormKernel:
    """Stands for ``layer_kernels()['linear']`` with norm fusion: PyTorch on the CPU; records calls."""

    def __init__(self, norm_fusion: bool = True, norm_rows: int = 2) -> None:
        self.max_rows = 8
        self.norm_fusion = norm_fusion
        self.norm_rows = norm_rows
        self.norm_calls = 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)  # never called: linear_with_kernel wants CUDA tensors

    def takes_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return self.norm_fusion and x.dim() == 2 and 1 <= x.shape[0] <= self.norm_rows and x.dtype == weight.dtype

    def norm_linear(self, pending: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.norm_calls += 1
        x = pending.x
        if pending.residual is not None:
            x = x + pending.residual
            pending.res_sum.view_as(x).copy_(x)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + pending.eps)
        normed = pending.weight * h.to(x.dtype)
        pending.normed.view_as(normed).copy_(normed)
        return F.linear(normed, weight, bias)


def _randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for param in module.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.2 + (1.0 if param.dim() == 1 else 0.0))
    return module


def _install(model: nn.Module, kernel: Any) -> int:
    """What the model runner does at start-up: kernels to every layer, then the linking."""
    for module in model.modules():
        use = getattr(module, "use_kernels", None)
        if callable(use):
            use({"linear": kernel})
    return link_norm_consumers(model)


class _NormThenLinear(nn.Module):
    activation_consumers = {"norm": "proj"}

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.norm = RMSNorm(32)
        self.proj = ReplicatedLinear(32, 24, bias=bias, params_dtype=DTYPE)
        self.to(DTYPE)
        _randomize(self)


def _x(rows: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, 32, generator=torch.Generator().manual_seed(seed)).to(DTYPE)


# -- the norm and the linear --------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_pending_norm_flows_to_the_linear_and_gives_the_unfused_result(bias: bool) -> None:
    fused, plain = _NormThenLinear(bias), None
    plain = copy.deepcopy(fused)
    kernel = _TorchNormKernel()
    assert _install(fused, kernel) == 1 and fused.norm.fuse_into is fused.proj
    for rows in (1, 2):
        x, residual = _x(rows), _x(rows, seed=2)
        pending, res_sum = fused.norm(x, residual)
        assert isinstance(pending, PendingNorm) and pending.shape == x.shape and pending.dtype == DTYPE
        assert res_sum is pending.res_sum
        want_normed, want_res = plain.norm(x, residual)
        assert torch.equal(fused.proj(pending), plain.proj(want_normed))
        # Filled by the consumer: the next residual, and the norm output for later readers.
        assert torch.equal(res_sum, want_res) and torch.equal(normed_tensor(pending), want_normed)
        first = fused.norm(x)  # no residual (the first layer): res_sum is x itself
        assert isinstance(first, PendingNorm) and first.res_sum is x and first.residual is None
        assert torch.equal(fused.proj(first), plain.proj(plain.norm(x)))
    assert kernel.norm_calls == 4


def test_rows_the_kernel_refuses_are_normed_here() -> None:
    model = _NormThenLinear()
    kernel = _TorchNormKernel(norm_rows=2)
    _install(model, kernel)
    x = _x(3)
    out = model.norm(x)
    assert isinstance(out, torch.Tensor) and not isinstance(out, PendingNorm)
    normed, res = model.norm(x, x)
    assert isinstance(normed, torch.Tensor) and torch.equal(res, x + x)
    # A residual the kernel would not take (another dtype) keeps the unfused path too.
    assert not isinstance(model.norm(_x(1), _x(1).float())[0], PendingNorm)
    assert kernel.norm_calls == 0
    assert normed_tensor(normed) is normed  # a tensor passes through


# -- the linking ----------------------------------------------------------------------------------

def test_not_linked_when_the_option_is_off_or_there_is_no_kernel() -> None:
    model = _NormThenLinear()
    assert _install(model, _TorchNormKernel(norm_fusion=False)) == 0  # cuda.norm_fusion=off
    assert model.norm.fuse_into is None
    assert _install(model, None) == 0  # no skinny GEMM (cuda.gemv=off, other platforms)
    assert model.norm.fuse_into is None


def test_not_linked_to_a_quantized_consumer_or_a_quantizing_producer() -> None:
    class _Quantized(LinearMethodBase):
        def create_weights(self, *args: Any, **kwargs: Any) -> None:
            pass

        def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            raise AssertionError("not called")

    model = _NormThenLinear()
    model.proj.quant_method = _Quantized()
    assert _install(model, _TorchNormKernel()) == 0 and model.norm.fuse_into is None
    model = _NormThenLinear()
    model.norm.out_quant = object()  # type: ignore[assignment]  # fp8's fused norm + quantization stays
    assert _install(model, _TorchNormKernel()) == 0 and model.norm.fuse_into is None


def test_a_row_parallel_consumer_is_never_linked() -> None:
    class _Model(nn.Module):
        norm_consumers = {"norm": "proj"}

        def __init__(self) -> None:
            super().__init__()
            self.norm, self.proj = RMSNorm(32), RowParallelLinear(32, 24, params_dtype=DTYPE)

    assert _install(_Model(), _TorchNormKernel()) == 0


# -- the decoder layers of the model plugins -----------------------------------------------------

class _ProjectionsOnly(nn.Module):
    """Stands in for ``LlamaAttention`` (no attention backend on the CPU test): its qkv projection,
    then o_proj of the q part."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj, self.q_size = attn.qkv_proj, attn.o_proj, attn.q_size

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: Any) -> torch.Tensor:
        return self.o_proj(self.qkv_proj(hidden)[..., : self.q_size])


def _decoder_layer(arch: str, layer_id: int = 0, **overrides: Any) -> nn.Module:
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=64)
    if arch == "llama":
        from engine_models_llama.llama import LlamaDecoderLayer
        from transformers import LlamaConfig

        layer = LlamaDecoderLayer(LlamaConfig(**base, **overrides), layer_id, None, f"model.layers.{layer_id}")
    else:
        from engine_models_moe.models import MoeDecoderLayer
        from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

        config_cls = {"qwen3_moe": Qwen3MoeConfig, "qwen2_moe": Qwen2MoeConfig, "mixtral": MixtralConfig}[arch]
        layer = MoeDecoderLayer(config_cls(**base, **overrides), layer_id, None, f"model.layers.{layer_id}")
    layer.self_attn = _ProjectionsOnly(layer.self_attn)
    layer.to(DTYPE)
    return _randomize(layer, seed=layer_id)


_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
LAYERS = [
    pytest.param("llama", 0, {}, {"input_layernorm": "self_attn.qkv_proj",
                                  "post_attention_layernorm": "mlp.gate_up_proj"}, id="llama"),
    pytest.param("qwen3_moe", 0, _MOE, {"input_layernorm": "self_attn.qkv_proj",
                                        "post_attention_layernorm": "mlp.gate"}, id="qwen3_moe"),
    pytest.param("qwen2_moe", 0, {**_MOE, "shared_expert_intermediate_size": 24, "mlp_only_layers": [1]},
                 {"input_layernorm": "self_attn.qkv_proj", "post_attention_layernorm": "mlp.gate"},
                 id="qwen2_moe-sparse"),
    pytest.param("qwen2_moe", 1, {**_MOE, "shared_expert_intermediate_size": 24, "mlp_only_layers": [1]},
                 {"input_layernorm": "self_attn.qkv_proj", "post_attention_layernorm": "mlp.gate_up_proj"},
                 id="qwen2_moe-dense"),
    pytest.param("mixtral", 0, {"num_local_experts": 4, "num_experts_per_tok": 2},
                 {"input_layernorm": "self_attn.qkv_proj", "post_attention_layernorm": "block_sparse_moe.gate"},
                 id="mixtral"),
]


@pytest.mark.parametrize("arch,layer_id,overrides,links", LAYERS)
def test_decoder_layer_gives_the_unfused_result(arch: str, layer_id: int, overrides: dict[str, Any],
                                                links: dict[str, str]) -> None:
    fused = _decoder_layer(arch, layer_id, **overrides)
    plain = copy.deepcopy(fused)
    kernel = _TorchNormKernel()
    assert _install(fused, kernel) == len(links)
    for producer, consumer in links.items():
        assert fused.get_submodule(producer).fuse_into is fused.get_submodule(consumer)
    positions = torch.arange(2)
    for rows in (1, 2):
        hidden, residual = _x(rows, seed=3), None  # the first layer: no residual yet
        want_hidden, want_residual = plain(positions[:rows], hidden, residual, None)
        got_hidden, got_residual = fused(positions[:rows], hidden, residual, None)
        assert torch.equal(got_hidden, want_hidden) and torch.equal(got_residual, want_residual)
        # A later layer: the residual sum the consumer wrote is the next layer's residual.
        want = plain(positions[:rows], want_hidden, want_residual, None)
        got = fused(positions[:rows], got_hidden, got_residual, None)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert kernel.norm_calls == 2 * 2 * len(links)
    # Three rows: the kernel takes none of them, the layer runs unfused.
    three = _x(3, seed=4)
    assert torch.equal(fused(torch.arange(3), three, three, None)[0], plain(torch.arange(3), three, three, None)[0])
    assert kernel.norm_calls == 2 * 2 * len(links)
