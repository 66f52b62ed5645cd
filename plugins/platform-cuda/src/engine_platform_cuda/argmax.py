"""Greedy sampling's argmax over the vocabulary in one launch (``layer_kernels()['argmax']``).

``torch.argmax(logits, dim=-1)`` on CUDA costs a memset and a reduce kernel; a batch-1 decode step
pays both between steps. Here a grid of ``(rows, parts)`` programs splits each row; each program
writes its partial (value, index) to a workspace, and the last program of the row to finish (an
int32 ticket per row, incremented with acquire/release order) reduces the partials, writes the id
and puts the ticket back to 0. The workspace therefore needs no memset between calls: it is
allocated once per device, zeroed once, and grown when a call needs more.

The result equals ``torch.argmax``'s (on the CPU and on CUDA): the first index among equal maxima,
NaN above every number (the first NaN of a row wins), index 0 for a row of all ``-inf``. Partials
are reduced in a fixed order, so the result does not depend on which program finishes last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: elements one program reads per step (16 float32 a thread with 4 warps: four 16-byte loads).
BLOCK = 2048
#: rows up to this length are reduced by one program each: no workspace, no ticket.
SINGLE_PROGRAM_MAX = 8192
#: programs over the whole batch where no GPU says how many SMs it has (the interpreter): an H100's.
DEFAULT_PROGRAMS = 132
_NO_INDEX = tl.constexpr(2**31 - 1)  # above every index: loses every min


@triton.jit
def _first_max(vals, idxs):
    """(value, index) of the first NaN among ``vals`` if any, else of the first maximum."""
    is_nan = vals != vals
    nan_idx = tl.min(tl.where(is_nan, idxs, _NO_INDEX), axis=0)
    # NaNs left out of the max, so the numeric path does not depend on how tl.max treats them.
    top = tl.max(tl.where(is_nan, float("-inf"), vals), axis=0)
    top_idx = tl.min(tl.where(vals == top, idxs, _NO_INDEX), axis=0)
    has_nan = nan_idx != _NO_INDEX
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, nan_idx, top_idx)


# tiles_per_part not specialized: at 1 Triton 3.6 folds the while loop's bound and its
# TritonGPUCoalesce pass then crashes on the dead loop (seen on sm_90); a runtime bound compiles.
@triton.jit(do_not_specialize=["tiles_per_part"])
def _argmax_kernel(x_ptr, out_ptr, part_val_ptr, part_idx_ptr, ticket_ptr, n, stride_row, tiles_per_part,
                   BLOCK: tl.constexpr, SPLIT: tl.constexpr, PARTS_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    lanes = tl.arange(0, BLOCK)
    row_ptr = x_ptr + row.to(tl.int64) * stride_row
    start = part * tiles_per_part * BLOCK
    # A program's first tile is full unless it is the row's last, so every lane masked here stays
    # masked below: its _NO_INDEX never wins.
    offs = start + lanes
    mask = offs < n
    best_val = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    best_idx = tl.where(mask, offs, _NO_INDEX)
    # A while loop: Triton 3.6's interpreter cannot take a runtime bound in range() (numpy 2
    # refuses int() of its one-element scalars), and a constexpr bound would compile per batch size.
    t = 1
    while t < tiles_per_part:
        offs = start + t * BLOCK + lanes
        mask = offs < n
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        # Later tiles hold higher indices: a lane takes a value only if strictly better (a NaN
        # over a number), so on a tie the lower index stays.
        take = mask & ((x > best_val) | ((x != x) & (best_val == best_val)))
        best_val = tl.where(take, x, best_val)
        best_idx = tl.where(take, offs, best_idx)
        t += 1
    val, idx = _first_max(best_val, best_idx)
    if SPLIT:
        slot = row * parts + part
        tl.store(part_val_ptr + slot, val)
        tl.store(part_idx_ptr + slot, idx)
        # The CTA's stores precede the ticket (barrier, then a release at GPU scope), as in
        # CUTLASS's semaphore; the last program's acquire makes every partial visible to it.
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel")
        if ticket == parts - 1:
            tl.debug_barrier()
            p = tl.arange(0, PARTS_BLOCK)
            pmask = p < parts
            # .cg: read from L2, where the other SMs' partials are, not from this SM's L1.
            vals = tl.load(part_val_ptr + row * parts + p, mask=pmask, other=float("-inf"), cache_modifier=".cg")
            idxs = tl.load(part_idx_ptr + row * parts + p, mask=pmask, other=_NO_INDEX, cache_modifier=".cg")
            _, idx = _first_max(vals, idxs)
            tl.store(out_ptr + row, idx.to(tl.int64))
            tl.store(ticket_ptr + row, 0)  # ready for the next call, on the same stream
    else:
        tl.store(out_ptr + row, idx.to(tl.int64))


@dataclass
class _Workspace:
    #: [slots] float32 partial maxima, ``row * parts + part``; overwritten before each read.
    part_val: torch.Tensor
    #: [slots] int32 index of each partial maximum.
    part_idx: torch.Tensor
    #: [rows] int32 programs of the row finished so far; 0 between calls (the last one resets it).
    tickets: torch.Tensor


_WORKSPACES: dict[torch.device, _Workspace] = {}
_PROGRAMS: dict[torch.device, int] = {}


def _target_programs(device: torch.device) -> int:
    """Programs over the whole batch: one per SM of the logits' GPU."""
    if device not in _PROGRAMS:
        if device.type == "cuda":
            _PROGRAMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            _PROGRAMS[device] = DEFAULT_PROGRAMS
    return _PROGRAMS[device]


