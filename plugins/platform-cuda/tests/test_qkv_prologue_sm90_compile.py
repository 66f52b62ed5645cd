"""The fused decode prologue compiles for an H100 (sm_90) on a machine without one, as it must to
equal the separate kernels bit for bit there.

For 16-bit and float32 activations, with and without q/k norm, and for KV caches in the
activation dtype and both float8 formats: it compiles, spills nothing, converts to float8 with
round-to-nearest and saturation (``cvt.rn.satfinite``, as PyTorch's cast rounds), and divides
once only (the mean of squares; the KV scale is a multiplication by its float32 reciprocal, as
PyTorch computes ``x / scale`` on CUDA). Its sum of squares is reduced in the same layout as
``kernels.rms_norm``'s over rows of ``head_dim`` (64, 128, 256, 512), so in the same order; and
in 16-bit activations the compiler contracts the rotary in both it and ``kernels._rotary_kernel``
the same way: each output one FMA of its element and cos over the rounded product of its partner
and sin. These are the preconditions of bit-equal results that only a GPU checks end to end.

Like test_gemv_sm90_compile.py, the compile runs in a subprocess without the interpreter
(``engine.testing.aot``); pointers, strides and head sizes are declared divisible by 16, as
Triton specializes them at a real launch on these shapes.
"""

from __future__ import annotations

import json
import re

from engine.testing.aot import compile_kernel, compiled_facts, pdl_order, spill_bytes

ACTS = ("bf16", "fp16", "fp32")
CACHES = ("same", "fp8e4nv", "fp8e5")
HEAD_DIMS = (64, 128, 256, 512)
_SCALARS = ("eps", "inv_k_scale", "inv_v_scale", "fp8_max")
_DIVISIBLE = ("head_dim", "v_head_dim", "rotary_dim", "cos_stride", "n_cols")


def _compile(fn: object, types: dict[str, str], consts: dict[str, object], num_warps: int) -> object:
    return compile_kernel(fn, types, consts, num_warps=num_warps, divisible=_DIVISIBLE)


def _prologue_types(act: str, cache: str) -> dict[str, str]:
    from engine_platform_cuda import prologue

    types = {}
    for a in prologue._qkv_prologue_kernel.arg_names:
        if a in ("k_cache_ptr", "v_cache_ptr"):
            types[a] = "*" + (act if cache == "same" else cache)
        elif a in ("loc_ptr", "pos_ptr"):
            types[a] = "*i64"
        elif a in ("cos_ptr", "sin_ptr"):
            types[a] = "*fp32"
        elif a.endswith("_ptr"):
            types[a] = "*" + act
        else:
            types[a] = "fp32" if a in _SCALARS else "i32"
    return types


def _reduce_layout(ttgir: str) -> str:
    """The layout of the (first) float32 reduction's operand."""
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    found = re.search(r'"tt\.reduce".*?: \(tensor<\d+xf32, (#\w+)>\)', ttgir, re.S)
    assert found, "no float32 reduction"
    return layouts[found.group(1)]


def _fma_elements(ptx: str, act: str) -> int:
    """16-bit FMAs in ``ptx``, a packed pair counted as two."""
    kind = {"bf16": "bf16", "fp16": "f16"}[act]
    return len(re.findall(rf"fma\.rn\.{kind}\s", ptx)) + 2 * len(re.findall(rf"fma\.rn\.{kind}x2\s", ptx))


