"""Launch shapes and launchers of the SGMV kernels (``engine_lora_triton.kernels``).

Block sizes come from host-side sizes only (``shrink_config``, ``expand_config``), so the grids
of a captured CUDA graph stay valid for every batch of the same size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton

from engine_lora_triton.kernels import _INTERPRETED, _expand_kernel, _shrink_kernel
from engine_lora_triton.slot_kernels import (
    _expand_dense_kernel,
    _expand_slots_kernel,
    _shrink_slots_kernel,
)

from engine.platforms import device_index


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv is a Triton ConstexprFunction: called from Python it costs about 3.6 us a call
    # (timeit, shared 2-core box), and the launchers run twice per LoRA layer of every forward.
    return -(-a // b)


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 132 (an H100/H200) under the interpreter, so CPU
    tests take the block sizes a GPU would."""
    if device.type != "cuda":
        return 132
    return _sm_count(device_index(device))


def _token_tile(num_segments: int, max_seg_len: int, col_tiles: int, sms: int) -> int:
    """The largest token tile (16-64) that still gives about two programs per SM."""
    for block in (64, 32):
        if block <= triton.next_power_of_2(max_seg_len) and \
                num_segments * _cdiv(max_seg_len, block) * col_tiles >= 2 * sms:
            return block
    return 16


def shrink_config(num_segments: int, max_seg_len: int, rows: int, k: int, sms: int) -> dict[str, int]:
    """Block sizes and warps of ``_shrink_kernel`` for a call's host-side sizes."""
    return dict(_shrink_config(num_segments, max_seg_len, rows, k, sms))


@functools.lru_cache(maxsize=256)
def _shrink_config(num_segments: int, max_seg_len: int, rows: int, k: int, sms: int) -> dict[str, int]:
    if max_seg_len <= 1:
        # One token per program, latency-bound on the loop over K: one or two rows a program give
        # even batch 1 a program per SM or so, and K tiles of 4-8K elements few iterations. On an
        # H200 (bench_sgmv.py --sweep, rank 16): batch 1 1.2-2.3 us a shrink against 2.0-5.9 us
        # with 4 rows over 2K, batch 64 3.0-9.9 us against 7.3-25.9 us with 8-16 rows over 0.5-1K.
        block_r = min(1 if num_segments < 16 else 2, triton.next_power_of_2(rows))
        block_k = min(triton.next_power_of_2(k), 8192 if block_r == 1 and k > 4096 else 4096)
        return dict(BLOCK_T=1, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=8 if block_k * block_r >= 8192 else 4,
                    num_stages=2)
    block_r = min(64, max(16, triton.next_power_of_2(rows)))
    block_t = _token_tile(num_segments, max_seg_len, _cdiv(rows, block_r), sms)
    return dict(BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=min(64, max(16, triton.next_power_of_2(k))), num_warps=4,
                num_stages=3)


def slot_shrink_config(num_slots: int, rows: int, k: int, sms: int) -> dict[str, int]:
    """Block sizes of ``_shrink_slots_kernel``: 16-row tiles of A, K chunks of 1024 in 128-wide
    tiles. On an H200 (bench_sgmv.py --sweep, decode 64 x 8 adapters) that took qkv/o/gate_up/down
    4.3/2.8/4.0/4.5 us, against 4.1/2.8/3.9/4.1 us for the fastest, chunks of 256, which leave the
    expand 4 times the partial sums to add (K 4096: 4 chunks; down's 14336: 14). Only ``k``
    decides them; the other arguments keep the signature of ``shrink_config``."""
    return dict(_slot_shrink_config(k))


@functools.lru_cache(maxsize=256)
def _slot_shrink_config(k: int) -> dict[str, int]:
    chunk = min(1024, max(16, triton.next_power_of_2(k)))
    return dict(BLOCK_R=16, BLOCK_K=min(128, chunk), K_CHUNK=chunk, num_warps=4, num_stages=3)


@functools.lru_cache(maxsize=256)
def _segment_passes(num_segments: int) -> dict[str, int]:
    """The slot kernels' SEGS (segments rounded up to a power of two) and BLOCK_S (segments a pass,
    16 to 64)."""
    segs = 1 << (num_segments - 1).bit_length()  # triton.next_power_of_2, without its call cost
    return dict(SEGS=segs, BLOCK_S=min(64, max(16, segs)))


def _check_shrink(x: torch.Tensor, a: torch.Tensor) -> None:
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"shrink: x {tuple(x.shape)} must be [T, K] and weights {tuple(a.shape)} [slots, rows, K]")
    if a.dtype != x.dtype:
        raise ValueError(f"shrink: weights dtype {a.dtype} must be x's dtype {x.dtype}")


