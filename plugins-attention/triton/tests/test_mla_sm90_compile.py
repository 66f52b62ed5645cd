"""The MLA kernels compile for an H100/H200 (sm_90) at DeepSeek's shape (16 query heads, a latent of
512 + 64 dims) with their default tiles, without register spills: over a bf16 pool (both loops),
over an e4m3 pool gathered as int32 words (the slots-ahead loop, 3 stages; the default under bf16
queries), whose widening must not go through Triton's f16 path (no ``cvt.bf16.f16``), over an
e4m3 pool widened to float16, one ``cvt.rn.f16x2.e4m3x2`` per pair, and with programmatic dependent
launch (the PDL rule of docs/cuda_kernels.md).

Compiled in a subprocess without the interpreter (``engine.testing.aot``), so a kernel that only
Triton's interpreter accepts, or a tile choice that spills, fails here on a machine without a GPU.
"""

from __future__ import annotations

import json

import torch

from engine.testing.aot import compiled_facts, compile_kernel, pdl_order, spill_bytes

DEEPSEEK = dict(LORA=512, ROPE=64, BLOCK_C=512, BLOCK_R=64, HAS_CAP=False, DOT_PRECISION="tf32")


def _compile(fn, types: dict[str, str], consts: dict[str, object], num_warps: int, num_stages: int):  # type: ignore[no-untyped-def]
    """``compile_kernel`` with every run-time argument not named in ``types`` an ``i32``."""
    types = {a: types.get(a, "i32") for a in fn.arg_names if a not in consts}
    return compile_kernel(fn, types, consts, num_warps=num_warps, num_stages=num_stages)


def _compile_all() -> dict[str, object]:
    from engine_attention_triton import mla_attention as m

    scalars = dict(sm_scale="fp32", logit_cap="fp32", out_scale="fp32")
    ptx: dict[str, str] = {}
    # name -> (pool dtype, WIDEN, SLOTS_AHEAD, num_warps, num_stages, PDL, EARLY_KV, BLOCK_N); the
    # last: PDL at up to MLA_EARLY_KV_MAX_ROWS rows (the first block gathered before the wait).
    for name, (pool, widen, ahead, warps, stages, pdl, early, block_n) in {
            "decode": ("bf16", 0, False, 4, 2, False, False, 32), "ahead": ("bf16", 0, True, 4, 3, False, False, 32),
            "words": ("fp8e4nv", 1, True, 4, 3, False, False, 32), "f16": ("fp8e4nv", 2, True, 8, 3, False, False, 32),
            "pdl": ("bf16", 0, False, 4, 2, True, False, 32),
            "pdl_early": ("bf16", 0, False, 4, 2, True, True, 16)}.items():
        kernel = _compile(m._mla_decode_split_kernel,
                          dict(Q="*bf16", KV=f"*{pool}", Req_To_Token="*i32", Req_Pool_Indices="*i64",
                               Seq_Lens="*i64", Part_Out="*fp32", Part_Lse="*fp32", **scalars),
                          dict(NUM_HEADS=16, BLOCK_H=m.MLA_DECODE_BLOCK_H, BLOCK_N=block_n, DIRECT=False, WIDEN=widen,
                               SLOTS_AHEAD=ahead, PDL=pdl, EARLY_KV=early, **DEEPSEEK),
                          num_warps=warps, num_stages=stages)
        ptx[name] = kernel.asm["ptx"]
    block_m, block_n, warps, stages = m.default_mla_extend_config(torch.bfloat16, torch.bfloat16)
    extend = _compile(m._mla_extend_kernel,
                      dict(Q="*bf16", K_New="*bf16", Out="*bf16", KV="*bf16", Req_To_Token="*i32",
                           Req_Pool_Indices="*i64", Prefix_Lens="*i64", Extend_Lens="*i64", Extend_Start="*i64",
                           Tree_Mask="*u8", Tree_Mask_Indptr="*i64", **scalars),
                      dict(BLOCK_M=block_m, BLOCK_N=block_n, TREE_MASK=False, **DEEPSEEK),
                      num_warps=warps, num_stages=stages)
    return {"decode": spill_bytes(ptx["decode"]), "extend": spill_bytes(extend.asm["ptx"]),
            "decode_slots_ahead": spill_bytes(ptx["ahead"]),
            "decode_fp8_words": spill_bytes(ptx["words"]),
            "fp8_words_f16_widening": "cvt.bf16.f16" in ptx["words"],
            "decode_fp8_f16": spill_bytes(ptx["f16"]),
            "fp8_f16_pair_cvt": "cvt.rn.f16x2.e4m3x2" in ptx["f16"] and "cvt.bf16.f16" not in ptx["f16"],
            "decode_pdl": spill_bytes(ptx["pdl"]), "decode_pdl_early": spill_bytes(ptx["pdl_early"]),
            "decode_pdl_order": pdl_order(ptx["pdl"]), "decode_pdl_early_order": pdl_order(ptx["pdl_early"])}


def test_mla_kernels_compile_for_sm90_without_spills() -> None:
    """No spills; with PDL the decode kernel triggers first (the next launch may start at once) and
    waits once, after reading the row's length, request and slots (and, at small batches, its first
    block's rows)."""
    facts = compiled_facts(__file__, timeout=600)
    order = facts.pop("decode_pdl_order")
    early = facts.pop("decode_pdl_early_order")
    assert facts == {"decode": 0, "extend": 0, "decode_slots_ahead": 0, "decode_fp8_words": 0,
                     "fp8_words_f16_widening": False, "decode_fp8_f16": 0, "fp8_f16_pair_cvt": True,
                     "decode_pdl": 0, "decode_pdl_early": 0}
    for facts_pdl in (order, early):
        assert facts_pdl["waits"] == 1 and facts_pdl["triggers"] == 1 and facts_pdl["trigger_first"], facts_pdl
    assert order["loads_before_wait"] >= 2, order
    # Also the first block's latent and rope rows.
    assert early["loads_before_wait"] > order["loads_before_wait"], (order, early)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
