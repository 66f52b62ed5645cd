"""Skinny GEMM for decode: ``y = x @ W^T (+ bias)`` with few rows of ``x`` (1..16), bf16/fp16.

A decode step at small batch reads every weight once per token, so its linear layers are bound by
the speed at which ``W`` ``[N, K]`` streams from memory, not by arithmetic. This kernel streams
``W`` in row blocks: the grid covers ``N`` in blocks of ``block_n`` rows and, where that leaves
too few programs to fill the GPU, ``K`` in ``split_k`` slices whose float32 partial sums a second
launch adds in a fixed order (deterministic, no atomics). Every program loads ``[block_n,
block_k]`` tiles of ``W`` along the contiguous ``K`` (16-byte vector loads) and accumulates in
float32; the output is rounded to the activation dtype once, after the bias is added.

Two tile kinds:

- ``fma``: elementwise multiply-accumulate into a ``[rows, block_n, block_k]`` float32 register
  tile, reduced over ``K`` once at the end (no tensor cores; taken at one row by default,
  ``GemvRule.fma_max_rows``).
- ``dot``: ``tl.dot`` of the ``[block_n, block_k]`` weight tile with ``x`` padded to 16 rows
  (tensor cores; the padding costs arithmetic, which a memory-bound kernel has to spare, and no
  memory traffic, since the padded rows are masked loads).

``norm_skinny_linear`` folds the RMSNorm (+ residual add) that precedes a projection into the
"fma" kind: each program normalizes the rows itself, so the norm needs no launch of its own.

``choose_config(m, n, k, sm_count)`` picks the kind and the tiles; its constants live in
``GemvRule`` so a tuning run (``plugins/platform-cuda/benchmarks/bench_gemv.py --sweep``) can change them in one place.
Only ``torch.empty`` allocates, and nothing reads device memory from the host, so the kernel can
be captured in a CUDA graph.

Agreement with ``F.linear``: both accumulate in float32 and round once, in a different order, so
an output differs from cuBLAS's by at most about one unit in the last place of the activation
dtype (bf16: relative 2**-8) plus the float32 reordering error (about ``K * 2**-24`` relative to
the sum of ``|x| * |w|``). The tests assert ``atol=rtol=1.6e-2`` for bf16 and ``2e-3`` for fp16
at unit-variance inputs scaled by ``1/sqrt(K)``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from engine_platform_cuda.gemv_tiles import _norm_rstd, _store_tile, _w_tile, _x_tile

if TYPE_CHECKING:
    from engine.layers.layernorm import PendingNorm

#: rows of ``x`` the kernel computes; more is a GEMM, left to cuBLAS.
MAX_ROWS = 16
#: activation dtypes the kernel takes (weights and bias in the same dtype).
DTYPES = (torch.bfloat16, torch.float16)
_KINDS = ("fma", "dot")
# Triton 3.6's interpreter (CPU tests) computes 16-bit tl.dot wrongly: there the tiles are widened
# to float32 first (exact products, as the GPU's float32 accumulation of 16-bit products).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The dot kind pads x to this many rows: tl.dot needs every dimension >= 16.
_DOT_ROWS = 16
#: most K steps of weights the "fma" kind requests before its PDL wait (registers held meanwhile).
MAX_PDL_STEPS = 4


@dataclass(frozen=True)
class GemvConfig:
    """One launch shape of the kernel."""

    #: "fma" (register multiply-accumulate) or "dot" (tensor cores, x padded to 16 rows).
    kind: str
    #: rows of W (outputs) per program; a power of two (>= 16 for "dot").
    block_n: int
    #: columns of W (the reduced dimension) per loop step; a power of two >= 16.
    block_k: int
    #: K slices; > 1 adds a second launch that sums the float32 partials in slice order.
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    #: "fma" kind launched with PDL: K steps of weights each program requests before its wait
    #: (1..``MAX_PDL_STEPS``, at most a slice's steps).
    pdl_steps: int = 1

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first field out of range."""
        if self.kind not in _KINDS:
            raise ValueError(f"GemvConfig.kind: invalid value {self.kind!r}; accepted: {', '.join(_KINDS)}")
        low_n = _DOT_ROWS if self.kind == "dot" else 1
        for name, value, low in (("block_n", self.block_n, low_n), ("block_k", self.block_k, 16)):
            if value < low or value & (value - 1):
                raise ValueError(f"GemvConfig.{name}: invalid value {value}; accepted: a power of two >= {low}")
        if self.split_k < 1:
            raise ValueError(f"GemvConfig.split_k: invalid value {self.split_k}; accepted: >= 1")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvConfig.num_warps: invalid value {self.num_warps}; accepted: 1, 2, 4, 8, 16")
        if self.num_stages < 1:
            raise ValueError(f"GemvConfig.num_stages: invalid value {self.num_stages}; accepted: >= 1")
        if not 1 <= self.pdl_steps <= MAX_PDL_STEPS:
            raise ValueError(f"GemvConfig.pdl_steps: invalid value {self.pdl_steps}; accepted: 1..{MAX_PDL_STEPS}")


