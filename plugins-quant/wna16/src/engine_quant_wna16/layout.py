"""The two forms a 4/8-bit weight takes here, and the torch reference that multiplies by it.

Every checkpoint format (AWQ, GPTQ, compressed-tensors) unpacks to one logical form,
``IntWeight``: integer codes ``[K, N]`` (K input channels, N output channels), a scale and
a zero point per (group, output channel), and optionally GPTQ's ``g_idx``. Dequantized,
``W[n, k] = (codes[k, n] - zero[g(k), n]) * scale[g(k), n]`` in every format.

``to_kernel_layout`` turns that into the one layout the kernels read, ``KernelWeight``:

- ``qweight`` int32 ``[K / P, N]`` with ``P = 32 // bits`` codes per word packed along K in
  planes: K is cut into blocks of ``P * L`` rows held by ``L`` words (``L = plane_words``, 16
  for groups of 128); code ``k`` sits in word ``(k // (P * L)) * L + k % L`` at bits
  ``((k % (P * L)) // L) * bits``. So the codes at one bit position of ``L`` consecutive words
  are ``L`` consecutive inputs: a kernel pairs them with a contiguous run of activations. Stored output-major
  (strides ``(1, K / P)``: a transposed view of a contiguous ``[N, K / P]``), so the words of
  one output channel are contiguous along K and a decode GEMV streams long rows. The kernels
  take any strides (a ``.contiguous()`` copy is still correct, only slower at decode).
- ``scales`` ``[K / G, N]`` and ``zeros`` uint8 ``[K / G, N]`` (None when symmetric: the zero
  is ``2 ** (bits - 1)``), groups of ``G`` consecutive rows.
- ``perm`` int32 ``[K]`` or None. With act-order (GPTQ ``desc_act``), ``g_idx`` scatters the
  members of a group over K. Sorting the rows by group (a stable argsort of ``g_idx``) makes
  every group ``G`` consecutive rows again, so the kernel sees plain groups; row ``r`` of the
  kernel layout is input channel ``perm[r]``, and the kernel reads activation ``x[:, perm[r]]``
  for it (a gather of the small activation, not of the weight). Identity orders give None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from engine.errors import ModelLoadError

SUPPORTED_BITS = (4, 8)
# The kernels' smallest K tile (tl.dot needs 16): groups are whole multiples of it.
GROUP_ALIGN = 16


def pack_int32(codes: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """Packs unsigned ``bits``-bit codes along ``dim`` into int32 words.

    Word ``w`` holds elements ``w * P + order[i]`` (``P = 32 // bits``) at bits ``i * bits``;
    ``order`` defaults to ``0..P-1`` (GPTQ, compressed-tensors); AWQ interleaves.
    """
    per_word = 32 // bits
    v = codes.movedim(dim, -1).to(torch.int64)
    if v.shape[-1] % per_word:
        raise ValueError(f"cannot pack {v.shape[-1]} values along dim {dim} into words of {per_word}")
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per_word, per_word)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(per_word, device=v.device, dtype=torch.int64) * bits
    words = ((v & ((1 << bits) - 1)) << shifts).sum(-1)
    # Two's complement wrap into int32 (the top code sets the sign bit).
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """Inverse of ``pack_int32``: int32 codes in ``[0, 2**bits)``, ``dim`` grown by ``32 // bits``."""
    per_word = 32 // bits
    w = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, device=w.device, dtype=torch.int64) * bits
    codes = (w[..., None] >> shifts) & ((1 << bits) - 1)
    if order is not None:
        inverse = [0] * per_word
        for i, o in enumerate(order):
            inverse[o] = i
        codes = codes[..., inverse]
    codes = codes.reshape(*codes.shape[:-2], codes.shape[-2] * per_word).to(torch.int32)
    return codes.movedim(-1, dim).contiguous()


