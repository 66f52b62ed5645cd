"""GGML block layouts the plugin keeps, and their dequantization in torch (the CPU path and the
reference the Triton kernels are tested against).

A quantized weight ``[out, in]`` is stored as ``uint8 [out, in / block_elems * block_bytes]``: each
row is its own run of blocks, so rows can be sliced, permuted and stacked as byte rows. The
layouts (ggml-common.h, all little-endian):

| type | elems | bytes | block |
|---|---|---|---|
| Q4_0 | 32 | 18 | ``d`` f16; ``qs[16]``: element i is ``qs[i] & 15`` (i < 16) or ``qs[i-16] >> 4``; w = d * (q - 8) |
| Q4_1 | 32 | 20 | ``d`` f16, ``m`` f16, ``qs[16]`` as Q4_0; w = d * q + m |
| Q8_0 | 32 | 34 | ``d`` f16, ``qs`` int8[32]; w = q * d |
| Q4_K | 256 | 144 | ``d``, ``dmin`` f16; ``scales[12]``: eight 6-bit (scale, min) pairs; ``qs[128]``: 64-element chunk j holds sub-block 2j in the low nibbles of ``qs[32j:32j+32]`` and 2j+1 in the high ones; w = (d * sc) * q - dmin * m |
| Q6_K | 256 | 210 | ``ql[128]`` low 4 bits, ``qh[64]`` high 2 bits, ``scales`` int8[16] (one per 16 elements), ``d`` f16; w = (d * sc) * (q - 32) |

The float operations happen in the order the ``gguf`` package's numpy code does them, in
float32, so the results are bit-identical to ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import torch

# GGMLQuantizationType values (stable in the file format).
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, BF16 = 0, 1, 2, 3, 8, 12, 14, 30
#: types the plugin keeps in their blocks: type -> (elements per block, bytes per block).
KEPT: dict[int, tuple[int, int]] = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144),
                                   Q6_K: (256, 210)}
KEPT_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q6_K: "Q6_K"}
FLOAT_TYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}


def type_name(qtype: int) -> str:
    """``Q4_K`` for 12; the gguf package's name for any other type, or the number."""
    if qtype in KEPT_NAMES:
        return KEPT_NAMES[qtype]
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(qtype).name
    except (ImportError, ValueError):
        return str(qtype)


