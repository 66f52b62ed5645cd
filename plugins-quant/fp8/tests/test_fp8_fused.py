"""Activation quantization fused into RMSNorm and SiLU-and-mul (``engine_quant_fp8.fused``).

The fused kernels must hand the fp8 GEMM exactly the codes and scales the unfused path computes
(the platform's RMSNorm / SiLU-and-mul kernel, then ``quantize_per_token_triton``): checked bit for
bit on the CPU (Triton interpreter) and the GPU. On the GPU a tiny Llama's logits with the fusion on
and off must then be identical, and the fused path must actually run (prefill above 32 tokens).
"""

from __future__ import annotations

import pytest
import torch
from engine.layers.activation import SiluAndMul
from engine.layers.layernorm import RMSNorm
from engine.layers.quantization import ActivationQuantizer, QuantizedActivation
from engine.layers.quantization.fusion import link_activation_quantizers
from engine_platform_cuda.kernels import rms_norm, silu_and_mul
from engine_quant_fp8 import fused
from engine_quant_fp8.config import Fp8Config
from engine_quant_fp8.kernels import quantize_per_token_triton
from engine_quant_fp8.quantize import FP8_DTYPE

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _x(m: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes: a scale taken from the wrong row shows.
    return (torch.randn(m, n, generator=gen) * torch.logspace(-2, 2, m)[:, None]).to(torch.bfloat16).to(DEV)


def _assert_same_quant(got: QuantizedActivation, q: torch.Tensor, s: torch.Tensor) -> None:
    assert got.q.dtype == FP8_DTYPE and got.dtype == torch.bfloat16
    assert torch.equal(got.scale, s)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("n", [256, 200])  # 200: a row the power-of-two block masks
def test_rms_norm_quant_equals_norm_then_quantize(n: int, with_residual: bool) -> None:
    x, weight = _x(5, n, 1), (torch.rand(n) + 0.5).to(torch.bfloat16).to(DEV)
    residual = _x(5, n, 2) if with_residual else None
    want = rms_norm(x, weight, 1e-5, residual)
    normed = want[0] if with_residual else want
    q, s = quantize_per_token_triton(normed)
    got = fused.rms_norm_quant(x, weight, 1e-5, residual)
    if with_residual:
        got, res = got
        assert torch.equal(res, want[1])
    _assert_same_quant(got, q, s)


@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize("d", [64, 300])
def test_silu_and_mul_quant_equals_silu_then_quantize(d: int, two_pass: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    x = _x(4, 2 * d, 3)
    q, s = quantize_per_token_triton(silu_and_mul(x))
    if two_pass:  # rows wider than the single-pass limit: several blocks (and a partial one) per row
        monkeypatch.setattr(fused, "SINGLE_PASS_MAX_D", 32)
        monkeypatch.setattr(fused, "TWO_PASS_BLOCK", 128)
    _assert_same_quant(fused.silu_and_mul_quant(x), q, s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_widths_equal_unfused_bit_for_bit() -> None:
    """Llama-3-8B widths on the GPU (SiLU-and-mul 14,336 wide at its default launch, RMSNorm and
    the separate quantization 4,096): ~22M quantized values over rows of 1e-6 to 1e3, signed zeros
    included. Scales equal the unfused path's; codes equal torch's IEEE division by those scales
    (the kernels divide by multiply-and-correct, ``kernels._div_rn``)."""
    from engine_quant_fp8.quantize import _to_fp8

    rows = 512
    gen = torch.Generator().manual_seed(5)
    mags = torch.logspace(-6, 3, rows)[:, None]
    gu = (torch.randn(rows, 2 * 14336, generator=gen) * mags).to(torch.bfloat16)
    gu[:, ::97] = -0.0
    gu = gu.to(DEV)
    y = silu_and_mul(gu)
    q, s = quantize_per_token_triton(y)
    assert torch.equal(q.view(torch.uint8), _to_fp8(y, s).view(torch.uint8))
    _assert_same_quant(fused.silu_and_mul_quant(gu), q, s)
    h = (torch.randn(rows, 4096, generator=gen) * mags).to(torch.bfloat16).to(DEV)
    r = (torch.randn(rows, 4096, generator=gen) * mags).to(torch.bfloat16).to(DEV)
    w = (torch.rand(4096, generator=gen) + 0.5).to(torch.bfloat16).to(DEV)
    normed, _ = rms_norm(h, w, 1e-5, r)
    q, s = quantize_per_token_triton(normed)
    assert torch.equal(q.view(torch.uint8), _to_fp8(normed, s).view(torch.uint8))
    _assert_same_quant(fused.rms_norm_quant(h, w, 1e-5, r)[0], q, s)


def test_zero_rows_quantize_to_zero_with_the_minimum_scale() -> None:
    x = torch.zeros(2, 128, dtype=torch.bfloat16, device=DEV)
    got = fused.silu_and_mul_quant(x)
    assert not got.q.float().any() and torch.all(got.scale > 0)


class _Tiny(torch.nn.Module):
    activation_consumers = {"norm": "proj", "act": "down"}

    def __init__(self, config: Fp8Config) -> None:
        super().__init__()
        from engine.layers.linear import ReplicatedLinear

        self.norm, self.act = RMSNorm(64), SiluAndMul()
        self.proj = ReplicatedLinear(64, 96, quant_config=config)
        self.down = ReplicatedLinear(48, 64, quant_config=config)
        for layer in (self.proj, self.down):
            layer.weight.data.normal_()
            layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("fuse", [True, False])
def test_linking_follows_the_plugin_option(fuse: bool) -> None:
    model = _Tiny(Fp8Config.from_config({}, {"fuse_activation_quant": fuse}))
    assert link_activation_quantizers(model) == (2 if fuse else 0)
    for producer in (model.norm, model.act):
        assert isinstance(producer.out_quant, fused.Fp8ActivationQuantizer) == fuse


def test_block_and_static_checkpoints_are_not_fused() -> None:
    config = Fp8Config(checkpoint_serialized=True, weight_strategy="block", weight_block_size=(128, 128))
    method = config.get_linear_method(torch.nn.Module(), "x")
    assert method.activation_quantizer(torch.nn.Module()) is None


def test_quantizer_declines_below_the_switch_point_and_off_fp8_gpus() -> None:
    quantizer = fused.Fp8ActivationQuantizer()
    assert isinstance(quantizer, ActivationQuantizer)
    assert not quantizer.wants(torch.zeros(33, 64))  # CPU: the weight-only reference path
    if DEV == "cuda" and fused.gemm.on_fp8_cuda(torch.zeros(1, device="cuda")):
        assert not quantizer.wants(torch.zeros(fused.gemm.WEIGHT_ONLY_MAX_M, 64, device="cuda"))
        assert quantizer.wants(torch.zeros(fused.gemm.WEIGHT_ONLY_MAX_M + 1, 64, device="cuda"))


def test_prequantized_linear_equals_quantizing_linear() -> None:
    """``apply`` on a ``QuantizedActivation`` (the fp8 x fp8 GEMM without its quantization launch)
    gives what the w8a8 path gives the same activations, bit for bit."""
    from engine_quant_fp8.w8a8 import w8a8_linear

    model = _Tiny(Fp8Config())
    x = _x(40, 64, 4)
    model.to(DEV)
    q, s = quantize_per_token_triton(x)
    got = model.proj.quant_method.apply(model.proj, QuantizedActivation(q, s, x.dtype))
    want = w8a8_linear(x, model.proj.weight, model.proj.weight_scale)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_logits_identical_with_and_without_fusion(tmp_path) -> None:  # type: ignore[no-untyped-def]
    if not fused.gemm.on_fp8_cuda(torch.zeros(1, device="cuda")):
        pytest.skip("fp8 GEMM needs compute capability >= 8.9")
    from engine.testing.checkpoints import make_tiny_checkpoint
    from engine.testing.harness import last_position_logits, make_scheduler

    path = make_tiny_checkpoint(str(tmp_path / "ckpt"), dtype="bfloat16")
    prompts = [list(range(3, 3 + n)) for n in (40, 7, 70)]  # 117 tokens: the fused path runs
    calls: list[int] = []
    real = fused.rms_norm_quant

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    logits = {}
    for fuse in (True, False):
        sched = make_scheduler(path, platform="cuda", attention="triton", quant="fp8", dtype="bfloat16",
                               disable_cuda_graph=True,
                               plugin_options={"fp8": {"fuse_activation_quant": fuse}})
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused, "rms_norm_quant", spy)
            logits[fuse] = last_position_logits(sched, prompts)
        del sched
    assert calls, "the fused RMSNorm never ran"
    assert torch.equal(logits[True], logits[False])
