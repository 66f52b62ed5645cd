"""One Triton launch to gather a set of KV slots of every layer into host-row layout, and one to
scatter rows back (the hierarchical cache's copies, ``engine.mem_cache.kv_transfer``).

The pool keeps one buffer per layer and per K/V (``[rows, heads, dim]``, contiguous); a host
tier row is ``[parts, heads, width]`` with each part's ``dim`` first in ``width``. With torch ops
that is one gather per part plus a transpose (65 launches for a 32-layer model, ~2.5 ms of CPU a
copy on an H200 host, whatever the token count); here the parts' base addresses sit in a device
table and one launch moves them all. Elements are moved as same-sized integers: bytes are copied,
nothing is converted, so every dtype (float8 included) takes the same kernel.
"""

from __future__ import annotations

from typing import Any

import torch

#: Integer type of each element size: what the kernels load and store.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Tokens a program moves: dense rows are plain vector copies; masked ones (a narrower part) need
#: a pointer per element, so fewer tokens keep them in registers.
BLOCK_T = 8
BLOCK_T_MASKED = 2

_kernels: dict[str, Any] = {}


def _get_kernels() -> dict[str, Any]:
    """The two jitted kernels (and their shared address helper), built on first use (importing
    triton only then)."""
    if _kernels:
        return _kernels
    import triton
    import triton.language as tl

    # A module global: the interpreter (TRITON_INTERPRET=1) looks a kernel's callees up among its
    # module's globals, not its closure.
    global _addresses

    @triton.jit
    def _addresses(part_ptrs, part_dims, idx_ptr, rows_ptr, n, HEADS: tl.constexpr, WIDTH: tl.constexpr,
                   PARTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, DENSE: tl.constexpr):
        """This program's (part, token block): the slots' addresses in the part, the rows'
        addresses, the mask of the part's elements and that of whole rows (past a narrower
        part's dim too)."""
        tb = tl.program_id(0)
        p = tl.program_id(1)
        # DENSE: every part is WIDTH wide (the usual K and V of one head_dim): a row is contiguous.
        dim = WIDTH if DENSE else tl.load(part_dims + p)
        base = tl.multiple_of(tl.load(part_ptrs + p).to(tl.pointer_type(rows_ptr.dtype.element_ty)), 16)
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < n
        slot = tl.load(idx_ptr + t, mask=tmask, other=0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        h = e // WIDTH
        d = e % WIDTH
        in_row = e < HEADS * WIDTH
        part = base + slot[:, None] * (HEADS * dim) + (h * dim + d)[None, :]
        row = rows_ptr + t.to(tl.int64)[:, None] * (PARTS * HEADS * WIDTH) + p * (HEADS * WIDTH) + e[None, :]
        return part, row, tmask[:, None] & (in_row & (d < dim))[None, :], tmask[:, None] & in_row[None, :]

    # Not specialised on the token count or the index's alignment: one compile serves every copy.
    @triton.jit(do_not_specialize=["idx_ptr", "n"])
    def gather(part_ptrs, part_dims, idx_ptr, out_ptr, n, HEADS: tl.constexpr, WIDTH: tl.constexpr,
               PARTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, DENSE: tl.constexpr):
        part, row, part_mask, row_mask = _addresses(part_ptrs, part_dims, idx_ptr, out_ptr, n, HEADS, WIDTH, PARTS,
                                                    BLOCK_T, BLOCK_E, DENSE)
        tl.store(row, tl.load(part, mask=part_mask, other=0), mask=row_mask)  # zeros past a part's dim

    @triton.jit(do_not_specialize=["idx_ptr", "n"])
    def scatter(part_ptrs, part_dims, idx_ptr, rows_ptr, n, HEADS: tl.constexpr, WIDTH: tl.constexpr,
                PARTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, DENSE: tl.constexpr):
        part, row, part_mask, _ = _addresses(part_ptrs, part_dims, idx_ptr, rows_ptr, n, HEADS, WIDTH, PARTS,
                                             BLOCK_T, BLOCK_E, DENSE)
        tl.store(part, tl.load(row, mask=part_mask, other=0), mask=part_mask)

    _kernels.update(gather=gather, scatter=scatter, next_pow2=triton.next_power_of_2)
    return _kernels


class PartTable:
    """The device table of a pool's per-layer buffers (K of each layer, then V of each layer, or
    K only for an MLA pool): base addresses and dims, built once for the pool's life."""

    def __init__(self, parts: list[torch.Tensor], heads: int, width: int) -> None:
        device = parts[0].device
        for p in parts:
            # 16-byte aligned bases let the copies use vector loads (the kernels assume it).
            if not p.is_contiguous() or p.shape[1] != heads or p.shape[2] > width or p.data_ptr() % 16:
                raise ValueError(f"KV part of shape {tuple(p.shape)} (contiguous {p.is_contiguous()}, address "
                                 f"{p.data_ptr():#x}) does not fit rows of {heads} heads x {width}")
        self.parts = parts  # keeps the buffers (and so the addresses) alive
        self.ptrs = torch.tensor([p.data_ptr() for p in parts], dtype=torch.int64, device=device)
        self.dims = torch.tensor([p.shape[2] for p in parts], dtype=torch.int32, device=device)
        self.heads, self.width = heads, width
        self.dense = all(p.shape[2] == width for p in parts)
        self.int_dtype = _INT_OF_SIZE[parts[0].element_size()]

    def _launch(self, name: str, idx: torch.Tensor, rows: torch.Tensor) -> None:
        n = len(idx)
        if n == 0:
            return
        k = _get_kernels()
        block_e = k["next_pow2"](self.heads * self.width)
        block_t = BLOCK_T if self.dense else BLOCK_T_MASKED
        grid = ((n + block_t - 1) // block_t, len(self.parts))
        k[name][grid](self.ptrs, self.dims, idx.contiguous(), rows.view(self.int_dtype), n, HEADS=self.heads,
                      WIDTH=self.width, PARTS=len(self.parts), BLOCK_T=block_t, BLOCK_E=block_e, DENSE=self.dense)

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """``[len(idx), parts, heads, width]`` rows of the slots ``idx`` (int64, on the device);
        entries past a part's dim are zero."""
        out = torch.empty((len(idx), len(self.parts), self.heads, self.width), dtype=self.parts[0].dtype,
                          device=idx.device)
        self._launch("gather", idx, out)
        return out

    def scatter(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Writes ``rows`` (``[len(idx), parts, heads, width]``, contiguous) into the slots ``idx``."""
        self._launch("scatter", idx, rows)