def _compile_all() -> dict[str, dict[str, object]]:
    from engine_platform_cuda import kernels, prologue

    out: dict[str, dict[str, object]] = {}
    for act in ("bf16", "fp16"):
        # One warp over a 128-wide head: 4 elements per thread in the fused kernel; the rotary
        # kernel's 32 threads hold 2 of each half (64) and write 4 outputs.
        fused = _compile(prologue._qkv_prologue_kernel, _prologue_types(act, "same"),
                         dict(HAS_NORM=False, QUANT=False, BLOCK=128, BLOCK_V=128), 1)
        rot_types = {a: ("*" + act if a in ("x_ptr", "y_ptr") else "*i64" if a == "pos_ptr"
                         else "*fp32" if a.endswith("_ptr") else "i32") for a in kernels._rotary_kernel.arg_names}
        rotary = _compile(kernels._rotary_kernel, rot_types, dict(BLOCK=64), 1)
        out[f"{act}-rotary-fma"] = {"fused": _fma_elements(fused.asm["ptx"], act),  # type: ignore[attr-defined]
                                    "rotary": _fma_elements(rotary.asm["ptx"], act)}  # type: ignore[attr-defined]
    for act in ACTS:
        for cache in CACHES:
            for norm in (False, True):
                consts = dict(HAS_NORM=norm, QUANT=cache != "same", BLOCK=128, BLOCK_V=128, PDL=False)
                compiled = _compile(prologue._qkv_prologue_kernel, _prologue_types(act, cache), consts, 1)
                ptx = compiled.asm["ptx"]  # type: ignore[attr-defined]
                out[f"{act}-{cache}-{'norm' if norm else 'plain'}"] = {
                    "spill_bytes": spill_bytes(ptx),
                    "local": len(re.findall(r"\.local", ptx)),
                    "fp8_cvt": sorted(set(re.findall(r"cvt\.[\w.]*e[45]m[23]x2\.f32", ptx))),
                    "div": len(re.findall(r"\bdiv\.", ptx)),
                }
        for head_dim in HEAD_DIMS:
            warps = kernels.norm_num_warps(head_dim)
            fused = _compile(prologue._qkv_prologue_kernel, _prologue_types(act, "same"),
                             dict(HAS_NORM=True, QUANT=False, BLOCK=head_dim, BLOCK_V=head_dim, PDL=False), warps)
            rms_types = {a: ("*" + act if a.endswith("_ptr") else "fp32" if a == "eps" else "i32")
                         for a in kernels._rmsnorm_kernel.arg_names}
            separate = _compile(kernels._rmsnorm_kernel, rms_types, dict(HAS_RESIDUAL=False, BLOCK=head_dim), warps)
            out[f"{act}-reduce-{head_dim}"] = {
                "fused": _reduce_layout(fused.asm["ttgir"]),  # type: ignore[attr-defined]
                "rms_norm": _reduce_layout(separate.asm["ttgir"]),  # type: ignore[attr-defined]
            }
    # With PDL (cuda.pdl): positions, cos/sin and the norm weights load before the wait, the
    # trigger comes first (the attention kernel after it reads no output of this one before its
    # own wait), and q/k/v only after the wait.
    pdl = _compile(prologue._qkv_prologue_kernel, _prologue_types("bf16", "same"),
                   dict(HAS_NORM=True, QUANT=False, BLOCK=128, BLOCK_V=128, PDL=True), 1)
    out["pdl"] = {**pdl_order(pdl.asm["ptx"]), "spill_bytes": spill_bytes(pdl.asm["ptx"])}  # type: ignore[attr-defined]
    return out


def test_compiles_for_sm90_as_the_separate_kernels_round() -> None:
    info = compiled_facts(__file__, timeout=900)
    for act in ("bf16", "fp16"):
        assert info[f"{act}-rotary-fma"] == {"fused": 4, "rotary": 4}, (act, info[f"{act}-rotary-fma"])
    for act in ACTS:
        for head_dim in HEAD_DIMS:
            got = info[f"{act}-reduce-{head_dim}"]
            assert got["fused"] == got["rms_norm"], (act, head_dim, got)
        for cache in CACHES:
            for norm in ("plain", "norm"):  # (the PDL variant: below)
                name = f"{act}-{cache}-{norm}"
                got = info[name]
                assert got["spill_bytes"] == 0 and got["local"] == 0, (name, got)
                assert got["div"] == (1 if norm == "norm" else 0), (name, got)
                want = {"same": [], "fp8e4nv": ["cvt.rn.satfinite.e4m3x2.f32"],
                        "fp8e5": ["cvt.rn.satfinite.e5m2x2.f32"]}[cache]
                assert got["fp8_cvt"] == want, (name, got)
    pdl = info["pdl"]
    assert pdl["waits"] == 1 and pdl["triggers"] == 1 and pdl["trigger_first"], pdl
    assert pdl["loads_before_wait"] >= 3 and pdl["spill_bytes"] == 0, pdl  # position, cos, sin, norm weights


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
