"""The DeepSeek plugin's CUDA kernels compile for an H100/H200 (sm_90) without register spills:
the fused MLA prologue at DeepSeek-V2-Lite's shape (16 heads, nope 128, latent 512 + rope 64) over
a bf16 and an fp8 pool, and the grouped top-k router at V3's (256 experts in 8 groups, top 8, the
sigmoid with correction bias and top-2 group scores) and V2's (160 experts, 8 groups of 20), the
router's float32 GEMV at 8 tokens of hidden 2048, and the per-head W_UK / W_UV products at 1 and 4
tokens (V2-Lite: 16 heads, nope and v 128, latent 512; the tiles ``head_matvec`` picks); the gate's
and the per-head products' programmatic-dependent-launch variants keep the PDL rule
(docs/cuda_kernels.md): weights requested before the one wait, the trigger after it. The prologue
with the W_UK product's programs in its launch compiles too.

Compiled in a subprocess without the interpreter (``engine.testing.aot``), so a construct only
Triton's interpreter accepts fails here on a machine without a GPU.
"""

from __future__ import annotations

import json

from engine.testing.aot import compiled_facts, compile_kernel, pdl_order, spill_bytes


def _types(fn: object, pointers: dict[str, str], floats: tuple[str, ...] = ()) -> dict[str, str]:
    return {a: pointers.get(a, "fp32" if a in floats else "i32") for a in fn.arg_names}  # type: ignore[attr-defined]


