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


# --------------------------------------------------------------------------------------------
# The CUDA kernels' row layout


def packed_row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row in the kernels' layout (``pack``): the GGUF row's bytes, padded to 16."""
    return -(-row_bytes(qtype, in_features) // 16) * 16


def pack(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF blocks ``uint8 [rows, row_bytes]`` -> the CUDA kernels' layout, same bytes regrouped.

    Within each row the fields of all its blocks are gathered into contiguous runs, codes first,
    so that a row's codes are 4-byte aligned and read as int32 words (the GGUF blocks of Q4_0
    (18 bytes), Q8_0 (34) and Q6_K (210) are only 2-byte aligned); each row is padded to a multiple
    of 16 bytes. Memory stays the same (up to 15 bytes a row). Per row, NB = blocks:

    | type | runs |
    |---|---|
    | Q4_K | unchanged (144-byte super-blocks are 16-byte aligned) |
    | Q8_0 | codes ``int8 [32 NB]``, ``d`` f16 ``[NB]`` |
    | Q4_0 | codes ``[16 NB]`` (each block's 16 bytes as in GGUF), ``d`` f16 ``[NB]`` |
    | Q4_1 | codes ``[16 NB]``, ``d`` f16 ``[NB]``, ``m`` f16 ``[NB]`` |
    | Q6_K | ``ql [128 NB]``, ``qh [64 NB]``, ``scales`` int8 ``[16 NB]``, ``d`` f16 ``[NB]`` |
    """
    if qtype == Q4_K:
        return blocks
    rows = blocks.shape[0]
    nbytes = KEPT[qtype][1]
    b = blocks.reshape(rows, -1, nbytes)
    fields = {Q8_0: ((2, 34), (0, 2)), Q4_0: ((2, 18), (0, 2)), Q4_1: ((4, 20), (0, 2), (2, 4)),
              Q6_K: ((0, 128), (128, 192), (192, 208), (208, 210))}[qtype]
    parts = [b[..., lo:hi].reshape(rows, -1) for lo, hi in fields]
    width = blocks.shape[1]
    pad = -(-width // 16) * 16 - width
    if pad:
        parts.append(blocks.new_zeros(rows, pad))
    return torch.cat(parts, dim=1)


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
