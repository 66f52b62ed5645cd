"""The fused GEMM and the GEMV compile for an H100 (sm90) on a machine without one, to what they
were written for: wgmma with the dequantized weight tile as its register operand (no ldmatrix,
so no shared-memory round trip for the weights), cp.async-pipelined loads, activation tiles that
never pass through 16-bit shared stores in the K loop, no local-memory spills; 16-byte weight
loads in the GEMV.

Triton compiles ahead of time with its bundled ptxas; the interpreter (which the root conftest
turns on without a GPU) plays no part, so the compile runs in a subprocess without it. Pointers,
strides and N are declared divisible by 16 and the weight's K stride equal to 1, as Triton
specializes them at a real launch on Llama-sized tensors.
"""

from __future__ import annotations

import json
import re

from engine.testing.aot import compile_kernel, compiled_facts


def _loop_body(ptx: str) -> str:
    """The instructions of the innermost K loop (all of them where K is one tile: no loop)."""
    lines = ptx.splitlines()
    start = next((i for i, line in enumerate(lines) if "Inner Loop Header" in line), None)
    if start is None:
        return ptx
    label = lines[start].split(":")[0]
    end = next(i for i in range(start, len(lines)) if "bra" in lines[i] and label in lines[i])
    return "\n".join(lines[start:end])


def _compile_all() -> dict[str, dict[str, object]]:
    from engine_quant_wna16 import kernels as k

    def build(fn: object, types: dict[str, str], consts: dict[str, object], num_warps: int, num_stages: int):
        compiled = compile_kernel(fn, types, consts, num_warps=num_warps, divisible=("N",), num_stages=num_stages)
        ptx = compiled.asm["ptx"]
        loop = _loop_body(ptx)
        return {"wgmma": "wgmma.mma_async" in ptx, "ldmatrix": "ldmatrix" in ptx,
                "cp_async": "cp.async" in loop, "loop_st_shared_b16": len(re.findall(r"st\.shared\.b16", loop)),
                "local": len(re.findall(r"\.local", ptx)), "i2f_in_loop": len(re.findall(r"cvt\.rn\.f32\.s32", loop)),
                "v4_loads": len(re.findall(r"ld\.global(?:\.nc)?(?:\.L1::evict_\w+)?(?:\.L2::\w+)?\.v4", ptx))}

    types = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "perm_ptr": "*i32",
             "bias_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32", "M": "i32", "N": "i32",
             "stride_xm": "i32", "stride_om": "i32", "stride_qn": "i32"}
    base = dict(stride_qk=1, BITS=4, GROUP=128, PLANE=16, HAS_ZEROS=True, HAS_PERM=False, HAS_BIAS=False,
                DOT_FP32=False, USE_ASM=True)
    out = {}
    # The three tiles choose_config takes (M <= 16, <= 64, <= 256) on Llama-8B's down (K 14336, split 8/8/2).
    for name, (bm, bn, w, st, sf, split) in {"gemm16": (16, 128, 8, 4, False, 8), "gemm64": (64, 128, 8, 3, True, 8),
                                            "gemm256": (128, 64, 4, 3, False, 2)}.items():
        consts = dict(base, K=14336, SCALE_FIRST=sf, SPLIT_K=split, K_SPLIT=14336 // split,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128)
        out[name] = build(k._gemm_kernel, types, consts, w, st)
    gemv_types = {n: t for n, t in types.items() if n != "part_ptr"}
    gemv_consts = {c: v for c, v in base.items() if c != "DOT_FP32"}
    out["gemv"] = build(k._gemv_kernel, gemv_types,
                        dict(gemv_consts, K=4096, EVEN_K=True, BLOCK_M=1, BLOCK_N=16, BLOCK_K=4096), 4, 1)
    return out


def test_kernels_compile_for_sm90_as_designed() -> None:
    info = compiled_facts(__file__, timeout=600)
    for name in ("gemm16", "gemm64", "gemm256"):
        got = info[name]
        assert got["wgmma"] and got["cp_async"] and not got["ldmatrix"], (name, got)
        assert got["loop_st_shared_b16"] == 0 and got["local"] == 0 and got["i2f_in_loop"] == 0, (name, got)
    assert info["gemv"]["v4_loads"] > 0 and info["gemv"]["local"] == 0, info["gemv"]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
