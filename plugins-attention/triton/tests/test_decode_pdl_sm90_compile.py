"""The decode attention kernels with programmatic dependent launch compile for an H100 (sm_90) to
the order the PDL rule needs (docs/cuda_kernels.md, "Programmatic dependent launch").

- Stage 1 (split) triggers first (the merge after it loads nothing before its wait, the output
  projection after that only weights), gathers before its wait (lengths, slots, the first block's
  earlier keys and values) and has one wait; with a bf16 pool and with an fp8 one.
- Stage 2 (merge) triggers first (the output projection after it reads only weights before its
  own wait) and loads nothing before its wait.
- Neither spills registers.
- An e4m3 pool gathered as words (the default under bf16 queries) widens without the float16
  round trip (no ``cvt.bf16.f16``, one F2F per value on a slow pipe), in the plain loop (batch 1)
  and in the slots-ahead loop (large batches), whose K/V gathers are double-buffered (async copies
  waited on with one group still in flight).
- Gathered as words and widened to float16 by the paired hardware conversion (``words`` 3), no
  operand reaches the tensor cores' layout as single bytes from shared memory, as ``words`` 2's V does.

Compiled in a subprocess without the interpreter (``engine.testing.aot``) at Qwen3-30B-A3B's
heads (32 query heads on 4 KV heads, head_dim 128) with 16 splits, as a CUDA graph at batch 1
launches them.
"""

from __future__ import annotations

import json
import re

from engine.testing.aot import compiled_facts, compile_kernel, pdl_order, spill_bytes

#: name -> (pool dtype, SLOTS_AHEAD, WORDS, HEADS_INNER)
POOLS = {"bf16": ("bf16", False, 0, False), "fp8e4nv": ("fp8e4nv", False, 1, False),
         "fp8e4nv-ahead": ("fp8e4nv", True, 1, True), "bf16-ahead": ("bf16", True, 0, True),
         "fp8e4nv-f16": ("fp8e4nv", True, 2, True), "fp8e4nv-words-f16": ("fp8e4nv", True, 3, True)}


def _compile_all() -> dict[str, dict[str, object]]:
    from engine_attention_triton import decode_attention as da

    out: dict[str, dict[str, object]] = {}
    for name, (pool, ahead, words, heads_inner) in POOLS.items():
        types = {a: "i32" for a in da._decode_split_kernel.arg_names}
        types.update(Q="*bf16", K_Buf="*" + pool, V_Buf="*" + pool, Req_To_Token="*i32", Req_Pool_Indices="*i64",
                     Seq_Lens="*i64", Part_Out="*fp32", Part_Lse="*fp32", sm_scale="fp32", logit_cap="fp32",
                     v_scale="fp32")
        split = compile_kernel(da._decode_split_kernel, types,
                               dict(GROUP=8, BLOCK_H=16, BLOCK_N=64, HEAD_DIM=128, V_DIM=128, BLOCK_D=128,
                                    BLOCK_DV=128, SLIDING_WINDOW=-1, HAS_CAP=False, DOT_PRECISION="tf32",
                                    DIRECT=False, PDL=True, SLOTS_AHEAD=ahead, WORDS=words,
                                    HEADS_INNER=heads_inner, KV_PER_PROGRAM=1), num_warps=4)
        ptx = split.asm["ptx"]
        out[f"split-{name}"] = {**pdl_order(ptx), "spill_bytes": spill_bytes(ptx),
                                "cvt_bf16_f16": ptx.count("cvt.bf16.f16"),
                                "cvt_f16x2_e4m3x2": ptx.count("cvt.rn.f16x2.e4m3x2"),
                                "ld_shared_b8": ptx.count("ld.shared.b8"),
                                "async_waits": re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)}
    types = {a: "i32" for a in da._decode_merge_kernel.arg_names}
    types.update(Part_Out="*fp32", Part_Lse="*fp32", Out="*bf16")
    merge = compile_kernel(da._decode_merge_kernel, types, dict(V_DIM=128, BLOCK_DV=128, BLOCK_S=16, PDL=True),
                           num_warps=4)
    out["merge"] = {**pdl_order(merge.asm["ptx"]), "spill_bytes": spill_bytes(merge.asm["ptx"])}
    return out


def test_pdl_decode_kernels_compile_to_the_rule() -> None:
    info = compiled_facts(__file__, timeout=600)
    for name in POOLS:
        got = info[f"split-{name}"]
        assert got["waits"] == 1 and got["triggers"] == 1 and got["trigger_first"], (name, got)
        assert got["loads_before_wait"] >= 3, (name, got)  # lengths, slots, the first block's K and V
    assert info["split-fp8e4nv"]["cvt_bf16_f16"] == info["split-fp8e4nv-ahead"]["cvt_bf16_f16"] == 0, info
    # words=2: the pool widens to float16 by the paired hardware conversion, never through bf16.
    f16 = info["split-fp8e4nv-f16"]
    assert f16["cvt_bf16_f16"] == 0 and f16["cvt_f16x2_e4m3x2"] > 0, f16
    # words=3: the same conversion on the words gathered, before the tiles reach shared memory for the
    # tensor cores' layout, so no operand is read from there a byte at a time (words=2's V is).
    words_f16 = info["split-fp8e4nv-words-f16"]
    assert words_f16["cvt_bf16_f16"] == 0 and words_f16["cvt_f16x2_e4m3x2"] > 0, words_f16
    assert words_f16["ld_shared_b8"] == 0 < f16["ld_shared_b8"], (words_f16, f16)
    for name in ("fp8e4nv-ahead", "bf16-ahead", "fp8e4nv-f16", "fp8e4nv-words-f16"):  # three stages: a group still in flight at each wait
        assert any(int(n) > 0 for n in info[f"split-{name}"]["async_waits"]), (name, info[f"split-{name}"])
    assert {k: v for k, v in info["merge"].items() if k != "spill_bytes"} == {
        "waits": 1, "triggers": 1, "trigger_first": True, "loads_before_wait": 0}, info["merge"]
    assert all(v["spill_bytes"] == 0 for v in info.values()), info


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