@dataclass
class IntWeight:
    """A weight in the logical form every checkpoint format unpacks to (see the module doc)."""

    #: ``[K, N]`` unsigned integer codes, ``0 <= code < 2 ** bits``.
    codes: torch.Tensor
    #: ``[K / group_size, N]`` float scales.
    scales: torch.Tensor
    #: ``[K / group_size, N]`` integer zero points; None: symmetric, zero ``2 ** (bits - 1)``.
    zeros: torch.Tensor | None
    #: ``[K]`` group of each input channel (GPTQ act-order); None: channel ``k`` is in ``k // group_size``.
    g_idx: torch.Tensor | None
    bits: int
    #: input channels per group (``K`` for one group per output channel).
    group_size: int

    def group_of_channel(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.codes.shape[0], device=self.codes.device) // self.group_size

    def dequantize(self) -> torch.Tensor:
        """``W [N, K]`` in float32."""
        g = self.group_of_channel()
        zeros = (self.zeros.float() if self.zeros is not None
                 else torch.full_like(self.scales, float(1 << (self.bits - 1)), dtype=torch.float32))
        return ((self.codes.float() - zeros[g]) * self.scales.float()[g]).t().contiguous()


@dataclass
class KernelWeight:
    """The packed layout the kernels read (see the module doc); one per linear layer."""

    #: int32 ``[K / P, N]``, ``P = 32 // bits`` codes per word along K; strides ``(1, K / P)``.
    qweight: torch.Tensor
    #: ``[K / group_size, N]`` float16, bfloat16 or float32 (the narrowest that holds them exactly).
    scales: torch.Tensor
    #: uint8 ``[K / group_size, N]`` (int16 for a zero of 256); None: symmetric.
    zeros: torch.Tensor | None
    #: int32 ``[K]``: input channel of each kernel row; None: identity.
    perm: torch.Tensor | None
    bits: int
    group_size: int

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * (32 // self.bits)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]


def check_shape(bits: int, group_size: int, in_features: int, where: str) -> None:
    """Raises ``ModelLoadError`` unless the kernels can hold a ``bits``-bit weight of
    ``in_features`` inputs in groups of ``group_size``."""
    if bits not in SUPPORTED_BITS:
        raise ModelLoadError(f"{where}: bits {bits} is not supported; accepted: {', '.join(map(str, SUPPORTED_BITS))}")
    if group_size <= 0 or in_features % group_size:
        raise ModelLoadError(f"{where}: group_size {group_size} does not divide the layer's input size "
                             f"{in_features}; accepted: a divisor of {in_features} (or -1, one group)")
    if group_size % GROUP_ALIGN:
        raise ModelLoadError(f"{where}: group_size {group_size} is not a multiple of {GROUP_ALIGN}; "
                             "accepted: 32, 64, 128 (any multiple of 16), or -1")


def check_group_size_field(value: object, field: str, one_group: str | None = None) -> None:
    """Raises ``ModelLoadError`` unless a config's ``group_size`` is a positive multiple of
    ``GROUP_ALIGN`` (or -1, where ``one_group`` says how the format spells one group per channel)."""
    if isinstance(value, int) and ((one_group is not None and value == -1) or (value > 0 and not value % GROUP_ALIGN)):
        return
    accepted = f"32, 64, 128 (any multiple of {GROUP_ALIGN})" + (f", or {one_group}" if one_group else "")
    raise ModelLoadError(f"{field}: invalid value {value!r}; accepted: {accepted}")


def compact_scales(scales: torch.Tensor) -> torch.Tensor:
    """The scales in float16 or bfloat16 when that loses nothing, else float32."""
    if scales.dtype in (torch.float16, torch.bfloat16):
        return scales.contiguous()
    s = scales.float()
    for dtype in (torch.float16, torch.bfloat16):
        narrow = s.to(dtype)
        if bool(torch.equal(narrow.float(), s)):
            return narrow.contiguous()
    return s.contiguous()


def to_kernel_layout(w: IntWeight, where: str) -> KernelWeight:
    """Repacks ``w`` for the kernels; ``where`` (the layer) goes into error messages."""
    k, n = w.codes.shape
    check_shape(w.bits, w.group_size, k, where)
    num_groups = k // w.group_size
    if tuple(w.scales.shape) != (num_groups, n):
        raise ModelLoadError(f"{where}: scales of shape {tuple(w.scales.shape)}; expected ({num_groups}, {n}) "
                             f"for {k} inputs in groups of {w.group_size}")
    if w.zeros is not None and tuple(w.zeros.shape) != (num_groups, n):
        raise ModelLoadError(f"{where}: zero points of shape {tuple(w.zeros.shape)}; expected ({num_groups}, {n})")
    codes, perm = w.codes, None
    if w.g_idx is not None:
        g_idx = w.g_idx.long()
        if g_idx.shape != (k,) or bool(((g_idx < 0) | (g_idx >= num_groups)).any()):
            raise ModelLoadError(f"{where}: g_idx must hold {k} group numbers in [0, {num_groups})")
        order = torch.sort(g_idx, stable=True).indices
        plain = torch.arange(k, device=g_idx.device) // w.group_size
        if not bool(torch.equal(g_idx[order], plain)):
            raise ModelLoadError(f"{where}: g_idx does not put {w.group_size} input channels in each group "
                                 f"(group_size {w.group_size}); the checkpoint's g_idx and group_size disagree")
        if not bool(torch.equal(order, torch.arange(k, device=order.device))):
            codes, perm = codes[order], order.to(torch.int32).contiguous()
    zeros = None
    if w.zeros is not None:
        # uint8 unless a GPTQ v1 checkpoint's wrapped zero (2**bits, see the gptq plugin) needs more.
        zeros = w.zeros.to(torch.uint8 if int(w.zeros.max()) < 256 else torch.int16).contiguous()
    rows = plane_order(k, w.bits, w.group_size).to(codes.device)
    return KernelWeight(output_major(pack_int32(codes[rows], w.bits, 0)), compact_scales(w.scales), zeros, perm,
                        w.bits, w.group_size)


def plane_words(group_size: int, bits: int) -> int:
    """``L``: words per plane block (see the module doc), the largest power of two <= 16 dividing
    the words of one group, so a block never straddles groups."""
    words = group_size // (32 // bits)
    plane = 1
    while plane < 16 and words % (2 * plane) == 0:
        plane *= 2
    return plane


def plane_order(k: int, bits: int, group_size: int) -> torch.Tensor:
    """For packed row ``r`` (word ``r // P``, bit slot ``r % P``), the input row it holds."""
    per_word, plane = 32 // bits, plane_words(group_size, bits)
    r = torch.arange(k)
    word, slot = r // per_word, r % per_word
    return (word // plane) * (per_word * plane) + slot * plane + word % plane


def output_major(qweight: torch.Tensor) -> torch.Tensor:
    """``qweight`` ``[K / P, N]`` with strides ``(1, K / P)`` (each output channel's words contiguous)."""
    return qweight.t().contiguous().t()


def dequantize_kernel_weight(kw: KernelWeight) -> torch.Tensor:
    """``W [N, K]`` float32 in the original input-channel order (the reference's weight)."""
    packed = unpack_int32(kw.qweight, kw.bits, 0).float()
    rows = plane_order(packed.shape[0], kw.bits, kw.group_size).to(packed.device)
    codes = torch.empty_like(packed).index_copy_(0, rows, packed)
    rows = torch.arange(codes.shape[0], device=codes.device) // kw.group_size
    zeros = kw.zeros.float()[rows] if kw.zeros is not None else float(1 << (kw.bits - 1))
    w = (codes - zeros) * kw.scales.float()[rows]
    if kw.perm is not None:
        w = torch.empty_like(w).index_copy_(0, kw.perm.long(), w)
    return w.t()


def wna16_linear_torch(x: torch.Tensor, kw: KernelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: dequantize to ``x.dtype``, then ``F.linear``. Correct everywhere, and the
    CPU path; it rebuilds the dense weight on every call."""
    return F.linear(x, dequantize_kernel_weight(kw).to(x.dtype), bias)


def wna16_linear(x: torch.Tensor, kw: KernelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias``: the Triton kernel on CUDA, the torch reference elsewhere."""
    if x.device.type == "cuda":
        from engine_quant_wna16.kernels import wna16_gemm

        return wna16_gemm(x, kw, bias)
    return wna16_linear_torch(x, kw, bias)
