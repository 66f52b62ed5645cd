"""Triton device functions and launch helpers shared by the decode and extend kernels.

Both kernels keep their softmax state in base 2: scores are multiplied by log2(e)
= 1.4426950408889634 once (written as a literal inside the kernels, since a jitted
function may only read globals that are ``tl.constexpr``), then ``exp2``/``log2``
are used, each a single hardware instruction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

@triton.jit
def soft_cap(x, cap):
    """Returns ``cap * tanh(x / cap)``, the logit soft cap of Gemma-2/Grok.

    tanh is written through ``exp2`` so the kernels need no libdevice import
    (its module path moved between Triton releases). The form
    ``1 - 2 / (exp(2y) + 1)`` saturates cleanly: exp2 overflowing to inf gives
    exactly +1, underflowing to 0 gives exactly -1.
    """
    e = tl.exp2((x / cap) * 2.8853900817779268)  # exp(2y) == 2 ** (2y * log2(e))
    return cap * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def base2_scores(qk, sm_scale, logit_cap, HAS_CAP: tl.constexpr):
    """Raw ``q . k`` products -> base-2 softmax scores (scaled, soft-capped, times log2 e)."""
    if HAS_CAP:
        scores = soft_cap(qk * sm_scale, logit_cap) * 1.4426950408889634
    else:
        # One multiply per score: the scale and log2(e) fold into one scalar.
        scores = qk * (sm_scale * 1.4426950408889634)
    return scores


def dot_precision(dtype: torch.dtype) -> str:
    """The ``input_precision`` for ``tl.dot`` on operands of ``dtype``.

    float32 inputs ask for full IEEE products: Triton's default (tf32) keeps only
    10 mantissa bits, which would make fp32 attention no more exact than fp16.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def block_size(n: int, minimum: int = 16) -> int:
    """The power-of-two tile edge covering ``n`` (``tl.dot`` needs edges of at least 16)."""
    return max(minimum, triton.next_power_of_2(n))


def check_kernel_dtype(dtype: torch.dtype, what: str) -> None:
    """Raises a clear error for activation dtypes the kernels were not written for."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"triton attention: {what} has dtype {dtype}; accepted: float16, bfloat16, float32"
        )
