"""Builds FlashInfer's JIT kernels for one model shape ahead of serving.

FlashInfer compiles each (dtype, head dim, window, soft cap) kernel family on first
use and caches it under ``~/.cache/flashinfer`` (``FLASHINFER_WORKSPACE_BASE``
moves it). Run this in an image build, or in parallel for several shapes, so that
the server's start-up ``warmup()`` only loads kernels::

    python -m engine_attention_flashinfer.prebuild --heads 32 --kv-heads 8 --head-dim 128 \\
        --dtype bfloat16 [--page-size 16] [--window 4096] [--logit-cap 30]

``MAX_JOBS`` limits the parallel compiler jobs of each build.
"""

from __future__ import annotations

import argparse
import time

import torch


def prebuild(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             page_size: int = 1, windows: tuple[int, ...] = (-1,), logit_cap: float = 0.0,
             scaling: float | None = None, device: str = "cuda") -> float:
    """Runs ``warmup()`` on a throw-away backend of this shape; returns the seconds it took."""
    from engine.attention import AttentionContext, AttentionLayerInfo
    from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from engine_attention_flashinfer.backend import FlashInferAttnBackend

    dev = torch.device(device)
    # Two pages are enough: warmup() reads only the reserved padding page.
    pool = MHATokenToKVPool(page_size, page_size, dtype, num_kv_heads, head_dim, 1, dev)
    ctx = AttentionContext(device=dev, dtype=dtype, num_layers=1, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                           max_context_len=16, req_to_token_pool=ReqToTokenPool(1, 16, dev),
                           token_to_kv_pool=pool)
    backend = FlashInferAttnBackend(ctx)
    scale = scaling if scaling is not None else head_dim ** -0.5
    layers = [AttentionLayerInfo(0, num_heads, num_kv_heads, head_dim, scale, logit_cap, w) for w in windows]
    start = time.perf_counter()
    backend.warmup(layers)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, required=True, help="query heads per rank")
    parser.add_argument("--kv-heads", type=int, required=True, help="key/value heads per rank")
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--window", type=int, action="append", default=None,
                        help="sliding window W of some layers (repeatable; -1 = full attention)")
    parser.add_argument("--logit-cap", type=float, default=0.0)
    parser.add_argument("--scaling", type=float, default=None, help="softmax scale (default head_dim**-0.5)")
    args = parser.parse_args(argv)
    seconds = prebuild(args.heads, args.kv_heads, args.head_dim, getattr(torch, args.dtype),
                       args.page_size, tuple(args.window or [-1]), args.logit_cap, args.scaling)
    print(f"flashinfer kernels ready for heads={args.heads}/{args.kv_heads} head_dim={args.head_dim} "
          f"{args.dtype} windows={args.window or [-1]} logit_cap={args.logit_cap}: {seconds:.1f} s")


if __name__ == "__main__":
    main()