def type_from_name(name: str) -> int:
    """The kept type called ``name`` (case-insensitive); ValueError naming the accepted ones."""
    for qtype, known in KEPT_NAMES.items():
        if known.lower() == name.strip().lower():
            return qtype
    raise ValueError(f"'{name}'; accepted: {', '.join(KEPT_NAMES.values())}")


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of ``in_features`` elements; ValueError where the row is not whole blocks."""
    elems, nbytes = KEPT[qtype]
    if in_features % elems:
        raise ValueError(f"a {type_name(qtype)} row holds whole blocks of {elems} elements; "
                         f"{in_features} elements is not a multiple")
    return in_features // elems * nbytes


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from the last dim's 2 bytes, as float32 (keeps a trailing dim of 1)."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2n]``: the n low nibbles, then the n high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 2:18]).to(torch.int16) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return d * _nibbles(b[..., 4:20]).float() + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2])
    return b[..., 2:34].contiguous().view(torch.int8).float() * d


def q4_k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs of Q4_K's 12 scale bytes ``[..., 12]`` -> ``[..., 8]`` each.

    Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7: the
    nibbles of bytes 8-11 (low: scale, high: min) topped by the 2 spare high bits of bytes 0-3
    (scales) and 4-7 (mins).
    """
    s = scales.to(torch.int32)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = q4_k_scale_min(b[..., 4:16])
    dsc = (d * sc.float()).unsqueeze(-1)  # [..., 8, 1]
    dm = (dmin * mn.float()).unsqueeze(-1)
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=-2).reshape(*b.shape[:-1], 8, 32).float()
    return (dsc * q - dm).reshape(*b.shape[:-1], 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 2, 32)   # (half h, 32-byte run a, l)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)  # (half h, -, l)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[..., 208:210])
    # Quarter t of half h: low 4 bits from run t % 2, nibble t // 2; high 2 bits at qh >> 2t.
    low = torch.stack([ql & 15, ql >> 4], dim=-3).reshape(*lead, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(4, 1)
    high = (qh >> shifts) & 3
    q = ((low | (high << 4)).to(torch.int16) - 32).float().reshape(*lead, 16, 16)
    return ((d * sc).unsqueeze(-1) * q).reshape(*lead, 256)


_DEQUANT = {Q4_0: _q4_0, Q4_1: _q4_1, Q8_0: _q8_0, Q4_K: _q4_k, Q6_K: _q6_k}


def dequantize(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """``uint8 [rows, row_bytes]`` of a kept type -> ``float32 [rows, in_features]``."""
    elems, nbytes = KEPT[qtype]
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, nbytes)
    return _DEQUANT[qtype](b).reshape(rows, b.shape[1] * elems)


#: rows ``exact_q8_0`` checks per step.
_EXACT_CHUNK_ROWS = 1024


def exact_q8_0(weight: torch.Tensor) -> torch.Tensor | None:
    """float32 ``[rows, K]`` -> its Q8_0 blocks where every block is exactly a Q8_0 block's values
    (``dequantize`` gives ``weight`` back bit for bit, as for a GGUF's Q8_0 tensor after its
    conversion), else None.

    llama.cpp's Q8_0 stores ``d = amax / 127`` (float16) and ``q = round(w / d)``; a block that
    came from Q8_0 has its largest code at +-127, so the same rule finds its ``d`` and codes.
    """
    rows, k = weight.shape
    if k % 32 or weight.dtype != torch.float32:
        return None
    blocks = torch.empty((rows, k // 32 * 34), dtype=torch.uint8, device=weight.device)
    # A chunk of rows at a time: the whole-tensor temporaries (four of the weight's size) were
    # fresh pages on every start, 0.6 s of system time for the default model's 113 MB LM head.
    for start in range(0, rows, _EXACT_CHUNK_ROWS):
        chunk = weight[start:start + _EXACT_CHUNK_ROWS]
        w = chunk.reshape(chunk.shape[0], k // 32, 32)
        d = (w.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
        inv = torch.where(d == 0, torch.zeros_like(d, dtype=torch.float32), 1 / d.float())
        q = torch.round(w * inv).clamp(-127, 127).to(torch.int8)
        part = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(chunk.shape[0], -1)
        if not torch.equal(dequantize(part, Q8_0), chunk):
            return None
        blocks[start:start + _EXACT_CHUNK_ROWS] = part
    return blocks


# --------------------------------------------------------------------------------------------
# The CUDA kernels' row layout ("planes")

#: row alignment of the planes layout in bytes: a row is a whole number of 16-word runs, so a row
#: stride in int32 words is divisible by 16 and Triton vectorises every code load to 16 bytes.
ROW_ALIGN = 64


def packed_row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row in the kernels' layout (``pack``): at least 16 spare bytes, padded to ``ROW_ALIGN``."""
    k = in_features
    row_bytes(qtype, k)  # validates whole blocks
    width = {Q4_0: k // 2 + k // 16, Q4_1: k // 2 + k // 8, Q8_0: k + k // 16,
             Q4_K: k // 2 + k // 64 + k // 16, Q6_K: k // 2 + k // 4 + k // 16 + k // 128}[qtype]
    return -(-(width + 16) // ROW_ALIGN) * ROW_ALIGN  # 16 spare bytes: the GEMV reads scale runs as 4-entry vectors


def _codes(b: torch.Tensor, qtype: int) -> torch.Tensor:
    """The unsigned codes of blocks ``[rows, nb, bytes]`` in element order -> int64 ``[rows, K]``
    (Q8_0: the int8 code's byte; Q6_K: the 6-bit code before its -32)."""
    rows = b.shape[0]
    if qtype == Q8_0:
        return b[..., 2:34].to(torch.int64).reshape(rows, -1)
    if qtype in (Q4_0, Q4_1):
        return _nibbles(b[..., 2:18] if qtype == Q4_0 else b[..., 4:20]).to(torch.int64).reshape(rows, -1)
    if qtype == Q4_K:
        qs = b[..., 16:144].reshape(rows, -1, 4, 32)
        return torch.stack([qs & 15, qs >> 4], dim=-2).to(torch.int64).reshape(rows, -1)
    ql = b[..., 0:128].reshape(rows, -1, 2, 2, 32)
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = torch.stack([ql & 15, ql >> 4], dim=-3).reshape(rows, -1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(4, 1)
    return (low | (((qh >> shifts) & 3) << 4)).to(torch.int64).reshape(rows, -1)


def _words(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 ``[..., slots, words]`` of ``bits``-bit fields -> int32 ``[..., words]``: slot i of
    a word at bits ``bits * i``."""
    shifts = torch.arange(fields.shape[-2], device=fields.device, dtype=torch.int64) * bits
    w = (fields << shifts[:, None]).sum(-2)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def _as_bytes(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(rows, -1)


def pack(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF blocks ``uint8 [rows, row_bytes]`` -> the CUDA kernels' layout: the same quantized
    data rearranged into per-row *planes* (``uint8 [rows, packed_row_bytes]``).

    Each row (output channel) is its own run, so rows slice and stack as before. Within a row the
    codes come first, as int32 words in *plane order*: a 16-byte run of 4 words (one thread's
    vector load) holds a *unit* of consecutive inputs, and bit slot ``i`` of word ``j`` of the
    unit holds input ``4 i + j`` of it, so slot ``i`` of the 4 words pairs with 4 consecutive
    activations (one vector load). Then the scales, one run each. Per row of K inputs:

    | type | unit | runs |
    |---|---|---|
    | Q4_0 | 32 (a block) | codes ``int32 [K/8]`` (nibble slot i of word j: input 4i+j), ``d`` f16 ``[K/32]`` |
    | Q4_1 | 32 (a block) | codes as Q4_0, ``d, m`` f16 pairs ``[K/32]`` (GGUF's first 4 bytes) |
    | Q8_0 | 16 (half a block) | codes ``int32 [K/4]`` (byte slot i of word j: input 4i+j of the half), ``d`` f16 ``[K/32]`` |
    | Q4_K | 32 (a sub-block) | codes as Q4_0, ``d, dmin`` f16 pairs ``[K/256]``, (scale, min) ``uint8`` pairs ``[K/32]`` (the 6-bit fields unpacked) |
    | Q6_K | 64 | low nibbles ``int32 [K/8]`` (two 4-word halves a unit: slot i of word j of half h is input 32h+4i+j), high 2 bits ``int32 [K/16]`` (slot 8h+i of word j, same input), scales int8 ``[K/16]``, ``d`` f16 ``[K/256]`` |

    Rows are zero-padded (16 to 79 bytes) to a multiple of ``ROW_ALIGN``. Memory: GGUF's bytes (Q4_K:
    148 instead of 144 bytes per 256 weights, for the unpacked 6-bit scales) plus under 80 bytes a row. Every bit of
    the GGUF blocks is kept: ``dequantize_planes`` gives the same values as ``dequantize``.
    """
    rows = blocks.shape[0]
    elems, nbytes = KEPT[qtype]
    k = blocks.shape[1] // nbytes * elems
    b = blocks.reshape(rows, -1, nbytes)
    q = _codes(b, qtype)
    parts: list[torch.Tensor] = []
    if qtype == Q8_0:
        parts.append(_as_bytes(_words(q.reshape(rows, -1, 4, 4), 8), rows))
        parts.append(_as_bytes(b[..., 0:2], rows))
    elif qtype == Q6_K:
        q6 = q.reshape(rows, -1, 2, 8, 4)  # (unit of 64, half h, slot i, word j)
        parts.append(_as_bytes(_words(q6 & 15, 4), rows))
        hi = (q6 >> 4).reshape(rows, -1, 16, 4)  # slot 8h + i of word j
        parts.append(_as_bytes(_words(hi, 2), rows))
        parts.append(_as_bytes(b[..., 192:208], rows))
        parts.append(_as_bytes(b[..., 208:210], rows))
    else:
        parts.append(_as_bytes(_words(q.reshape(rows, -1, 8, 4), 4), rows))
        if qtype == Q4_0:
            parts.append(_as_bytes(b[..., 0:2], rows))
        elif qtype == Q4_1:
            parts.append(_as_bytes(b[..., 0:4], rows))
        else:
            parts.append(_as_bytes(b[..., 0:4], rows))
            sc, mn = q4_k_scale_min(b[..., 4:16])
            parts.append(_as_bytes(torch.stack([sc, mn], dim=-1).to(torch.uint8), rows))
    data = torch.cat(parts, dim=1)
    width = packed_row_bytes(qtype, k)
    if data.shape[1] < width:
        data = torch.cat([data, data.new_zeros(rows, width - data.shape[1])], dim=1)
    return data


def _f16_run(data: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return data[:, start:start + 2 * count].contiguous().view(torch.float16).float()


def dequantize_planes(data: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """``pack``'s layout -> ``float32 [rows, in_features]``, the float operations of ``dequantize``
    (so bit-identical to it): the torch reference of the kernels' layout."""
    rows, k = data.shape[0], in_features
    code_bytes = k if qtype == Q8_0 else k // 2
    words = data[:, :code_bytes].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF

    def slots(w: torch.Tensor, bits: int, n: int) -> torch.Tensor:  # [..., words] -> [..., n, words]
        shifts = torch.arange(n, device=w.device, dtype=torch.int64) * bits
        return (w.unsqueeze(-2) >> shifts[:, None]) & ((1 << bits) - 1)

    if qtype == Q8_0:
        q = slots(words.reshape(rows, -1, 4), 8, 4).reshape(rows, k // 32, 32)
        q = q - 256 * (q >= 128)  # the int8 codes
        d = _f16_run(data, k, k // 32).unsqueeze(-1)
        return (q.float() * d).reshape(rows, k)
    if qtype == Q6_K:
        lo = slots(words.reshape(rows, -1, 2, 4), 4, 8)                         # (unit, h, i, j)
        hw = data[:, k // 2:k // 2 + k // 4].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        hi = slots(hw.reshape(rows, -1, 4), 2, 16).reshape(rows, -1, 2, 8, 4)
        q = ((lo | (hi << 4)) - 32).float().reshape(rows, k // 16, 16)
        sc = data[:, 3 * k // 4:3 * k // 4 + k // 16].contiguous().view(torch.int8).float()
        d = _f16_run(data, 3 * k // 4 + k // 16, k // 256)
        dsc = d.repeat_interleave(16, dim=1) * sc
        return (dsc.unsqueeze(-1) * q).reshape(rows, k)
    q = slots(words.reshape(rows, -1, 4), 4, 8).reshape(rows, k // 32, 32)
    if qtype == Q4_0:
        d = _f16_run(data, k // 2, k // 32).unsqueeze(-1)
        return (d * (q - 8).float()).reshape(rows, k)
    if qtype == Q4_1:
        dm = _f16_run(data, k // 2, 2 * (k // 32)).reshape(rows, -1, 2)
        return (dm[..., 0:1] * q.float() + dm[..., 1:2]).reshape(rows, k)
    dm = _f16_run(data, k // 2, 2 * (k // 256)).reshape(rows, -1, 2).repeat_interleave(8, dim=1)
    scmn = data[:, k // 2 + k // 64:k // 2 + k // 64 + k // 16].reshape(rows, -1, 2).float()
    dsc = (dm[..., 0] * scmn[..., 0]).unsqueeze(-1)
    dmn = (dm[..., 1] * scmn[..., 1]).unsqueeze(-1)
    return (dsc * q.float() - dmn).reshape(rows, k)


# Scale fields of each type (byte offsets) and the magnitude a random block's scale gets, so a
# dummy weight's entries stay near 1e-2 like the engine's float dummies.
_SCALE_FIELDS = {Q4_0: ((0, 2),), Q4_1: ((0, 2), (2, 4)), Q8_0: ((0, 2),), Q4_K: ((0, 2), (2, 4)),
                 Q6_K: ((208, 210),)}
_SCALE_SIZE = {Q4_0: 1.2e-3, Q4_1: 6e-4, Q8_0: 8e-5, Q4_K: 1e-5, Q6_K: 2.5e-6}


def random_blocks(rows: int, in_features: int, qtype: int, generator: torch.Generator,
                  device: torch.device) -> torch.Tensor:
    """Well-formed random blocks (finite scales of a small magnitude, random codes), drawn on
    ``device``: the dummy weights of ``--load-format dummy``."""
    nbytes = KEPT[qtype][1]
    blocks = torch.randint(0, 256, (rows, row_bytes(qtype, in_features)), dtype=torch.uint8,
                           device=device, generator=generator)
    view = blocks.view(rows, -1, nbytes)
    for lo, hi in _SCALE_FIELDS[qtype]:
        scale = torch.empty(rows, view.shape[1], 1, device=device).uniform_(0.5, 1.0, generator=generator)
        view[..., lo:hi] = (scale * _SCALE_SIZE[qtype]).to(torch.float16).view(torch.uint8)
    if qtype == Q6_K:  # int8 sub-block scales: keep them small and of either sign
        view[..., 192:208] = torch.randint(-16, 17, view[..., 192:208].shape, dtype=torch.int8, device=device,
                                           generator=generator).view(torch.uint8)
    return blocks