def sgmv_shrink_slots(x: torch.Tensor, a: torch.Tensor, seg_indptr: torch.Tensor, weight_indices: torch.Tensor,
                      ranks: torch.Tensor, num_segments: int, pdl: bool = False,
                      config: dict[str, int] | None = None) -> torch.Tensor:
    """Shrink of a decode batch (segments of at most one token) as float32 partial sums over K
    chunks, ``[chunks, T, ROWS]``, for ``sgmv_expand`` to add up: a program per (slot, row tile,
    chunk) reads its tile of ``a`` once for all the slot's tokens. Entries of tokens in no segment
    or on rank-0 slots are unspecified (the expand never reads them)."""
    _check_shrink(x, a)
    tokens, k = x.shape
    rows = a.shape[1]
    cfg = config or _slot_shrink_config(k)
    chunks = _cdiv(k, cfg["K_CHUNK"])
    p = torch.empty((chunks, tokens, rows), dtype=torch.float32, device=x.device)
    if tokens == 0 or num_segments == 0 or rows == 0:
        return p
    _shrink_slots_kernel[(a.shape[0], _cdiv(rows, cfg["BLOCK_R"]), chunks)](
        x, a, p, seg_indptr, weight_indices, ranks, num_segments,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), p.stride(0), p.stride(1), p.stride(2),
        ROWS=rows, K=k, **_segment_passes(num_segments), WIDEN=_INTERPRETED,
        IEEE=x.dtype == torch.float32, PDL=pdl, launch_pdl=pdl, **cfg)
    return p


def expand_config(num_segments: int, max_seg_len: int, width: int, r: int, sms: int,
                  dense: bool = False) -> dict[str, int]:
    """Block sizes and warps of ``_expand_kernel`` for a call's host-side sizes (``dense``: decode
    batches of 16+ segments take ``_expand_dense_kernel``, else ``_expand_slots_kernel``)."""
    return dict(_expand_config(num_segments, max_seg_len, width, r, sms, dense))


@functools.lru_cache(maxsize=256)
def _expand_config(num_segments: int, max_seg_len: int, width: int, r: int, sms: int,
                   dense: bool = False) -> dict[str, int]:
    if max_seg_len <= 1 and num_segments >= 16 and dense:
        # A decode batch: one program per column tile over every token and slot, 32 columns
        # where 64 would leave SMs without a program.
        block_r = max(16, triton.next_power_of_2(r))
        return dict(DENSE=1, BLOCK_N=64 if _cdiv(width, 64) >= sms else 32, BLOCK_R=block_r,
                    num_warps=8 if block_r >= 64 else 4, num_stages=1)
    if max_seg_len <= 1 and num_segments >= 16:
        # A decode batch: one program per (slot, group of column tiles) over the batch's tokens on
        # that slot (``_expand_slots_kernel``), so each adapter's B is read once, not once per
        # token (one column tile a program unless the config's TILES groups them).
        # Rank 64 takes 8 warps: with 4, y of 64 tokens and its partial sums spilled (sm_90 compile).
        block_r = max(16, triton.next_power_of_2(r))
        return dict(SLOTS=1, BLOCK_T=1, BLOCK_N=64, BLOCK_R=block_r, num_warps=8 if block_r >= 64 else 4,
                    num_stages=1)
    if max_seg_len <= 1:
        # H200 sweep: 32 columns a program at batch 1 (1.1-1.6 us a call).
        return dict(BLOCK_T=1, BLOCK_N=32, BLOCK_R=triton.next_power_of_2(r), num_warps=4, num_stages=1)
    block_n = 64 if width >= 64 else max(16, triton.next_power_of_2(width))
    return dict(BLOCK_T=_token_tile(num_segments, max_seg_len, _cdiv(width, block_n), sms), BLOCK_N=block_n,
                BLOCK_R=max(16, triton.next_power_of_2(r)), num_warps=4, num_stages=1)


def split_chunk(num_segments: int, max_seg_len: int, rows: int, k: int, sms: int) -> int:
    """The K chunk of a split shrink (``sgmv_shrink(split=True)``) of a multi-token batch, or 0:
    split only batches of fewer than half an SM count of (token tile, row tile) programs (a
    128-token prefill: 8 programs, each looping over all of K), into chunks of 256 or more, about
    one program per SM, at most 32 chunks. Batches of many token tiles keep whole-K programs."""
    return _split_chunk(num_segments, max_seg_len, rows, k, sms)


@functools.lru_cache(maxsize=256)
def _split_chunk(num_segments: int, max_seg_len: int, rows: int, k: int, sms: int) -> int:
    if max_seg_len <= 1:
        return 0
    cfg = _shrink_config(num_segments, max_seg_len, rows, k, sms)
    programs = num_segments * _cdiv(max_seg_len, cfg["BLOCK_T"]) * _cdiv(rows, cfg["BLOCK_R"])
    if 2 * programs >= sms:
        return 0
    chunk = 256
    while chunk < k and (_cdiv(k, chunk) > 32 or programs * _cdiv(k, chunk) > sms):
        chunk *= 2
    return chunk if chunk < k else 0


