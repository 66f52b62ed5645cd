"""Staging the start of the next layer's qkv weight in L2 during a decode step (``cuda.l2_prefetch_mb``).

A batch-1 decode step reads every weight once, and between its weight-streaming kernels it runs
latency-bound ones (the attention, the MoE top-k) that leave memory bandwidth unused. While
capturing a decode CUDA graph, ``L2Prefetcher`` forks a side stream after each layer's qkv
projection is queued and, on it, asks L2 for the first ``mb`` MiB of the next layer's qkv
weight with one bulk prefetch per 16 KiB (``cp.async.bulk.prefetch.L2``, sm_90+) under an
``evict_last`` cache policy, so they are still there when that projection reads them. The side
stream rejoins the capture stream when the model returns. A prefetch reads and writes nothing a
kernel sees, so results are unchanged; only the order of memory traffic moves.

A few MiB pay and all of it does not: staged bytes compete with the bytes the step reads at that
moment, and they save only the difference between the HBM and L2 rates later (docs/cuda_kernels.md,
"L2 prefetch"; docs/benchmarks.md#decode-latency).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl

from engine.layers.layernorm import PendingNorm

#: Bytes one bulk prefetch asks for, and prefetches a program issues (one a thread).
CHUNK_BYTES = 16384
PER_PROGRAM = 128

_ASM = tl.constexpr("{ .reg .b64 policy;\n"
                    " .reg .pred live;\n"
                    " setp.ne.b32 live, $3, 0;\n"
                    " createpolicy.fractional.L2::evict_last.b64 policy, 1.0;\n"
                    " @live cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy;\n"
                    " mov.u32 $0, 0; }")


@triton.jit
def _l2_prefetch_kernel(addr, flag_ptr, n_chunks, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    # Thread i of program p asks L2 for chunk p * PER_PROGRAM + i: bytes [that * CHUNK, +CHUNK)
    # past addr; threads past n_chunks ask for nothing.
    i = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    where = addr + i.to(tl.int64) * CHUNK
    size = tl.full([PER_PROGRAM], CHUNK, tl.int32)
    live = (i < n_chunks).to(tl.int32)
    done = tl.inline_asm_elementwise(_ASM, "=r,l,r,r", [where, size, live], dtype=tl.int32, is_pure=False,
                                     pack=1)
    tl.store(flag_ptr + i, done, mask=done != 0)  # never stores (the asm yields 0); keeps it


def supports_l2_prefetch(device: torch.device | None = None) -> bool:
    """Whether the GPU has bulk L2 prefetches: sm_90+, as for PDL (``gemv.supports_pdl``), and
    not under Triton's interpreter (which cannot run the inline PTX)."""
    from engine_platform_cuda.gemv import supports_pdl

    return supports_pdl(device)


def prefetch_to_l2(weight: torch.Tensor, nbytes: int, flag: torch.Tensor) -> int:
    """Asks L2 for the first ``nbytes`` of ``weight`` (at most the tensor's size, rounded down to
    whole 16 KiB chunks) on the current stream; returns the bytes asked for (0: no launch).
    ``flag``: an int32 tensor on the same GPU with at least ``nbytes / 16 KiB + 128`` elements,
    never written."""
    chunks = min(nbytes, weight.numel() * weight.element_size()) // CHUNK_BYTES
    if chunks < 1:
        return 0
    _l2_prefetch_kernel[(triton.cdiv(chunks, PER_PROGRAM),)](weight.data_ptr(), flag, chunks, CHUNK=CHUNK_BYTES,
                                                             PER_PROGRAM=PER_PROGRAM, num_warps=4)
    return chunks * CHUNK_BYTES


def largest_tensor(module: torch.nn.Module) -> torch.Tensor | None:
    """The module's own parameter or buffer with the most bytes (a linear layer's weight, packed or
    not); None if it has none."""
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return max(tensors, key=lambda t: t.numel() * t.element_size(), default=None)


def qkv_chain(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's qkv projections (modules named ``...self_attn.qkv_proj``) in layer order."""
    return [m for name, m in model.named_modules() if name.endswith("self_attn.qkv_proj")]


def _rows(x: Any) -> int:
    """Tokens of a qkv projection's input: a tensor, or an RMSNorm folded into it (``PendingNorm``)."""
    return int((x.x if isinstance(x, PendingNorm) else x).shape[0])


class L2Prefetcher:
    """Forward hooks on a model's qkv projections that, inside ``capture()``, stage each next
    layer's qkv weight from a side stream; outside ``capture()`` they do nothing."""

    def __init__(self, model: torch.nn.Module, mb: int, max_rows: int | None = None) -> None:
        self.nbytes = mb * 2**20
        #: graphs of more tokens than this get no staging (None: every graph)
        self.max_rows = max_rows
        self.active = False
        #: prefetch launches captured so far (one a layer but the last, per graph)
        self.forks = 0
        self._forked = False
        chain = qkv_chain(model)
        self.pairs = {id(a): w for a, b in zip(chain, chain[1:], strict=False)
                      if (w := largest_tensor(b)) is not None and w.is_cuda}
        self._handles = [m.register_forward_hook(self._after_qkv) for m in chain if id(m) in self.pairs]
        device = next(iter(self.pairs.values())).device if self.pairs else None
        # Made here, not during a capture: the stream, and the flag the kernel never writes.
        self._side = torch.cuda.Stream(device=device) if device is not None else None
        self._flag = (torch.empty(self.nbytes // CHUNK_BYTES + PER_PROGRAM, dtype=torch.int32, device=device)
                      if device is not None else None)

    def _after_qkv(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.active:
            return
        if self.max_rows is not None and _rows(args[0]) > self.max_rows:
            return
        weight = self.pairs[id(module)]
        assert self._side is not None and self._flag is not None
        self._side.wait_stream(torch.cuda.current_stream(weight.device))
        with torch.cuda.stream(self._side):
            if prefetch_to_l2(weight, self.nbytes, self._flag):
                self.forks += 1
        self._forked = True

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Wraps one decode graph's model call: stages while it runs, then joins the side stream
        into the current (capture) stream."""
        self.active = True
        try:
            yield
        finally:
            self.active = False
            if self._forked:
                torch.cuda.current_stream().wait_stream(self._side)
                self._forked = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
