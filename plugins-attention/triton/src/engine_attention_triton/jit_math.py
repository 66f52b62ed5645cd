"""Triton device functions and launch helpers of the decode and extend kernels.

Both kernels keep their softmax state in base 2: scores are multiplied by log2(e)
= 1.4426950408889634 once (written as a literal inside the kernels, since a jitted
function may only read globals that are ``tl.constexpr``), then ``exp2``/``log2``
are used, each a single hardware instruction.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from engine.platforms import device_index


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


@triton.jit
def widen_e4m3_words(w):
    """int32 words, each four float8 e4m3fn values, -> ``[rows, 4 * cols]`` bfloat16, exactly.

    Triton's own widening goes through float16: one ``cvt.bf16.f16`` (SASS F2F, a slow
    conversion pipe) per value. On an H200 at Llama-3-8B heads, batch 512, 1.5k tokens, that
    held stage 1 at ~740 us whatever the tiles, against 380 us of KV reads. Here each value's bits
    move into place on the integer pipe (prmt, shift, and, lop3) and one bf16x2 fma per pair
    restores the exponent bias: the shifted bits are the value times 2^-120, subnormals included,
    and times 2^120 (plus -0, which keeps -0) is exact. Whole words keep the bytes packed: a tile
    of int8 is unpacked and repacked value by value. Inline PTX: NVIDIA sm_80+ only.
    """
    e0, e1, e2, e3 = tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 a0, a1, b0, b1, c, z;
        mov.b32 c, 0x7b807b80;
        mov.b32 z, 0x80008000;
        prmt.b32 a0, 0, $4, 0x5040;
        prmt.b32 a1, 0, $4, 0x7060;
        shr.b32 b0, a0, 4;
        shr.b32 b1, a1, 4;
        and.b32 b0, b0, 0x07f007f0;
        and.b32 b1, b1, 0x07f007f0;
        lop3.b32 b0, b0, 0x80008000, a0, 0xf8;
        lop3.b32 b1, b1, 0x80008000, a1, 0xf8;
        fma.rn.bf16x2 b0, b0, c, z;
        fma.rn.bf16x2 b1, b1, c, z;
        mov.b32 {$0, $1}, b0;
        mov.b32 {$2, $3}, b1;
        }
        """,
        constraints="=h,=h,=h,=h,r", args=[w], dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
        is_pure=True, pack=1)
    # join(join(e0, e2), join(e1, e3))[r, j, a, b] is value 2a + b of word j: row-major, value 4j + 2a + b.
    return tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (w.shape[0], w.shape[1] * 4))


#: Inline PTX of ``widen_e4m3_words_f16`` (and ``decode_fp8_mma``'s K operand): one int32 word of four
#: e4m3 values ($4) -> four float16 ($0-$3) by two paired conversions (``cvt.rn.f16x2.e4m3x2``, sm_89+).
E4M3_WORD_TO_F16_ASM: tl.constexpr = tl.constexpr("""
        {
        .reg .b16 lo, hi;
        .reg .b32 r0, r1;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 r0, lo;
        cvt.rn.f16x2.e4m3x2 r1, hi;
        mov.b32 {$0, $1}, r0;
        mov.b32 {$2, $3}, r1;
        }
        """)


@triton.jit
def widen_e4m3_words_f16(w):
    """int32 words, each four float8 e4m3fn values, -> ``[rows, 4 * cols]`` float16, exactly, by the
    hardware's paired conversion (``cvt.rn.f16x2.e4m3x2``, sm_89+), two a word.

    Triton's own ``.to(tl.float16)`` of an e4m3 tile headed for ``tl.dot`` is moved past the
    tile's trip through shared memory into the tensor-core layout, so the operand arrives there as
    single bytes (one ``ld.shared.b8`` per value of V, whose keys run down the operand's columns);
    as inline PTX the conversion stays where it is written, and the widened tile takes the
    16-bit route (``stmatrix``, ``ldmatrix``). Inline PTX: NVIDIA sm_89+ only.
    """
    e0, e1, e2, e3 = tl.inline_asm_elementwise(
        asm=E4M3_WORD_TO_F16_ASM, constraints="=h,=h,=h,=h,r", args=[w],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=1)
    return tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (w.shape[0], w.shape[1] * 4))


@triton.jit
def widen(raw, dtype: tl.constexpr, WORDS: tl.constexpr):
    """A gathered K/V tile in q's dtype (exact: fp8 and q's own dtype widen without rounding).
    ``WORDS`` 1: int32 words of e4m3 values to bfloat16 (``widen_e4m3_words``); 3: to float16
    (``widen_e4m3_words_f16``); else the tile as loaded, converted by Triton."""
    if WORDS == 1:
        return widen_e4m3_words(raw)
    elif WORDS == 3:
        return widen_e4m3_words_f16(raw)
    else:
        return raw.to(dtype)


def word_aligned(k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """Whether a one-byte pool's slot and head strides and bases are whole int32 words (4 bytes), so
    its rows can be gathered as words."""
    return all(n % 4 == 0 for t in (k_buffer, v_buffer) for n in (*t.stride()[:2], t.data_ptr()))


def gathers_words(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """Whether stage 1 gathers the pool as int32 words and widens them itself (``widen_e4m3_words``):
    an e4m3 pool under bf16 queries, every stride and the base 4-byte aligned."""
    return (k_buffer.dtype == v_buffer.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16
            and word_aligned(k_buffer, v_buffer) and k_buffer.shape[2] % 4 == 0 and v_buffer.shape[2] % 4 == 0
            and q.device.type == "cuda" and _ptx_sm80(device_index(q.device)))


@functools.cache
def _ptx_sm80(index: int) -> bool:
    """NVIDIA sm_80+ compiled for real (inline PTX; not ROCm, not Triton's interpreter)."""
    return (torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(index)[0] >= 8)