def sgmv_shrink(x: torch.Tensor, a: torch.Tensor, seg_indptr: torch.Tensor, weight_indices: torch.Tensor,
                ranks: torch.Tensor, num_segments: int, max_seg_len: int, pdl: bool = False,
                config: dict[str, int] | None = None, split: bool = False) -> torch.Tensor:
    """``[T, ROWS]`` in x's dtype: each token's row times its segment's ``a[slot]`` (``[ROWS, K]``)
    transposed; zeros for tokens of rank-0 slots (rows of tokens in no segment are unspecified).
    ``pdl``: launch with programmatic dependent launch (``has_pdl``). ``config`` overrides
    ``shrink_config`` (the benchmark's sweeps). ``split``: where ``split_chunk`` (or the config's
    ``K_CHUNK``) splits K, float32 partial sums ``[chunks, T, ROWS]`` instead, for ``sgmv_expand``
    to add up."""
    _check_shrink(x, a)
    tokens, k = x.shape
    rows = a.shape[1]
    sms = sm_count(x.device)
    cfg = config or _shrink_config(num_segments, max_seg_len, rows, k, sms)  # the cached dict, not a copy
    chunk = cfg.get("K_CHUNK", 0) or (_split_chunk(num_segments, max_seg_len, rows, k, sms) if split else 0)
    if "K_CHUNK" in cfg:  # a sweep's config: the launch passes K_CHUNK itself, so it leaves **cfg
        cfg = {key: value for key, value in cfg.items() if key != "K_CHUNK"}
    chunks = _cdiv(k, chunk) if chunk else 1
    # Rows of tokens outside every segment (the padding of a CUDA-graph batch) are left unwritten:
    # expand never reads them, and a memset per call would cost a launch in every LoRA layer.
    if chunks > 1:
        y = torch.empty((chunks, tokens, rows), dtype=torch.float32, device=x.device)
    else:
        y = torch.empty((tokens, rows), dtype=x.dtype, device=x.device)
    if tokens == 0 or num_segments == 0 or max_seg_len == 0 or rows == 0:
        return y
    row_tiles = _cdiv(rows, cfg["BLOCK_R"])
    grid = (num_segments, _cdiv(max_seg_len, cfg["BLOCK_T"]), row_tiles * chunks)
    _shrink_kernel[grid](
        x, a, y, seg_indptr, weight_indices, ranks,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), y.stride(0) if chunks > 1 else 0,
        y.stride(-2), y.stride(-1),
        ROWS=rows, K=k, K_CHUNK=chunk if chunks > 1 else k, ROW_TILES=row_tiles, DOT=cfg["BLOCK_T"] > 1,
        WIDEN=_INTERPRETED, IEEE=x.dtype == torch.float32, PDL=pdl, launch_pdl=pdl, **cfg)
    return y


@functools.lru_cache(maxsize=64)
def _slice_plan(offsets: tuple[int, ...], out_cols: int, b_shape: tuple[int, ...]) -> tuple[list[int], list[int], int]:
    """The checked slices of an expand (a layer's are the same every call): the offsets padded to
    four, each slice's width, and the rank R."""
    offsets = tuple(int(o) for o in offsets)
    n_slices = len(offsets) - 1
    if not 1 <= n_slices <= 3:
        raise ValueError(f"expand: slice_offsets {list(offsets)} gives {n_slices} slices; 1 to 3 are supported")
    if any(hi < lo for lo, hi in zip(offsets, offsets[1:], strict=False)) or offsets[0] < 0 or offsets[-1] > out_cols:
        raise ValueError(f"expand: slice_offsets {list(offsets)} must rise within out's {out_cols} columns")
    if len(b_shape) != 3 or b_shape[1] < offsets[-1]:
        raise ValueError(f"expand: weights {b_shape} must be [slots, N >= {offsets[-1]}, R]")
    r = b_shape[2]
    widths = [hi - lo for lo, hi in zip(offsets, offsets[1:], strict=False)]
    return list(offsets) + [offsets[-1]] * (4 - len(offsets)), widths, r


def _slice_bounds(counts: list[int]) -> tuple[int, int, int]:
    """``_slice_of``'s bounds from each slice's count of column tiles (or groups): the end of
    slice 0's, the end of slice 1's (the total where there are fewer slices), and the total."""
    total = sum(counts)
    return (counts[0] if len(counts) > 1 else total, counts[0] + counts[1] if len(counts) > 2 else total, total)


