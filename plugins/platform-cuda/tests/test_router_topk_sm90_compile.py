"""The one-launch router + top-k (``router_topk.norm_router_topk``) compiles for an H100 (sm_90) to
what its bit-equality with the two launches it replaces rests on, checked without a GPU.

Each case's three launches are recorded from the host code, not run (``engine.testing.aot``:
``norm_skinny_linear`` and ``select_experts_triton``, as the layer ran them, and the fused launch on
the same inputs), then compiled as Triton's launcher would compile them on an H100 (specialized on
the actual arguments). Then:

- the skinny GEMM's TTGIR (register layouts included) is, op for op, the start of the fused kernel's:
  the logits, the norm output and the residual sum are computed as before;
- every float32 reduction of the top-k (the maximum, the softmax's sum, the renormalisation's sum)
  runs in the top-k kernel's register layout within each warp (the same values a thread, the same
  lanes, the warps only along the tile's repeated rows), so it adds in the same order;
- the ticket orders the stores (a CTA barrier after the last logit store, then one acquire-release
  atomic at GPU scope), the last program reads the logits from L2 (``ld.global.cg``), PDL has one
  trigger before one wait, and nothing spills.

For the expert counts ``topk_tile_rows`` refuses (60, 100: the top-k kernel's row wraps around its
warp's registers), the check runs on the launch a naive tile (one row a top-k-sized warp group)
would make and must find the sums in another order: the refusal is needed.
"""

from __future__ import annotations

import re
from typing import Any

from engine.testing.aot import compiled_facts

#: (experts, hidden, top_k, dtype, renormalize, residual): Qwen3-30B-A3B, Qwen3-235B-A22B (128 x 2048 /
#: 4096, top 8), Mixtral (8 x 4096, top 2), DeepSeek-V2-Lite-like 64 x 2048 top 6, 160, 200 and 256
#: experts (the top-k kernel's 4 warps; 200: no vector loads, its row wraps in both kernels alike), 4,
#: 16 and 32 experts (a row shorter than a warp; 4: the tiny test models), and 60 and 100 experts
#: (refused: their row stride allows no vector loads, so the top-k kernel's one-warp row wraps).
CASES = [(128, 2048, 8, "bf16", True, True), (128, 4096, 8, "bf16", False, True), (8, 4096, 2, "bf16", True, True),
         (64, 2048, 6, "bf16", False, False), (160, 1536, 6, "bf16", True, True), (256, 2048, 8, "fp16", True, True),
         (16, 512, 4, "fp16", True, True), (32, 256, 4, "bf16", True, False), (4, 256, 2, "bf16", True, True),
         (60, 2048, 4, "bf16", False, True), (100, 512, 8, "bf16", True, True), (200, 1024, 8, "bf16", True, True)]
REFUSED = {60, 100}


def test_fused_launch_computes_as_the_two_launches_compiled() -> None:
    facts = compiled_facts(__file__, timeout=1200)
    assert sorted(facts) == sorted(_name(*case) for case in CASES)
    for name, got in facts.items():
        experts = int(name.split("-")[0])
        assert got["planned"] is (experts not in REFUSED), (name, got)
        assert got["gemv_prefix"], (name, got)
        assert got["sums"] == (3 if "renorm" in name else 2), (name, got)  # max, softmax sum (, renormalisation)
        if experts in REFUSED:
            assert not got["sums_match"], (name, got)
            continue
        assert got["sums_match"], (name, got)
        assert got["spill_bytes"] == 0, (name, got)
        assert got["pdl"] == {"waits": 1, "triggers": 1, "trigger_first": True}, (name, got)
        assert got["atomics"] == got["acq_rel_gpu_atomics"] == 1, (name, got)
        assert got["barrier_between_logits_and_ticket"], (name, got)
        assert got["cg_loads"] >= 1, (name, got)


def _name(experts: int, hidden: int, top_k: int, dtype: str, renormalize: bool, residual: bool) -> str:
    return f"{experts}-{hidden}-top{top_k}-{dtype}{'-renorm' if renormalize else ''}{'-res' if residual else ''}"


def _ops(ttgir: str) -> list[str]:
    """The TTGIR's operations with layout aliases spelled out and value names, locations and
    constants dropped (constants are hoisted and shared differently; their users carry the types)."""
    aliases = dict(re.findall(r"^(#[\w]+) = (.*)$", ttgir, re.M))
    ops = []
    for line in ttgir.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "loc", "module", "tt.func", "tt.return")) or "arith.constant" in line:
            continue
        line = re.sub(r"%[\w#]+", "%v", re.sub(r" loc\(.*$", "", line))
        ops.append(re.sub(r"#[a-z]+\d*\b", lambda m: aliases.get(m.group(0), m.group(0)), line))
    return ops


