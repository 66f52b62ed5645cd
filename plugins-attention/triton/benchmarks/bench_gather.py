"""How fast shuffled KV rows can be gathered, by the bytes each row access reads contiguously.

Run from the repository root on a CUDA GPU:

    python3 plugins-attention/triton/benchmarks/bench_gather.py [--tokens 1572864]

The decode kernel reads, per token and KV head, one K row and one V row from two pools laid out
``[slot, kv_head, head_dim]``: 128 bytes each for an e4m3 pool at head dim 128, 256 for bf16.
This times a kernel that does only those reads (each program one KV head of 1,536 shuffled slots,
as decode at batch 1,024 does; the rows summed as int32 words and one small sum stored), for:

- ``k+v e4m3``: two 128-byte rows a token and head (the e4m3 pool as it is);
- ``kv e4m3 adjacent``: one 256-byte row (a pool whose K and V of a head sit side by side);
- ``k+v bf16``: two 256-byte rows (the bf16 pool).

Each line gives the time, the bytes read (rows and slots) as GB/s and as a fraction of ``--peak``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

KV_HEADS, ROWS_PER_PROGRAM = 8, 1536
#: Rows a loop step gathers (the decode kernel's fp8 tiles take 32).
BLOCKS = (32,)


@triton.jit
def _gather_kernel(K, V, Slots, Out, stride_t, stride_h, WORDS: tl.constexpr, TWO: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, WORDS)
    acc = tl.zeros([WORDS], tl.int32)
    for start in range(0, ROWS, BLOCK_N):
        slot = tl.load(Slots + seq * ROWS + start + tl.arange(0, BLOCK_N)).to(tl.int64)
        base = slot[:, None] * stride_t + head * stride_h + cols[None, :]
        acc += tl.sum(tl.load(K + base), 0)
        if TWO:
            acc += tl.sum(tl.load(V + base), 0)
    tl.store(Out + (seq * tl.num_programs(0) + head) * WORDS + cols, acc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024 * ROWS_PER_PROGRAM, help="tokens in the pool")
    parser.add_argument("--peak", type=float, default=4290.0, help="GB/s the fractions are of")
    args = parser.parse_args()
    seqs = args.tokens // ROWS_PER_PROGRAM
    slots = torch.randperm(seqs * ROWS_PER_PROGRAM, device="cuda").to(torch.int32)
    print(f"# {torch.cuda.get_device_name()}, {seqs} rows x {ROWS_PER_PROGRAM} shuffled slots, {KV_HEADS} KV heads",
          flush=True)
    for name, row_bytes, two in (("k+v e4m3", 128, True), ("kv e4m3 adjacent", 256, False), ("k+v bf16", 256, True)):
        words = row_bytes // 4
        k = torch.randint(0, 1 << 20, (seqs * ROWS_PER_PROGRAM, KV_HEADS, words), dtype=torch.int32, device="cuda")
        v = torch.randint_like(k, 0, 1 << 20) if two else k
        out = torch.empty(seqs, KV_HEADS, words, dtype=torch.int32, device="cuda")
        for block_n in BLOCKS:
            def gather(k: torch.Tensor = k, v: torch.Tensor = v, out: torch.Tensor = out, words: int = words,
                       two: bool = two, bn: int = block_n) -> None:
                _gather_kernel[(KV_HEADS, seqs)](k, v, slots, out, k.stride(0), k.stride(1), WORDS=words, TWO=two,
                                                 ROWS=ROWS_PER_PROGRAM, BLOCK_N=bn, num_warps=4, num_stages=3)

            ms = do_bench(gather, warmup=10, rep=50, return_mode="median")
            moved = seqs * ROWS_PER_PROGRAM * KV_HEADS * (row_bytes * (2 if two else 1) + 4)
            gbs = moved / (ms * 1e-3) / 1e9
            print(f"{name:<18} {row_bytes:>4} B rows x{2 if two else 1}  block {block_n:<3} {ms * 1e3:9.1f} us "
                  f"{gbs:7.0f} GB/s {gbs / args.peak:5.2f} of peak", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
