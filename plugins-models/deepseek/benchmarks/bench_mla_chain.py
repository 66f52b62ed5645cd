"""Times DeepSeek-V2-Lite's attention chain at batch-1 decode, launch by launch and as the layer runs it.

Run from the repository root on a CUDA GPU (sm_90+ for PDL):

    python3 plugins-models/deepseek/benchmarks/bench_mla_chain.py [--layers 26] [--ctx 192] [--no-pdl]

One layer's attention at one token, with the functions the CUDA path calls: the input projection
with the input RMSNorm folded in (``norm_skinny_linear``, 3,648 x 2,048), the MLA prologue with the
``W_UK`` product (``mla_prologue``), the MLA decode split kernel and its merge (``mla_decode_fwd``,
16 splits as a batch-1 CUDA graph runs it), the ``W_UV`` product (``head_matvec``) and ``o_proj``
(``skinny_linear``, 2,048 x 2,048). ``--layers`` layers each have their own weights and pool
(together far larger than L2, so weights come from HBM as in a decode step), and each layer's
output is the next one's input. Everything runs in one CUDA graph, timed by replays (median).

Lines: ``chain``, the whole chain a layer. ``--stages``: also ``<stage> alone``, ``--layers`` calls
of one stage back to back (independent calls, each waiting for the one before under PDL), and
``chain without <stage>``, the chain with that stage left out (its inputs are then stale values,
which changes no launch shape): the difference to ``chain`` is what the stage costs on the layer's
critical path. ``--decode-variants`` (``mla_decode_fwd`` keywords, or ``"splits"``), ``--in-configs``
/ ``--o-configs`` (the skinny GEMVs' launch shapes) and ``--carveout`` (every kernel's preferred
shared-memory carveout) each time the chain again with one thing changed, in the same process.
Bytes are the weights and the KV rows read; the bound is those bytes at ``--peak``. The figures in
docs/models.md (DeepSeek) and ``mla_decode_fwd``'s ``early_kv`` default come from::

    python3 plugins-models/deepseek/benchmarks/bench_mla_chain.py --decode-options '{"early_kv": false}' \
        --decode-variants '{"early_kv": true, "block_n": 16, "num_warps": 4}' '{"early_kv": false, "block_n": 16}' \
        --in-configs 4x1024 8x512x8 16x512x8 8x512x4x2 --o-configs 2x2048 8x512 4x1024x4x2 --carveout 100 25 -1
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

HIDDEN, HEADS, NOPE, ROPE, LORA, V = 2048, 16, 128, 64, 512, 128
Q_DIM = HEADS * (NOPE + ROPE)
SPLITS = 16  # choose_num_kv_splits at batch 1 (max_kv_splits 16): what a batch-1 graph runs
MAX_SPLITS = 64
STAGES = ("input_proj", "prologue", "decode", "w_uv", "o_proj")


class Chain:
    """``layers`` layers' weights, pools and the buffers one token's attention chain uses."""

    def __init__(self, layers: int, ctx: int, pdl: bool, dev: str = "cuda", decode_options: dict | None = None,
                 gemv_configs: dict[str, Any] | None = None) -> None:
        bf = torch.bfloat16
        self.layers, self.ctx, self.pdl = layers, ctx, pdl
        self.decode_options = decode_options or {}
        #: "input_proj" / "o_proj": a GemvConfig for that projection (None: choose_config's).
        self.gemv_configs = gemv_configs or {}

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, device=dev) * scale).to(bf)

        self.w_in = [rand(Q_DIM + LORA + ROPE, HIDDEN, scale=HIDDEN ** -0.5) for _ in range(layers)]
        self.w_uk = [rand(HEADS, NOPE, LORA, scale=NOPE ** -0.5) for _ in range(layers)]
        self.w_uv = [rand(HEADS, V, LORA, scale=LORA ** -0.5) for _ in range(layers)]
        self.w_o = [rand(HIDDEN, HEADS * V, scale=(HEADS * V) ** -0.5) for _ in range(layers)]
        self.pools = [rand(ctx + 8, 1, LORA + ROPE) for _ in range(layers)]
        self.norm_in = rand(HIDDEN).abs() + 0.5
        self.norm_kv = rand(LORA).abs() + 0.5
        self.x = rand(1, HIDDEN)
        self.residual = rand(1, HIDDEN)
        self.normed = torch.empty_like(self.x)
        self.res_sum = torch.empty_like(self.x)
        self.positions = torch.tensor([ctx - 1], device=dev)
        self.cos = torch.rand(4096, ROPE // 2, device=dev)
        self.sin = torch.rand(4096, ROPE // 2, device=dev)
        self.req_to_token = torch.randperm(ctx, device=dev).to(torch.int32).view(1, ctx)
        self.out_loc = self.req_to_token[0, -1:].clone()
        self.reqs = torch.zeros(1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((1,), ctx, dtype=torch.int64, device=dev)
        self.part_out = torch.empty(1, HEADS, MAX_SPLITS, LORA, dtype=torch.float32, device=dev)
        self.part_lse = torch.empty(1, HEADS, MAX_SPLITS, dtype=torch.float32, device=dev)
        self.y = torch.zeros(1, Q_DIM + LORA + ROPE, dtype=bf, device=dev)
        self.q_full = torch.zeros(1, HEADS, LORA + ROPE, dtype=bf, device=dev)
        self.k = torch.zeros(1, LORA + ROPE, dtype=bf, device=dev)
        self.o = torch.zeros(1, HEADS, LORA, dtype=bf, device=dev)
        self.ov = torch.zeros(1, HEADS, V, dtype=bf, device=dev)
        self.scale = (NOPE + ROPE) ** -0.5

    def layer_bytes(self) -> int:
        weights = (self.w_in[0].numel() + self.w_uk[0].numel() + self.w_uv[0].numel() + self.w_o[0].numel()) * 2
        return weights + self.ctx * (LORA + ROPE) * 2

    def stage(self, name: str, i: int) -> None:
        """One launch (or two: the decode's split and merge) of layer ``i``'s chain."""
        from engine_attention_triton.mla_attention import mla_decode_fwd
        from engine_models_deepseek.head_matvec import head_matvec
        from engine_models_deepseek.mla_prologue import mla_prologue
        from engine_platform_cuda.gemv import norm_skinny_linear, skinny_linear

        if name == "input_proj":
            self.y, _, _ = norm_skinny_linear(self.x, self.residual, self.norm_in, 1e-6, self.w_in[i], pdl=self.pdl,
                                              normed=self.normed, res_sum=self.res_sum,
                                              config=self.gemv_configs.get("input_proj"))
        elif name == "prologue":
            q, kv_a = self.y.split([Q_DIM, LORA + ROPE], dim=-1)
            mla_prologue(q.view(1, HEADS, NOPE + ROPE), kv_a, self.positions, self.cos, self.sin, self.norm_kv, 1e-6,
                         NOPE, True, self.q_full, self.k, self.pools[i], self.out_loc, 1.0, pdl=self.pdl,
                         w_uk=self.w_uk[i])
        elif name == "decode":
            options = dict(self.decode_options)
            splits = options.pop("splits", SPLITS)
            mla_decode_fwd(self.q_full, self.pools[i], self.o, self.req_to_token, self.reqs, self.seq_lens,
                           self.part_out, self.part_lse, splits, self.scale, LORA, pdl=self.pdl, **options)
        elif name == "w_uv":
            head_matvec(self.o, self.w_uv[i], self.ov, transposed=True, pdl=self.pdl)
        elif name == "o_proj":
            self.x = skinny_linear(self.ov.view(1, HEADS * V), self.w_o[i], pdl=self.pdl,
                                   config=self.gemv_configs.get("o_proj"))
        else:
            raise ValueError(f"stage {name!r}; accepted: {', '.join(STAGES)}")


def set_carveout(pct: int) -> int:
    """Sets ``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`` of every compiled kernel of the
    chain's Triton functions (Triton itself prefers shared memory only for kernels over 48 KB);
    returns how many kernels it set."""
    import ctypes

    from engine_attention_triton import decode_attention, mla_attention
    from engine_models_deepseek import head_matvec, mla_prologue
    from engine_platform_cuda import gemv

    if not -1 <= pct <= 100:
        raise SystemExit(f"--carveout: invalid value {pct}; accepted: -1..100")
    libcuda = ctypes.CDLL("libcuda.so.1")
    functions = (gemv._gemv_fma_kernel, mla_prologue._mla_prologue_absorb_kernel,
                 mla_attention._mla_decode_split_kernel, decode_attention._decode_merge_kernel,
                 head_matvec._head_matvec_kernel)
    count = 0
    for fn in functions:
        for cache in fn.device_caches.values():
            for kernel in cache[0].values():
                kernel._init_handles()
                err = libcuda.cuFuncSetAttribute(ctypes.c_void_p(kernel.function), 9, ctypes.c_int(pct))
                if err:
                    raise SystemExit(f"cuFuncSetAttribute(carveout {pct}) failed: CUresult {err}")
                count += 1
    return count


def parse_config(text: str) -> Any:
    """``BLOCK_NxBLOCK_K[xWARPS[xSTAGES]]`` -> an "fma" ``GemvConfig`` (PDL steps as the rule's)."""
    from engine_platform_cuda.gemv import RULE, GemvConfig

    try:
        parts = [int(p) for p in text.lower().split("x")]
        if not 2 <= len(parts) <= 4:
            raise ValueError("two to four numbers")
        config = GemvConfig("fma", parts[0], parts[1], num_warps=parts[2] if len(parts) > 2 else RULE.fma_num_warps,
                            num_stages=parts[3] if len(parts) > 3 else RULE.fma_num_stages,
                            pdl_steps=RULE.fma_pdl_steps)
        config.validate()
    except (ValueError, IndexError) as exc:
        raise argparse.ArgumentTypeError(f"invalid launch shape {text!r} ({exc}); expected e.g. 8x512 or "
                                         "4x1024x4") from None
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=26, help="layers, each with its own weights (cold in L2)")
    ap.add_argument("--ctx", type=int, default=192, help="tokens in the row (the new one included)")
    ap.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--decode-options", type=json.loads, default={},
                    help="mla_decode_fwd keyword arguments as JSON, e.g. '{\"early_kv\": false}' (\"splits\": "
                         f"the split count, 1..{MAX_SPLITS}; default {SPLITS})")
    ap.add_argument("--decode-variants", type=json.loads, nargs="*", default=[],
                    help="also time the chain with each of these --decode-options instead")
    ap.add_argument("--stages", action="store_true", help="also time each stage alone and the chain without it")
    ap.add_argument("--carveout", type=int, nargs="*", default=[],
                    help="also time the chain with every one of its kernels' preferred shared-memory carveout "
                         "set to each of these percentages (cuFuncSetAttribute; -1: the driver's choice)")
    ap.add_argument("--in-configs", type=parse_config, nargs="*", default=[],
                    help="also time the chain with these launch shapes of the input projection "
                         "(BLOCK_NxBLOCK_K[xWARPS[xSTAGES]])")
    ap.add_argument("--o-configs", type=parse_config, nargs="*", default=[],
                    help="also time the chain with these launch shapes of o_proj (BLOCK_NxBLOCK_K[xWARPS[xSTAGES]])")
    ap.add_argument("--peak", type=float, default=4290.0, help="GB/s the bound is computed at")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mla_chain.py needs a CUDA GPU")
    if a.layers < 1 or a.ctx < 2:
        raise SystemExit(f"--layers {a.layers}, --ctx {a.ctx}; accepted: layers >= 1, ctx >= 2")
    from engine_platform_cuda.gemv import supports_pdl
    from engine_platform_cuda.graph_timing import graph_median_us

    pdl = not a.no_pdl and supports_pdl()
    chain = Chain(a.layers, a.ctx, pdl, decode_options=a.decode_options)
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {now:%Y-%m-%d %H:%M} UTC; "
          f"{a.layers} layers, ctx {a.ctx}, pdl {pdl}, decode options {a.decode_options}; "
          f"bound {chain.layer_bytes() / a.peak / 1e3:.2f} us a layer "
          f"({chain.layer_bytes() / 1e6:.1f} MB at {a.peak:.0f} GB/s)", flush=True)

    def run(stages: tuple[str, ...]) -> Callable[[], None]:
        def body() -> None:
            for i in range(a.layers):
                for name in stages:
                    chain.stage(name, i)
        return body

    full = graph_median_us([run(STAGES)], a.reps) / a.layers
    print(f"chain                      {full:7.2f} us a layer", flush=True)
    for options in a.decode_variants:
        chain.decode_options = options
        us = graph_median_us([run(STAGES)], a.reps) / a.layers
        print(f"chain, decode {options}: {us:7.2f} us a layer", flush=True)
    chain.decode_options = a.decode_options
    for stage, configs in (("input_proj", a.in_configs), ("o_proj", a.o_configs)):
        for config in configs:
            chain.gemv_configs = {stage: config}
            us = graph_median_us([run(STAGES)], a.reps) / a.layers
            print(f"chain, {stage} {config.block_n}x{config.block_k} {config.num_warps} warps {config.num_stages} "
                  f"stages: {us:7.2f} us a layer", flush=True)
        chain.gemv_configs = {}
    for pct in a.carveout:
        kernels = set_carveout(pct)
        us = graph_median_us([run(STAGES)], a.reps) / a.layers
        print(f"chain, carveout {pct}% on {kernels} kernels: {us:7.2f} us a layer", flush=True)
    for name in STAGES if a.stages else ():
        alone = graph_median_us([run((name,))], a.reps) / a.layers
        without = graph_median_us([run(tuple(s for s in STAGES if s != name))], a.reps) / a.layers
        print(f"{name:<11} alone {alone:7.2f} us; chain without it {without:7.2f} us (on the path: "
              f"{full - without:5.2f} us)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
