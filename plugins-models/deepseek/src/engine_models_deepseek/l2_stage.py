"""Asking L2 for weights a decode step reads a little later, from a side stream inside the decode
CUDA graphs (sm_90+).

Between a DeepSeek layer's input projection and its output projection the GPU runs latency-bound
kernels (the MLA prologue, the split attention and its merge, the ``W_UV`` product) that move a
few hundred KB; HBM idles for about 10 us of each layer at batch 1. While a decode graph is
captured, each MLA layer forks a side stream after its input projection and launches one kernel
there that asks L2 for the weights the layer streams next (``o_proj``'s, then the shared
experts', read again by the routed experts' launches at batch 1), so those kernels find them in L2
instead of HBM. The model joins the side stream back after its last layer (``Stager.join``).

The staging kernel is on a stream of its own because a kernel with bulk prefetches in flight does
not complete before they do: as programs of the prologue's own launch (measured on an H200 at
31 MB a layer) they held the attention after it back by 15 us a layer. Each of its threads issues
one ``cp.async.bulk.prefetch.L2`` of 16 KiB under an ``evict_last`` cache policy (kept over the
streamed expert weights, which take the normal one). A prefetch reads and writes nothing a kernel
sees: results are unchanged, only when bytes move. The asm needs a GPU: under Triton's interpreter
nothing is staged (``supports_staging``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: Bytes one prefetch asks for; one a thread, so a program of 4 warps asks for 2 MiB.
CHUNK = 16384
PER_PROGRAM = 128
#: Tensors a plan covers (three runtime (address, chunks) pairs in the kernel's arguments).
MAX_TENSORS = 3
_CHUNK = tl.constexpr(CHUNK)
_PER_PROGRAM = tl.constexpr(PER_PROGRAM)

_PREFETCH = tl.constexpr(
    "{ .reg .b64 keep_late;\n"
    " .reg .pred ask;\n"
    " setp.ne.b32 ask, $3, 0;\n"
    " createpolicy.fractional.L2::evict_last.b64 keep_late, 1.0;\n"
    " @ask cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, keep_late;\n"
    " mov.u32 $0, 0; }")


@triton.jit
def stage_chunks(program, a0, n0, a1, n1, a2, n2):
    """Program ``program`` of a plan asks L2 for chunks ``program * PER_PROGRAM ..`` of the three
    byte ranges taken in order (``a*``: start addresses, ``n*``: whole chunks in each)."""
    c = (program * _PER_PROGRAM + tl.arange(0, _PER_PROGRAM)).to(tl.int64)
    first = n0.to(tl.int64)
    second = first + n1
    addr = tl.where(c < first, a0 + c * _CHUNK,
                    tl.where(c < second, a1 + (c - first) * _CHUNK, a2 + (c - second) * _CHUNK))
    live = (c < second + n2).to(tl.int32)
    size = tl.full([_PER_PROGRAM], _CHUNK, tl.int32)
    tl.inline_asm_elementwise(_PREFETCH, "=r,l,r,r", [addr, size, live], dtype=tl.int32, is_pure=False, pack=1)


# Chunk counts and addresses stay run-time values: Triton would make an argument equal to 1 a
# constant, which has no .to().
@triton.jit(do_not_specialize=["a0", "n0", "a1", "n1", "a2", "n2"])
def _stage_kernel(a0, n0, a1, n1, a2, n2):
    stage_chunks(tl.program_id(0), a0, n0, a1, n1, a2, n2)


@dataclass(frozen=True)
class StagePlan:
    """What the staging programs of a launch ask for: ``ranges`` three ``(address, chunks)`` pairs
    (unused ones ``(0, 0)``) and ``programs`` to launch for them."""

    ranges: tuple[tuple[int, int], ...]
    programs: int

    def args(self) -> list[int]:
        return [v for pair in self.ranges for v in pair]


def stage_plan(tensors: list[torch.Tensor], max_bytes: int) -> StagePlan | None:
    """A plan for the first ``max_bytes`` of ``tensors`` (in the order given, each rounded down to
    whole chunks; at most ``MAX_TENSORS``; non-contiguous ones skipped); None when it would ask for
    nothing."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"stage_plan: {len(tensors)} tensors; accepted: at most {MAX_TENSORS}")
    ranges = []
    left = max_bytes // CHUNK
    for t in tensors:
        if not t.is_contiguous():
            continue
        chunks = min(left, t.numel() * t.element_size() // CHUNK)
        if chunks > 0:
            ranges.append((t.data_ptr(), chunks))
            left -= chunks
    total = sum(n for _, n in ranges)
    if total == 0:
        return None
    ranges += [(0, 0)] * (MAX_TENSORS - len(ranges))
    return StagePlan(tuple(ranges), triton.cdiv(total, PER_PROGRAM))


def supports_staging(device: torch.device) -> bool:
    """Bulk L2 prefetches need sm_90+ and a compiled kernel (not Triton's interpreter)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


class Stager:
    """One device's side stream for staging launches inside graph capture; ``join`` merges it
    back into the current stream (every fork must be joined before a capture ends)."""

    def __init__(self, device: torch.device) -> None:
        # Made outside any capture (the first decode step runs eagerly before graphs are captured).
        self.stream = torch.cuda.Stream(device=device)
        self.pending = False

    def stage(self, plan: StagePlan) -> None:
        """After the work queued so far on the current stream, launches ``plan`` on the side stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            _stage_kernel[(plan.programs,)](*plan.args(), num_warps=PER_PROGRAM // 32)
        self.pending = True

    def join(self) -> None:
        if self.pending:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.pending = False


_STAGERS: dict[torch.device, Stager] = {}


def stager_for(device: torch.device) -> Stager:
    if device not in _STAGERS:
        _STAGERS[device] = Stager(device)
    return _STAGERS[device]


def join_all() -> None:
    """Joins every device's pending side stream into that device's current stream."""
    for stager in _STAGERS.values():
        stager.join()
