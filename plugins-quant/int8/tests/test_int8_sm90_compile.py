"""The kernels compile for an H100 (sm90) on a machine without one, and compile to what they were
written for: 16-byte weight loads in the GEMV, a pipelined wgmma int8 GEMM, no I2F conversions.

Triton compiles ahead of time from its own bundled ptxas; the interpreter (which the root conftest
turns on without a GPU) plays no part, so the compile runs in a subprocess without it. Pointers,
strides and N are declared divisible by 16, as Triton specializes them at a real launch on
Llama-sized tensors; without that the GEMV falls back to byte loads.
"""

from __future__ import annotations

import json
import re

from engine.testing.aot import compile_kernel, compiled_facts


def _compile_all() -> dict[str, dict[str, object]]:
    from engine_quant_int8 import kernels_w8a8 as k8
    from engine_quant_int8 import kernels_w8a16 as k16

    def build(fn: object, types: dict[str, str], consts: dict[str, object], num_warps: int = 4,
              num_stages: int = 3) -> dict[str, object]:
        compiled = compile_kernel(fn, types, consts, num_warps=num_warps, divisible=("N",), num_stages=num_stages)
        ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
        return {"wgmma": "warp_group_dot" in ttgir, "async_copies": "async_copy_global_to_local" in ttgir,
                "v4_loads": len(re.findall(r"ld\.global(?:\.nc)?\.v4", ptx)),
                "byte_loads": len(re.findall(r"ld\.global(?:\.nc)?\.b8", ptx)),
                "i2f": len(re.findall(r"cvt\.rn\.f32\.s", ptx)), "shared": compiled.metadata.shared}

    act = {"x_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
    w8a16 = {**act, "w_ptr": "*i8", "w_scale_ptr": "*fp32", "part_ptr": "*fp32", "M": "i32", "N": "i32",
             "stride_xm": "i32", "stride_om": "i32"}
    return {
        "quantize": build(k8._quantize_rows_kernel, {"x_ptr": "*bf16", "q_ptr": "*i8", "scale_ptr": "*fp32",
                                                     "static_scale_ptr": "*fp32", "stride_x": "i32"},
                          {"K": 4096, "STATIC": False, "BLOCK": 4096}, num_warps=8),
        "w8a8_gemm": build(k8._w8a8_gemm_kernel, {"a_ptr": "*i8", "w_ptr": "*i8", "a_scale_ptr": "*fp32",
                                                   "w_scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
                                                   "M": "i32", "N": "i32", "stride_om": "i32"},
                           {"K": 14336, "HAS_BIAS": True, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128,
                            "GROUP_M": 8}, num_warps=8, num_stages=4),
        "rescale": build(k8._rescale_kernel, {"acc_ptr": "*i32", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32",
                                              "bias_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32",
                                              "stride_acc": "i32", "stride_om": "i32"},
                         {"HAS_BIAS": True, "BLOCK_M": 32, "BLOCK_N": 128}),
        "gemv": build(k16._gemv_kernel, w8a16, {"K": 4096, "K_PER_SPLIT": 4096, "HAS_BIAS": True, "SPLIT_K": 1,
                                                "BLOCK_N": 16, "BLOCK_K": 512}),
        "dot": build(k16._dot_kernel, w8a16, {"K": 4096, "K_PER_SPLIT": 1024, "HAS_BIAS": True, "SPLIT_K": 4,
                                              "IEEE": False, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256}),
        "splitk_reduce": build(k16._splitk_reduce_kernel, {"part_ptr": "*fp32", "w_scale_ptr": "*fp32",
                                                           "bias_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32",
                                                           "N": "i32", "stride_om": "i32"},
                               {"HAS_BIAS": True, "SPLIT_K": 4, "BLOCK_N": 256}),
    }


def test_kernels_compile_for_sm90_as_designed() -> None:
    info = compiled_facts(__file__, timeout=300)
    assert info["w8a8_gemm"]["wgmma"] and info["w8a8_gemm"]["async_copies"], info["w8a8_gemm"]
    assert info["gemv"]["v4_loads"] > 0 and info["gemv"]["byte_loads"] == 0, info["gemv"]
    assert info["dot"]["async_copies"] and info["dot"]["byte_loads"] == 0, info["dot"]
    assert info["quantize"]["v4_loads"] > 0, info["quantize"]
    for name in ("gemv", "dot"):
        assert info[name]["i2f"] == 0, f"{name}: int8 -> float should not use cvt (I2F): {info[name]}"


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