def plan(rows: int, n: int, programs: int) -> tuple[int, int]:
    """``(tiles_per_part, parts)``: each row split into ``parts`` programs of ``tiles_per_part``
    tiles of ``BLOCK`` elements, about ``programs`` programs over the batch (one a row for short
    rows, or when the batch alone fills the GPU)."""
    tiles = triton.cdiv(n, BLOCK)
    wanted = 1 if n <= SINGLE_PROGRAM_MAX else max(1, min(tiles, programs // rows))
    tiles_per_part = triton.cdiv(tiles, wanted)
    return tiles_per_part, triton.cdiv(tiles, tiles_per_part)


def _workspace(device: torch.device, rows: int, slots: int) -> _Workspace:
    ws = _WORKSPACES.get(device)
    if ws is None or ws.part_val.numel() < slots or ws.tickets.numel() < rows:
        # Grown to the larger of old and new needs, so alternating shapes do not reallocate.
        if ws is not None:
            slots, rows = max(slots, ws.part_val.numel()), max(rows, ws.tickets.numel())
        ws = _Workspace(part_val=torch.empty(slots, dtype=torch.float32, device=device),
                        part_idx=torch.empty(slots, dtype=torch.int32, device=device),
                        tickets=torch.zeros(rows, dtype=torch.int32, device=device))
        _WORKSPACES[device] = ws
    return ws


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` in one launch.

    Args:
        logits: ``[rows, vocab]`` float32, bfloat16 or float16, unit stride in the last dimension
            (rows may be strided), ``vocab`` >= 1.

    Returns:
        ``[rows]`` int64: per row the index of the first NaN if the row has one (NaN counts as
        larger than every number, as in torch on the CPU and on CUDA), else of the first maximum
        (a row of all ``-inf`` gives 0).

    Calls on one device share a workspace: they must not run concurrently on different streams
    (the sampler calls it on the current stream), and under CUDA graph capture the workspace must
    already be large enough (one call of the same shape before capture).
    """
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"argmax_rows: logits of shape {tuple(logits.shape)} and dtype {logits.dtype}; "
                         "accepted: a 2-D float32, bfloat16 or float16 tensor")
    rows, n = logits.shape
    if n == 0 or (rows > 0 and n > 1 and logits.stride(1) != 1):
        raise ValueError(f"argmax_rows: logits of shape {tuple(logits.shape)} and strides {logits.stride()}; "
                         "accepted: vocab >= 1 and unit stride in the last dimension")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    programs = _target_programs(logits.device)
    tiles_per_part, parts = plan(rows, n, programs)
    split = parts > 1
    # Without a split the workspace is never read, only passed: it is not grown for such calls.
    ws = _workspace(logits.device, rows if split else 1, rows * parts if split else 1)
    _argmax_kernel[(rows, parts)](
        logits, out, ws.part_val, ws.part_idx, ws.tickets, n, logits.stride(0), tiles_per_part,
        # parts <= programs: a PARTS_BLOCK from the device alone compiles once for every batch size.
        BLOCK=BLOCK, SPLIT=split, PARTS_BLOCK=triton.next_power_of_2(programs), num_warps=4)
    return out