def sgmv_expand(y: torch.Tensor, b: torch.Tensor, out: torch.Tensor, seg_indptr: torch.Tensor,
                weight_indices: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor,
                num_segments: int, max_seg_len: int, slice_offsets: Sequence[int], pdl: bool = False,
                config: dict[str, int] | None = None, dense: bool = False) -> None:
    """``out[t, off_i:off_i+1] += scalings[w] * y[t, i*R:(i+1)*R] @ b[w, off_i:off_i+1].T`` in
    place, ``w`` the slot of t's segment; rows of rank-0 slots are left as they are. ``config``
    overrides ``expand_config`` (``dense`` passed on to it)."""
    padded, widths, r = _slice_plan(tuple(slice_offsets), out.shape[1], tuple(b.shape))
    partials = y.dim() == 3  # float32 sums per K chunk (sgmv_shrink_slots, sgmv_shrink(split=True))
    if partials and y.dtype != torch.float32:
        raise ValueError(f"expand: partial sums y {tuple(y.shape)} must be float32, not {y.dtype}")
    if y.shape[-2:] != (out.shape[0], len(widths) * r):
        raise ValueError(f"expand: y {tuple(y.shape)} must be [T, n_slices * R] = [{out.shape[0]}, {len(widths) * r}]")
    if b.dtype != y.dtype and not partials:
        raise ValueError(f"expand: weights dtype {b.dtype} must be y's dtype {y.dtype}")
    if out.shape[0] == 0 or num_segments == 0 or max_seg_len == 0 or sum(widths) == 0 or r == 0:
        return
    cfg = config or _expand_config(num_segments, max_seg_len, sum(widths), r, sm_count(out.device), dense)
    tiles = [_cdiv(w, cfg["BLOCK_N"]) for w in widths]
    if cfg.get("DENSE"):
        tiles0, tiles01, total = _slice_bounds(tiles)
        _expand_dense_kernel[(total,)](
            y, b, out, seg_indptr, weight_indices, ranks, scalings, num_segments, *padded, tiles0, tiles01,
            y.stride(0) if partials else 0, y.stride(-2), y.stride(-1), b.stride(0), b.stride(1), b.stride(2),
            out.stride(0), out.stride(1),
            R=r, NUM_SLOTS=ranks.shape[0], **_segment_passes(num_segments), BLOCK_N=cfg["BLOCK_N"],
            BLOCK_R=cfg["BLOCK_R"], SPLITS=y.shape[0] if partials else 1, WIDEN=_INTERPRETED,
            IEEE=out.dtype == torch.float32, PDL=pdl, launch_pdl=pdl, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
        return
    if cfg.get("SLOTS"):
        # One column tile a program unless the config groups them (TILES): on an H200 (bench_sgmv.py
        # --sweep, decode 64 x 8 adapters, from a finished y) groups of 4 and 16 took qkv 4.1 -> 7.2 us,
        # gate_up 13.0 -> 23.1 us: a group's tiles run one after another, each store before the next
        # tile's loads.
        group = cfg.get("TILES") or 1
        groups0, groups01, total = _slice_bounds([_cdiv(t, group) for t in tiles])
        _expand_slots_kernel[(ranks.shape[0], total)](
            y, b, out, seg_indptr, weight_indices, ranks, scalings, num_segments, *padded, groups0, groups01,
            y.stride(0) if partials else 0, y.stride(-2), y.stride(-1), b.stride(0), b.stride(1), b.stride(2),
            out.stride(0), out.stride(1),
            R=r, **_segment_passes(num_segments), BLOCK_N=cfg["BLOCK_N"], BLOCK_R=cfg["BLOCK_R"],
            TILES=group, SPLITS=y.shape[0] if partials else 1,
            WIDEN=_INTERPRETED, IEEE=out.dtype == torch.float32, PDL=pdl, launch_pdl=pdl,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return
    tiles0, tiles01, total = _slice_bounds(tiles)
    grid = (num_segments, _cdiv(max_seg_len, cfg["BLOCK_T"]), total)
    _expand_kernel[grid](
        y, b, out, seg_indptr, weight_indices, ranks, scalings, *padded, tiles0, tiles01,
        y.stride(0) if partials else 0, y.stride(-2), y.stride(-1), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1),
        R=r, SPLITS=y.shape[0] if partials else 1, DOT=cfg["BLOCK_T"] > 1, WIDEN=_INTERPRETED,
        IEEE=out.dtype == torch.float32, PDL=pdl, launch_pdl=pdl, **cfg)


@functools.lru_cache(maxsize=8)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def has_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` may use programmatic dependent launch (CUDA sm_90+, compiled:
    not under Triton's interpreter, not on ROCm)."""
    if device.type != "cuda" or _INTERPRETED or torch.version.hip is not None:
        return False
    return _pdl_capable(device_index(device))