def _float_reductions(ops: list[str]) -> list[tuple[str, list[int], dict[str, Any]]]:
    """(combine op, input shape, blocked layout fields) of each float32 ``tt.reduce``."""
    out = []
    for i, line in enumerate(ops):
        if '"tt.reduce"' not in line:
            continue
        end = next(j for j in range(i, len(ops)) if ops[j].startswith("}) :"))
        combine = next(op for op in ("arith.addf", "arith.maxnumf", "arith.minsi", "arith.maxsi") if op in ops[i + 2])
        m = re.search(r"\(tensor<([\dx]+)xf32, #ttg\.blocked<\{(.*?)\}>>\)", ops[end])
        if m is None:
            continue  # an integer reduction: exact in any order
        fields = {k: [int(v) for v in vals.split(", ")] for k, vals in re.findall(r"(\w+) = \[([\d, ]+)\]", m.group(2))}
        out.append((combine, [int(d) for d in m.group(1).split("x")], fields))
    return out


def _same_order(ours: list[Any], theirs: list[Any], rows: int) -> bool:
    """Each of our reductions is the top-k kernel's, per warp: same op, same per-thread and per-warp
    layout, our extra warps (``rows`` times as many) only along the tile's copies of the row."""
    if len(ours) != len(theirs):
        return False
    for (op, shape, lay), (t_op, t_shape, t_lay) in zip(ours, theirs, strict=True):
        if op != t_op or shape != [rows, t_shape[1]] or t_shape[0] != 1:
            return False
        if any(lay[k] != t_lay[k] for k in ("sizePerThread", "threadsPerWarp", "order")):
            return False
        if lay["warpsPerCTA"] != [t_lay["warpsPerCTA"][0] * rows, t_lay["warpsPerCTA"][1]]:
            return False
    return True


def _facts(case: tuple[Any, ...]) -> dict[str, Any]:
    import torch
    import triton
    from engine_platform_cuda import gemv, router_topk
    from engine_platform_cuda.router_topk import (
        _norm_router_topk_kernel,
        norm_router_topk,
        topk_tile_rows,
    )

    from engine.layers.moe.router_kernel import (
        _softmax_topk_kernel,
        select_experts_triton,
        topk_num_warps,
    )
    from engine.testing.aot import captured_launches, compile_launch, pdl_order, spill_bytes

    experts, hidden, top_k, dtype, renormalize, residual = case
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    x, r, norm_w = torch.randn(1, hidden).to(dt), torch.randn(1, hidden).to(dt), torch.randn(hidden).to(dt)
    w = torch.randn(experts, hidden).to(dt)
    res = r if residual else None
    planned = topk_tile_rows(experts, experts, 4) is not None
    rows = 4 // topk_num_warps(triton.next_power_of_2(experts))
    if not planned:  # what a tile of one row a top-k-sized warp group would do
        router_topk.topk_tile_rows = lambda *args: rows
    with captured_launches(gemv._gemv_fma_kernel, _softmax_topk_kernel, _norm_router_topk_kernel) as launches:
        logits, _, _ = gemv.norm_skinny_linear(x, res, norm_w, 1e-6, w, None, pdl=True)
        select_experts_triton(logits, top_k, renormalize, pdl=True)
        norm_router_topk(x, res, norm_w, 1e-6, w, None, top_k, renormalize, pdl=True)
    router_topk.topk_tile_rows = topk_tile_rows
    gemv_k, topk_k, fused_k = (compile_launch(launch) for launch in launches)
    gemv_ops, topk_ops, fused_ops = (_ops(k.asm["ttgir"]) for k in (gemv_k, topk_k, fused_k))
    while gemv_ops[-1] == "}":  # the ends of its function and module
        gemv_ops.pop()
    prefix = fused_ops[:len(gemv_ops)] == gemv_ops
    ours = _float_reductions(fused_ops[len(gemv_ops):])
    ptx = fused_k.asm["ptx"]
    atomic = re.search(r"\batom\.\S+", ptx)
    order = pdl_order(ptx)
    return {
        "planned": planned, "gemv_prefix": prefix, "sums": len(ours),
        "sums_match": _same_order(ours, _float_reductions(topk_ops), rows),
        "spill_bytes": spill_bytes(ptx) if planned else None,
        "pdl": {key: order[key] for key in ("waits", "triggers", "trigger_first")},
        "atomics": len(re.findall(r"\batom\.", ptx)),
        "acq_rel_gpu_atomics": len(re.findall(r"\batom\.global\.gpu\.acq_rel\.", ptx)),
        # The CTA barrier sits after the logit's store and before the ticket.
        "barrier_between_logits_and_ticket": atomic is not None and "bar.sync" in ptx[
            ptx.rfind("st.global", 0, atomic.start()):atomic.start()],
        "cg_loads": len(re.findall(r"ld\.global\.cg", ptx)),
    }


if __name__ == "__main__":
    import json

    print(json.dumps({_name(*case): _facts(case) for case in CASES}))