def _compile_all() -> dict[str, object]:
    from engine.layers.moe import router_grouped_kernel as rg
    from engine_models_deepseek import mla_prologue as mp

    out: dict[str, object] = {}
    for pool, pdl in (("bf16", False), ("fp8e4nv", False), ("bf16", True)):
        kernel = compile_kernel(
            mp._mla_prologue_kernel,
            _types(mp._mla_prologue_kernel,
                   {"Q": "*bf16", "KV_A": "*bf16", "Positions": "*i64", "Cos": "*fp32", "Sin": "*fp32",
                    "Norm_W": "*bf16", "K_Out": "*bf16", "Q_Out": "*bf16", "Pool": f"*{pool}", "Out_Loc": "*i64"},
                   ("eps", "k_scale", "fp8_max")),
            dict(NUM_HEADS=16, NOPE=128, LORA=512, HALF=32, BLOCK_H=16, BLOCK_C=512, BLOCK_HALF=32,
                 INTERLEAVE=True, FP8=pool != "bf16", WRITE_POOL=True, PDL=pdl), num_warps=4)
        out[f"prologue_{pool}{'_pdl' if pdl else ''}"] = spill_bytes(kernel.asm["ptx"])
        if pdl:
            out["prologue_pdl_order"] = pdl_order(kernel.asm["ptx"])
    # The prologue with the W_UK product's programs (1 token: head_matvec's tile at 128 x 64).
    types = {"Q": "*bf16", "KV_A": "*bf16", "Positions": "*i64", "Cos": "*fp32", "Sin": "*fp32", "Norm_W": "*bf16",
             "K_Out": "*bf16", "Q_Out": "*bf16", "Pool": "*bf16", "Out_Loc": "*i64", "W_UK": "*bf16"}
    absorb = compile_kernel(
        mp._mla_prologue_absorb_kernel, _types(mp._mla_prologue_absorb_kernel, types, ("eps", "k_scale", "fp8_max")),
        dict(stride_wn=1, NUM_HEADS=16, NOPE=128, LORA=512, HALF=32, BLOCK_H=16, BLOCK_C=512, BLOCK_HALF=32,
             INTERLEAVE=True, FP8=False, WRITE_POOL=True, PDL=True, N_BLOCKS=8, BLOCK_T=1, BLOCK_K=128,
             BLOCK_N=64), num_warps=4)
    out["prologue_absorb_pdl"] = spill_bytes(absorb.asm["ptx"])
    out["prologue_absorb_order"] = pdl_order(absorb.asm["ptx"])
    router_types = _types(rg._grouped_topk_kernel, {"logits_ptr": "*fp32", "bias_ptr": "*fp32",
                                                    "weights_ptr": "*fp32", "ids_ptr": "*i32"}, ("scaling",))
    v3 = compile_kernel(rg._grouped_topk_kernel, router_types,
                        dict(GROUPS=8, PER_GROUP=32, TOPK_GROUPS=4, TOP_K=8, SIGMOID=True, TOP2=True, HAS_BIAS=True,
                             RENORMALIZE=True, LIMIT_GROUPS=True, BLOCK_G=8, BLOCK_P=32, BLOCK_K=8), num_warps=4)
    v2 = compile_kernel(rg._grouped_topk_kernel, router_types,
                        dict(GROUPS=8, PER_GROUP=20, TOPK_GROUPS=3, TOP_K=6, SIGMOID=False, TOP2=False, HAS_BIAS=False,
                             RENORMALIZE=False, LIMIT_GROUPS=True, BLOCK_G=8, BLOCK_P=32, BLOCK_K=8), num_warps=4)
    from engine_models_deepseek import gate_kernel as gk

    gate_types = _types(gk._gate_kernel, {"X": "*bf16", "W": "*fp32", "Out": "*fp32", "R": "*bf16", "NW": "*bf16",
                                          "Normed": "*bf16", "Res": "*bf16"}, ("eps",))
    # The tiles gate_logits picks: one expert a program, 512-wide steps at 8 tokens, the whole row at 1.
    for name, pdl, norm, block_t, block_k in (("gate", False, False, 8, 512), ("gate_pdl", True, False, 8, 512),
                                              ("gate_norm_pdl", True, True, 1, 2048)):
        gate = compile_kernel(gk._gate_kernel, gate_types,
                              dict(HIDDEN=2048, BLOCK_T=block_t, BLOCK_E=1, BLOCK_K=block_k, PDL=pdl, NORM=norm,
                                   HAS_RES=norm), num_warps=4)
        out[name] = spill_bytes(gate.asm["ptx"])
        if pdl:
            out[f"{name}_order"] = pdl_order(gate.asm["ptx"])
    from engine_models_deepseek import head_matvec as hm

    hm_types = _types(hm._head_matvec_kernel, {"X": "*bf16", "W": "*bf16", "Out": "*bf16"})
    for tokens in (1, 4):
        for name, k, n, block_n, contiguous in (("w_uk", 128, 512, 64, "stride_wn"), ("w_uv", 512, 128, 8, "stride_wk")):
            block_k = min(8192 // (tokens * block_n), k)  # as head_matvec picks (tokens a power of two)
            kernel = compile_kernel(hm._head_matvec_kernel, hm_types,
                                    {contiguous: 1, "K": k, "N": n, "BLOCK_T": tokens, "BLOCK_K": block_k,
                                     "BLOCK_N": block_n, "PDL": tokens == 1}, num_warps=4)
            out[f"{name}_{tokens}"] = spill_bytes(kernel.asm["ptx"])
            if tokens == 1:
                out[f"{name}_pdl_order"] = pdl_order(kernel.asm["ptx"])
    out["router_v3"] = spill_bytes(v3.asm["ptx"])
    out["router_v2"] = spill_bytes(v2.asm["ptx"])
    return out


def test_kernels_compile_for_sm90_without_spills() -> None:
    """No spills; the PDL variants (gate logits, per-head products at one token) wait once, trigger
    once after the wait, and request weights before it."""
    facts = compiled_facts(__file__, timeout=600)
    orders = {k: facts.pop(k) for k in [k for k in facts if k.endswith("_pdl_order")]}
    # Two branches (the prologue's programs, the W_UK product's), each with its wait and trigger.
    absorb = facts.pop("prologue_absorb_order")
    assert absorb["waits"] == 2 and absorb["triggers"] == 2 and absorb["loads_before_wait"] >= 1, absorb
    assert facts == {"prologue_bf16": 0, "prologue_fp8e4nv": 0, "prologue_bf16_pdl": 0, "prologue_absorb_pdl": 0,
                     "gate": 0, "gate_pdl": 0, "gate_norm_pdl": 0,
                     "router_v3": 0, "router_v2": 0, "w_uk_1": 0, "w_uv_1": 0, "w_uk_4": 0, "w_uv_4": 0}
    assert sorted(orders) == ["gate_norm_pdl_order", "gate_pdl_order", "prologue_pdl_order", "w_uk_pdl_order",
                              "w_uv_pdl_order"]
    for name, order in orders.items():
        # The prologue lets the attention launch start at once (it reads nothing before its own
        # wait that the prologue writes); the others trigger after their wait.
        assert order["waits"] == 1 and order["triggers"] == 1, (name, order)
        assert order["trigger_first"] == (name == "prologue_pdl_order"), (name, order)
        assert order["loads_before_wait"] >= 1, (name, order)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
