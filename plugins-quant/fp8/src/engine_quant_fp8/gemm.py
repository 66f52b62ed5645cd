"""``y = x @ W.T`` for an FP8 weight: which kernel runs where.

On CUDA devices of compute capability 8.9 or newer (Ada, Hopper, Blackwell):

- up to ``WEIGHT_ONLY_MAX_M`` tokens (``BLOCK_WEIGHT_ONLY_MAX_M`` for block scales): a Triton
  weight-only GEMM (``engine_quant_fp8.kernels.w8a16_linear``) reads the fp8 weight once,
  dequantizes it in registers and multiplies the unquantized activations (decode is
  bound by reading the weight, so halving its bytes is the whole game);
- above that, with per-channel scales: the activations are quantized per token in one
  Triton launch and ``torch._scaled_mm`` (or, up to ``W8A8_TRITON_MAX_M`` tokens, the Triton
  fp8 x fp8 GEMM of ``engine_quant_fp8.w8a8``) multiplies fp8 by fp8 on the fp8 tensor cores,
  row-wise scales applied in its float32 epilogue;
- above that, with block scales: activations quantized per token and 128-column group in one
  launch, then the block-scaled Triton fp8 x fp8 GEMM (``w8a8.w8a8_linear``).

The device must compute in float8_e4m3fn, as its platform says (``Platform.fp8_dtype``): ROCm
gfx950 does; MI300 (gfx942, float8_e4m3fnuz) does not. Everywhere else (CPU, older GPUs, MI300)
the weight is dequantized to the activation dtype and ``F.linear`` runs: the reference, numerically weight-only, correct but slower than the
unquantized model because every call rebuilds the dense weight.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from engine.layers.quantization import QuantizedActivation
from engine.platforms import device_index

from engine_quant_fp8 import FAST_ACCUM
from engine_quant_fp8.quantize import FP8_DTYPE, dequantize_per_block, dequantize_per_channel, quantize_per_token

logger = logging.getLogger(__name__)

# cuBLASLt's fp8 GEMM needs the inner and output dims to be multiples of 16.
_SCALED_MM_ALIGN = 16

# Switch points, measured on an H100 80GB HBM3 (torch 2.11, Triton 3.6) on 2026-11-23 with
# `python plugins-quant/fp8/benchmarks/bench_kernels.py --ms 1,32,48,64,256` and `--sweep-w8a8 28`: sum of the
# four Llama-3-8B linears' GPU times (qkv, o, gate_up, down; bf16 activations), microseconds.
#
#   per-channel      M=32    M=48    M=64    M=128   M=256
#   weight-only      124     165     148     -       -
#   w8a8 Triton      145     147     124*    133*    172*     (* best swept config)
#   scaled_mm        140     145   136-141   136     154
#   block weight-only 154    203
#   block w8a8       156     160
#
#: Per-channel scales: token counts up to this take the weight-only Triton kernel; above, the
#: activations are quantized per token and an fp8 x fp8 GEMM runs.
WEIGHT_ONLY_MAX_M = 32
#: Per-channel scales, above WEIGHT_ONLY_MAX_M: up to this many tokens the Triton fp8 x fp8 GEMM
#: (``w8a8.w8a8_linear``), above it ``torch._scaled_mm`` (cuBLASLt wins from M=256 on: 154 vs 172
#: above, and 1.3x at M=1024-4096).
W8A8_TRITON_MAX_M = 128
#: Block-wise scales: the weight-only kernel up to this many tokens, above it per-token-group (1 x bk)
#: activation quantization and the block-scaled Triton fp8 x fp8 GEMM.
BLOCK_WEIGHT_ONLY_MAX_M = 32


def _native_fp8_dtype(index: int) -> torch.dtype | None:
    """The fp8 type the device computes in, as its platform says (``Platform.fp8_dtype``, hook
    API 5); outside an engine run (kernel tests, benchmarks) the CUDA rule: sm_89+ on a CUDA build."""
    from engine.platforms import current_platform

    platform = current_platform()
    if platform is not None and platform.device_type == "cuda":
        return platform.fp8_dtype(torch.device("cuda", index))
    if torch.version.hip is not None:
        return None  # a ROCm build without the rocm platform: no way to tell gfx942 from gfx950
    return FP8_DTYPE if torch.cuda.get_device_capability(index) >= (8, 9) else None


@functools.cache
def _device_has_fp8_gemm(index: int) -> bool:
    # The kernels here compute in the OCP float8_e4m3fn of the checkpoints. A device whose native
    # format is another one (ROCm MI300, gfx942: float8_e4m3fnuz) or none stays on the fallback.
    native = _native_fp8_dtype(index)
    has = native == FP8_DTYPE
    if not has:  # once per device (cached): the run is correct but slower than 16-bit
        why = "no fp8 arithmetic" if native is None else f"computes in {str(native).replace('torch.', '')}"
        logger.warning("fp8: device %d (%s) has no FP8 kernels here (%s; float8_e4m3fn needed: CUDA compute "
                       "capability >= 8.9 or ROCm gfx950); weights are dequantized for every matmul, slower "
                       "than the unquantized model", index, torch.cuda.get_device_name(index), why)
    return has


def on_fp8_cuda(x: torch.Tensor) -> bool:
    """Whether ``x`` lives on a CUDA device with fp8 GEMMs (compute capability 8.9+, not ROCm)."""
    if x.device.type != "cuda":
        return False
    return _device_has_fp8_gemm(device_index(x.device))


def uses_fp8_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``fp8_linear`` takes the ``torch._scaled_mm`` path for these (per-channel) operands."""
    m = x.reshape(-1, x.shape[-1]).shape[0]
    if not hasattr(torch, "_scaled_mm") or m <= max(WEIGHT_ONLY_MAX_M, W8A8_TRITON_MAX_M):
        return False
    out_features, in_features = weight.shape
    if in_features % _SCALED_MM_ALIGN or out_features % _SCALED_MM_ALIGN:
        return False
    return on_fp8_cuda(x)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
               block_size: tuple[int, int] | None = None, fast_accum: bool = FAST_ACCUM) -> torch.Tensor:
    """``x @ dequant(weight).T + bias`` in ``x.dtype``.

    Args:
        x: activations ``[..., in]`` (float32, bfloat16 or float16).
        weight: ``[out, in]`` float8_e4m3fn, row-major.
        weight_scale: ``[out]`` float32 per-output-channel scales, or with ``block_size``
            ``[ceil(out/bn), ceil(in/bk)]`` per-tile multipliers.
        bias: optional ``[out]``.
        input_scale: a static per-tensor activation scale; None quantizes per token.
            Only the ``torch._scaled_mm`` path quantizes activations at all.
        block_size: ``(bn, bk)`` for block-wise scales, else None.
        fast_accum: ``torch._scaled_mm``'s ``use_fast_accum`` (the plugin option ``fp8.fast_accum``'s default).
    """
    x2d = x.reshape(-1, x.shape[-1])
    m = x2d.shape[0]
    if not on_fp8_cuda(x2d) or (block_size is not None and not _pow2(block_size)):
        out = reference_linear(x2d, weight, weight_scale, bias, block_size)
    elif m <= (WEIGHT_ONLY_MAX_M if block_size is None else BLOCK_WEIGHT_ONLY_MAX_M):
        from engine_quant_fp8.kernels import w8a16_linear

        out = w8a16_linear(x2d, weight, weight_scale, bias, block_size)
    elif block_size is not None or m <= W8A8_TRITON_MAX_M or not uses_fp8_gemm(x2d, weight):
        from engine_quant_fp8.w8a8 import w8a8_linear

        out = w8a8_linear(x2d, weight, weight_scale, bias, block_size, input_scale)
    else:
        out = _scaled_mm_linear(x2d.contiguous(), weight, weight_scale, input_scale, fast_accum)
        if bias is not None:
            out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear_quantized(x: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, fast_accum: bool = FAST_ACCUM) -> torch.Tensor:
    """``fp8_linear`` for activations its producer already quantized per token
    (``engine_quant_fp8.fused``): the fp8 x fp8 GEMM without the quantization launch; per-channel
    weights only, at the token counts above ``WEIGHT_ONLY_MAX_M``."""
    m = x.q.shape[0]
    if m > W8A8_TRITON_MAX_M and hasattr(torch, "_scaled_mm") and not (
            x.q.shape[1] % _SCALED_MM_ALIGN or weight.shape[0] % _SCALED_MM_ALIGN):
        out = torch._scaled_mm(x.q, weight.t(), scale_a=x.scale, scale_b=weight_scale[None, :], out_dtype=x.dtype,
                               use_fast_accum=fast_accum)
        return out + bias if bias is not None else out
    from engine_quant_fp8.w8a8 import w8a8_gemm

    return w8a8_gemm(x.q, x.scale, weight, weight_scale, bias, x.dtype)


def _pow2(block_size: tuple[int, int]) -> bool:
    return all(v & (v - 1) == 0 for v in block_size)


def reference_linear(x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """Dequantize, then ``F.linear``: the CPU path and the kernels' oracle."""
    if block_size is None:
        dense = dequantize_per_channel(weight, weight_scale, x2d.dtype)
    else:
        dense = dequantize_per_block(weight, weight_scale, block_size, x2d.dtype)
    return F.linear(x2d, dense, bias)


def _scaled_mm_linear(x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      input_scale: torch.Tensor | None, fast_accum: bool = FAST_ACCUM) -> torch.Tensor:
    qx, x_scale = quantize_per_token(x2d, input_scale)
    # Row-wise scales ([M, 1] per token, [1, N] per channel) are applied in the GEMM's
    # float32 epilogue: measured on an H100 (torch 2.11) this is ~2.4x faster than a
    # unit-scale GEMM followed by a separate rescale. ``weight.t()`` is the column-major
    # [in, out] operand cuBLASLt/CUTLASS want, without a copy.
    return torch._scaled_mm(qx, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :],
                            out_dtype=x2d.dtype,
                            use_fast_accum=fast_accum)