@dataclass(frozen=True)
class GemvRule:
    """The constants of ``choose_config``: what a tuning run changes."""

    #: up to this many rows the "fma" kind is used, above it "dot". 1: at 2 rows the fma kind made
    #: Llama-3-8B's decode step 8.312 ms against 5.977 with the dot kind (H100, 2026-11-24,
    #: ``engine bench one-batch ... --batch-size "1 2"``; batch 1: 5.494 / 5.453 ms), and
    #: Qwen3-30B-A3B's 4.759 against 4.734 ms.
    fma_max_rows: int = 1
    #: float32 accumulator elements per program of the "fma" kind (rows * block_n * block_k);
    #: with 4 warps, 4096 is 32 registers a thread.
    fma_tile: int = 4096
    #: the "fma" kind's block_k at its widest block_n (it grows as block_n shrinks, up to K).
    fma_block_k: int = 512
    fma_num_warps: int = 4
    fma_num_stages: int = 1
    #: with PDL, the "fma" kind's weight steps requested before the wait (``GemvConfig.pdl_steps``;
    #: the ``cuda.pdl_preload`` option). H100, batch-1 decode, 2026-11-24: Qwen3-30B-A3B 2.940 ms a
    #: step at 1, 2.906 at 2, 2.900 at 3, 2.930 at 4 (one process, the decode graphs recaptured per
    #: value; docs/benchmarks.md has the CLI figures). With the RMSNorm folded in it stays 1: the
    #: norm's row tile holds registers already (3 steps: 194 registers a thread), and 2 ran slower.
    fma_pdl_steps: int = 3
    #: block_n candidates of the "dot" kind, largest first (64 lets Hopper use wgmma).
    dot_block_n: tuple[int, ...] = (64, 32, 16)
    dot_block_k: int = 128
    dot_num_warps: int = 4
    dot_num_stages: int = 4
    #: programs wanted per SM: block_n shrinks until the grid has this many (if it can).
    ctas_per_sm: int = 2
    #: K is split (up to ``ctas_per_sm`` programs per SM) when the N blocks alone give fewer than
    #: this many programs per SM and each would stream more than ``split_min_bytes`` of W: a
    #: program with little to read finishes in one memory round trip, and the second launch
    #: would cost more than it saves.
    split_below_per_sm: float = 1.0
    split_min_bytes: int = 32 * 1024
    #: the least W bytes one K slice of a program streams.
    slice_min_bytes: int = 4 * 1024
    #: most K slices.
    max_split_k: int = 32
    #: with the norm fused in (``norm_skinny_linear``): float32 elements of the row tile over which
    #: every program sums the squares (rows * columns; 4096 is 32 registers a thread at 4 warps).
    #: A row that fits in one tile is summed as ``kernels.rms_norm`` sums it; longer rows in
    #: tile-wide partial sums first.
    norm_row_tile: int = 4096


RULE = GemvRule()


def _pow2_at_most(value: int) -> int:
    return 1 << (max(1, value).bit_length() - 1)


@functools.lru_cache(maxsize=4096)  # per call of every eager linear layer: a layer's shapes repeat
def choose_config(m: int, n: int, k: int, sm_count: int, elem_bytes: int = 2,
                  rule: GemvRule = RULE) -> GemvConfig:
    """The launch shape for ``x [m, k] @ W[n, k]^T`` on a GPU with ``sm_count`` SMs.

    ``block_n`` is the largest candidate that still gives ``ctas_per_sm`` programs per SM; when
    even the smallest leaves fewer than ``split_below_per_sm`` per SM and each program would
    stream more than ``split_min_bytes`` of ``W``, ``K`` is split towards ``ctas_per_sm``.
    """
    want = rule.ctas_per_sm * sm_count
    k_pow2 = triton.next_power_of_2(max(k, 16))
    if m <= rule.fma_max_rows:
        rows = triton.next_power_of_2(m)
        block_n = max(1, _pow2_at_most(rule.fma_tile // (rows * min(rule.fma_block_k, k_pow2))))
        while block_n > 1 and triton.cdiv(n, block_n) < want:
            block_n //= 2
        # Fewer rows per program, longer K steps: the tile (the bytes a step has in flight) stays.
        block_k = min(k_pow2, max(16, rule.fma_tile // (rows * block_n)))
        cfg = GemvConfig("fma", block_n, block_k, num_warps=rule.fma_num_warps, num_stages=rule.fma_num_stages,
                         pdl_steps=rule.fma_pdl_steps)
    else:
        block_k = min(rule.dot_block_k, k_pow2)
        block_n = rule.dot_block_n[-1]
        for candidate in rule.dot_block_n:
            if triton.cdiv(n, candidate) >= want:
                block_n = candidate
                break
        cfg = GemvConfig("dot", block_n, block_k, num_warps=rule.dot_num_warps, num_stages=rule.dot_num_stages)
    n_blocks = triton.cdiv(n, cfg.block_n)
    bytes_per_program = cfg.block_n * k * elem_bytes
    if n_blocks < rule.split_below_per_sm * sm_count and bytes_per_program > rule.split_min_bytes:
        steps = triton.cdiv(k, cfg.block_k)
        want_split = min(triton.cdiv(want, n_blocks), rule.max_split_k,
                         max(1, bytes_per_program // rule.slice_min_bytes))
        # A divisor of the K steps: every slice equally long, no K masks.
        split = max(s for s in range(1, min(want_split, steps) + 1) if steps % s == 0)
        cfg = replace(cfg, split_k=split)
    return cfg


@functools.cache
def _sm_count(device_index: int | None) -> int:
    if not torch.cuda.is_available():  # the interpreter on the CPU: an H100's count
        return 132
    index = torch.cuda.current_device() if device_index is None else device_index
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


@triton.jit
def _gemv_fma_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, stride_xm, stride_wn, stride_ym,
                     r_ptr, nw_ptr, normed_ptr, res_ptr, stride_rm, eps,
                     K: tl.constexpr, K_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                     ROW_BLOCK: tl.constexpr, PRE: tl.constexpr):
    # NORM: x is the input of an RMSNorm (weights nw, residual r added first when HAS_RES) whose
    # output this GEMM multiplies; the r/nw/normed/res pointers and stride_rm, eps are unused without it.
    # PRE (1..4, at most the slice's K steps): with PDL, the K steps of weights requested before the wait.
    if PDL:
        # Let the next kernel (launched with PDL) take SM slots as ours retire.
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    # Rows past N read row N-1 again (unmasked loads keep the 16-byte vectors); the store drops
    # them. Rows of x past M are masked instead: zeros, and no memory request.
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
    # Both operands are addressed with the accumulator's full [BLOCK_M, BLOCK_N, BLOCK_K] shape
    # (stride 0 over the dimension each lacks): the loads then get the same register layout as
    # the product, and nothing moves between layouts (through shared memory) in the loop. The
    # repeated addresses are served by L1.
    zero_m = tl.zeros([BLOCK_M], dtype=tl.int64)[:, None, None]
    zero_n = tl.zeros([BLOCK_N], dtype=tl.int64)[None, :, None]
    k3 = offs_k[None, None, :]
    w_ptrs = w_ptr + (zero_m + rows_w[None, :, None] * stride_wn + k3)
    x_ptrs = x_ptr + (offs_m[:, None, None].to(tl.int64) * stride_xm + zero_n + k3)
    m_mask = offs_m[:, None, None] < M
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PDL:
        # The weights are no kernel's output: the first PRE tiles are requested before waiting for
        # the previous kernel (whose output x may be), so they stream while that kernel (and any
        # latency-bound kernels before it that let this one launch) drains.
        w0 = _w_tile(w_ptrs, 0, k3, K, EVEN_K)
        w1 = w0
        w2 = w0
        w3 = w0
        if PRE > 1:
            w1 = _w_tile(w_ptrs, BLOCK_K, k3, K, EVEN_K)
        if PRE > 2:
            w2 = _w_tile(w_ptrs, 2 * BLOCK_K, k3, K, EVEN_K)
        if PRE > 3:
            w3 = _w_tile(w_ptrs, 3 * BLOCK_K, k3, K, EVEN_K)
        tl.extra.cuda.gdc_wait()
    # Without NORM these are placeholders _x_tile never reads.
    r_ptrs = x_ptrs
    nw_ptrs = x_ptrs
    rstd = tl.full([BLOCK_M, 1, 1], 1.0, dtype=tl.float32)
    if NORM:
        # Every program normalizes its own copy of x: the whole row's sum of squares first (x and
        # the residual are a few KB, read from L2 while the first weight tile is in flight), then
        # each K step's values again as it multiplies them. Program (0, 0) stores x + r and the
        # norm output for the readers after this kernel.
        first = (pid_n == 0) & (pid_k == 0)
        rstd = _norm_rstd(x_ptr, r_ptr, nw_ptr, normed_ptr, res_ptr, M, stride_xm, stride_rm, eps, first,
                          K, HAS_RES, BLOCK_M, ROW_BLOCK)[:, None, None]
        r_ptrs = r_ptr + (offs_m[:, None, None].to(tl.int64) * stride_rm + zero_n + k3)
        nw_ptrs = nw_ptr + (zero_m + zero_n + k3)
    if PDL:
        acc += _x_tile(x_ptrs, r_ptrs, nw_ptrs, 0, m_mask, k3, rstd, K, EVEN_K, NORM, HAS_RES) * w0.to(tl.float32)
        if PRE > 1:
            acc += _x_tile(x_ptrs + BLOCK_K, r_ptrs, nw_ptrs, BLOCK_K, m_mask, k3, rstd, K, EVEN_K, NORM,
                           HAS_RES) * w1.to(tl.float32)
        if PRE > 2:
            acc += _x_tile(x_ptrs + 2 * BLOCK_K, r_ptrs, nw_ptrs, 2 * BLOCK_K, m_mask, k3, rstd, K, EVEN_K, NORM,
                           HAS_RES) * w2.to(tl.float32)
        if PRE > 3:
            acc += _x_tile(x_ptrs + 3 * BLOCK_K, r_ptrs, nw_ptrs, 3 * BLOCK_K, m_mask, k3, rstd, K, EVEN_K, NORM,
                           HAS_RES) * w3.to(tl.float32)
        w_ptrs += PRE * BLOCK_K
        x_ptrs += PRE * BLOCK_K
    # K and the slice length are compile-time constants: the trip count is known to the compiler
    # (and Triton 3.6's interpreter cannot loop over a run-time bound under numpy 2.4). With PDL
    # the first PRE steps ran above.
    for kk in range(BLOCK_K * PRE * PDL, K_SPLIT, BLOCK_K):
        w = _w_tile(w_ptrs, 0, k3 + kk, K, EVEN_K)
        acc += _x_tile(x_ptrs, r_ptrs, nw_ptrs, kk, m_mask, k3, rstd, K, EVEN_K, NORM, HAS_RES) * w.to(tl.float32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    _store_tile(tl.sum(acc, axis=2), offs_m, offs_n, pid_k, b_ptr, y_ptr, part_ptr, M, N, stride_ym,
                HAS_BIAS, SPLIT)


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, stride_xm, stride_wn, stride_ym,
                     K: tl.constexpr, K_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                     EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]
    # out^T = W x^T: W's tile is the [BLOCK_N, BLOCK_K] operand, x^T [BLOCK_K, 16] the other, its
    # rows past M masked (zeros, no memory traffic).
    xt_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]
    m_mask = offs_m[None, :] < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kk in range(0, K_SPLIT, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            xt = tl.load(xt_ptrs, mask=m_mask, other=0.0)
        else:
            k_mask = (offs_k + kk) < K
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
            xt = tl.load(xt_ptrs, mask=m_mask & k_mask[:, None], other=0.0)
        if DOT_FP32:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K
        xt_ptrs += BLOCK_K
    _store_tile(tl.trans(acc), offs_m, offs_n, pid_k, b_ptr, y_ptr, part_ptr, M, N, stride_ym,
                HAS_BIAS, SPLIT)


@triton.jit
def _splitk_sum_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``y[m, n] = sum over slices s in order of part[s, m, n] (+ bias[n])``."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = M * N
    mask = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    row = offs // N
    col = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + col, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str = "skinny_linear") -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D [rows, K]; got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"{name}: weight must be [N, K={x.shape[1]}]; got shape {tuple(weight.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{name}: x has {x.shape[0]} rows; accepted: at most {MAX_ROWS} (use F.linear)")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"{name}: dtypes x={x.dtype}, weight={weight.dtype}; accepted: both "
                         f"{' or '.join(str(d) for d in DTYPES)}")
    if weight.stride(1) != 1:
        raise ValueError(f"{name}: weight strides {weight.stride()}; accepted: unit stride along K")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"{name}: bias shape {tuple(bias.shape)} dtype {bias.dtype}; accepted: "
                         f"[{weight.shape[0]}] in {x.dtype}")


@dataclass(frozen=True)
class _NormOperands:
    """What the fma kernel needs to apply an RMSNorm to x itself (``norm_skinny_linear``);
    ``row_block``: columns (a power of two) of the tile the sum of squares runs over."""

    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    normed: torch.Tensor
    res_sum: torch.Tensor
    row_block: int


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig,
            pdl: bool, norm: _NormOperands | None = None) -> torch.Tensor:
    """The kernel launch(es) behind ``skinny_linear`` and ``norm_skinny_linear`` (inputs checked)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    steps = triton.cdiv(k, config.block_k)
    split = max(1, min(config.split_k, steps))
    k_split = triton.cdiv(steps, split) * config.block_k  # a slice: whole K steps
    split = max(1, triton.cdiv(k, k_split))
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    pdl = pdl and config.kind == "fma"
    # Weight steps before the PDL wait: within the slice, one with the norm folded in (GemvRule).
    pre = 1 if norm is not None else max(1, min(config.pdl_steps, k_split // config.block_k))
    grid = (triton.cdiv(n, config.block_n), split)
    b = bias if bias is not None else y
    shape = dict(K=k, K_SPLIT=k_split, HAS_BIAS=bias is not None and split == 1, SPLIT=split > 1,
                 EVEN_K=k % k_split == 0, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 num_warps=config.num_warps, num_stages=config.num_stages)
    if config.kind == "dot":
        _gemv_dot_kernel[grid](x, weight, b, y, part, m, n, x.stride(0), weight.stride(0), y.stride(0),
                               DOT_FP32=_INTERPRETED, BLOCK_M=_DOT_ROWS, **shape)
    else:
        # Without the norm its operands are placeholders, never read; ROW_BLOCK fixed: one compile.
        r = norm.residual if norm is not None and norm.residual is not None else None
        _gemv_fma_kernel[grid](x, weight, b, y, part, m, n, x.stride(0), weight.stride(0), y.stride(0),
                               x if r is None else r, x if norm is None else norm.weight,
                               y if norm is None else norm.normed, y if norm is None else norm.res_sum,
                               0 if r is None else r.stride(0), 0.0 if norm is None else norm.eps,
                               BLOCK_M=triton.next_power_of_2(m), PDL=pdl, NORM=norm is not None,
                               HAS_RES=r is not None, ROW_BLOCK=16 if norm is None else norm.row_block,
                               PRE=pre if pdl else 1, launch_pdl=pdl, **shape)
    if split > 1:
        block = 1024
        _splitk_sum_kernel[(triton.cdiv(m * n, block),)](
            part, b, y, m, n, y.stride(0), SPLIT_K=split,
            HAS_BIAS=bias is not None, BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return y


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemvConfig | None = None, pdl: bool = False, rule: GemvRule = RULE) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a 2-D ``x`` of 1..``MAX_ROWS`` rows (see the module doc).

    Args:
        x: ``[M, K]`` bf16/fp16; rows may be strided (a non-unit stride along K is copied).
        weight: ``[N, K]`` in x's dtype, unit stride along K.
        bias: ``[N]`` in x's dtype, or None.
        config: a launch shape (benchmarks, tuning); None: ``choose_config``'s.
        pdl: launch the "fma" kind with programmatic dependent launch (sm_90+, ``supports_pdl``):
            its programs may start while the previous kernel on the stream drains, requesting their
            first weight tile before they wait for that kernel's results. The "dot" kind (3+ rows)
            ignores it: with PDL a 48-layer chain at 4 rows ran 0.53x (H100).
        rule: the rule ``config`` is chosen by when None (``SkinnyLinear.rule``).

    Returns:
        ``[M, N]`` in x's dtype, contiguous.
    """
    _check(x, weight, bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    if config is None:
        config = choose_config(m, n, k, _sm_count(x.device.index if x.is_cuda else None), x.element_size(), rule)
    else:
        config.validate()
    return _launch(x, weight, bias, config, pdl)


def _check_out(name: str, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A caller's output buffer for ``like``'s values, or a new one."""
    if out is not None and (out.shape != like.shape or out.dtype != like.dtype or out.device != like.device
                            or not out.is_contiguous()):
        raise ValueError(f"norm_skinny_linear: {name} shape {tuple(out.shape)} dtype {out.dtype} on {out.device}; "
                         f"accepted: contiguous {list(like.shape)} in {like.dtype} on {like.device}")
    return torch.empty(like.shape, dtype=like.dtype, device=like.device) if out is None else out


def norm_skinny_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None, pdl: bool = False, *,
                       config: GemvConfig | None = None, rule: GemvRule = RULE, normed: torch.Tensor | None = None,
                       res_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.rms_norm(x, norm_weight, eps, residual)`` then ``skinny_linear(normed, weight,
    bias)`` in the GEMM's launch (two with split-K): no launch and no grid-wide wait for the norm.

    Every program computes ``1 / rms`` of its rows from the whole row of ``x (+ residual)`` (after
    ``gdc_wait`` with ``pdl``; its first weight tile requested before), then normalizes each K
    step's values again as it multiplies them; program (0, 0) alone stores ``x + residual`` and the
    norm output. ``rms_norm``'s roundings (the sum rounded to the activation dtype, float32 mean of
    squares, ``rsqrt(var + eps)``, ``h`` rounded, ``w * h`` rounded); a row of at most
    ``rule.norm_row_tile / rows`` values is summed in its order too. "fma" kind only.

    Args:
        x: ``[M, K]`` bf16/fp16, ``M <= rule.fma_max_rows``; rows may be strided.
        residual: ``[M, K]`` in x's dtype, added to x first; or None.
        norm_weight, eps: the norm's ``[K]`` weight and epsilon.
        weight, bias, pdl: as for ``skinny_linear``; config: an "fma" launch shape, None: chosen.
        rule: the rule the config is chosen by, and its ``norm_row_tile``.
        normed, res_sum: contiguous ``[M, K]`` buffers in x's dtype for the norm output and ``x +
            residual`` (the layer SDK preallocates them); None: new tensors.

    Returns:
        ``(y, normed, res_sum)``: ``[M, N]`` as ``skinny_linear``'s, the norm output and ``x +
        residual`` (without a residual: ``x`` itself, written by no one).
    """
    name = "norm_skinny_linear"
    _check(x, weight, bias, name)
    m, k = x.shape
    n = weight.shape[0]
    if m > rule.fma_max_rows:
        raise ValueError(f"{name}: x has {m} rows; accepted: at most {rule.fma_max_rows} (GemvRule.fma_max_rows: "
                         "the norm is fused into the fma kind only)")
    if n == 0:
        raise ValueError(f"{name}: weight has no rows; accepted: [N >= 1, K={k}]")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"{name}: residual shape {tuple(residual.shape)} dtype {residual.dtype}; accepted: "
                         f"{list(x.shape)} in {x.dtype}")
    if norm_weight.shape != (k,) or not norm_weight.is_floating_point():
        raise ValueError(f"{name}: norm_weight shape {tuple(norm_weight.shape)} dtype {norm_weight.dtype}; "
                         f"accepted: [{k}] floating point")
    if config is None:
        config = choose_config(m, n, k, _sm_count(x.device.index if x.is_cuda else None), x.element_size(), rule)
    else:
        config.validate()
    if config.kind != "fma":
        raise ValueError(f"{name}: config.kind {config.kind!r}; accepted: 'fma' (the only kind with the norm)")
    normed = _check_out("normed", normed, x)
    res_sum = x if residual is None else _check_out("res_sum", res_sum, x)
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device), normed, res_sum
    xk = x if x.stride(1) == 1 else x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    row_block = min(triton.next_power_of_2(k),
                    max(16, _pow2_at_most(rule.norm_row_tile // triton.next_power_of_2(m))))
    norm = _NormOperands(residual, norm_weight.contiguous(), float(eps), normed, res_sum, row_block)
    return _launch(xk, weight, bias, config, pdl, norm), normed, res_sum


def supports_pdl(device: torch.device | None = None) -> bool:
    """Whether kernels may be launched with programmatic dependent launch: a CUDA device of
    compute capability 9.0 or newer, not under Triton's interpreter."""
    if _INTERPRETED or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@dataclass(frozen=True)
class SkinnyLinear:
    """``Platform.layer_kernels()['linear']``: the unquantized linear layers call it for inputs of
    1..``max_rows`` rows (``engine.layers.linear.skinny_linear_applies``), F.linear otherwise; with
    ``norm_fusion`` it also takes the inputs an ``RMSNorm`` hands on unnormalized
    (``engine.layers.layernorm.PendingNorm``, ``norm_linear``) where ``takes_norm`` says so."""

    #: the most rows of x (tokens of the batch) it is used for; the ``cuda.gemv_max_rows`` option.
    max_rows: int = 8
    #: launch with programmatic dependent launch (``skinny_linear(pdl=True)``); the ``cuda.pdl``
    #: option, on sm_90+ only.
    pdl: bool = False
    #: fold the RMSNorm before a projection into it (``norm_skinny_linear``); the
    #: ``cuda.norm_fusion`` option.
    norm_fusion: bool = False
    #: the launch-shape rule (its ``fma_pdl_steps``: the ``cuda.pdl_preload`` option).
    rule: GemvRule = RULE

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return skinny_linear(x, weight, bias, pdl=self.pdl, rule=self.rule)

    @property
    def norm_max_rows(self) -> int:
        """Rows ``norm_linear`` takes at most: the fma kind's (this kernel's rule), within ``max_rows``."""
        return min(self.max_rows, self.rule.fma_max_rows)

    def takes_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether ``norm_linear`` takes the norm of the 2-D ``x`` for ``weight``/``bias``: norm
        fusion on, ``x`` on the GPU, 1..``norm_max_rows`` rows, and as ``skinny_linear_applies``."""
        from engine.layers.linear import skinny_linear_applies

        return self.norm_fusion and x.is_cuda and skinny_linear_applies(x, weight, bias, self.norm_max_rows)

    def norm_linear(self, pending: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``pending``'s norm times ``weight`` (+ bias), filling its ``normed`` and ``res_sum``;
        ``[rows, N]``."""
        k = pending.x.shape[-1]
        res_sum = pending.res_sum.view(-1, k) if pending.residual is not None else None
        y, _, _ = norm_skinny_linear(pending.x, pending.residual, pending.weight, pending.eps, weight, bias,
                                     pdl=self.pdl, rule=self.rule, normed=pending.normed.view(-1, k),
                                     res_sum=res_sum)
        return y
