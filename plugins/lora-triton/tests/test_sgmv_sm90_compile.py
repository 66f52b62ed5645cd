"""The SGMV kernels compile for an H100/H200 (sm_90) in the forms the launchers pick for
Llama-3-8B's projections (decode: one token a program; prefill: token tiles with ``tl.dot``), in
bfloat16, without register spills. The interpreter tests check the arithmetic; this checks that
the code the GPU runs (early returns, the slice helper, the constexpr branches) compiles.

Compiled in a subprocess without the interpreter (``engine.testing.aot``), as a script run.
"""

from __future__ import annotations

import json

from engine.testing.aot import compile_kernel, compiled_facts, spill_bytes

INDEX = dict(seg_indptr_ptr="*i32", weight_indices_ptr="*i32", ranks_ptr="*i32")


def _compile_all() -> dict[str, int]:
    from engine_lora_triton import kernels as k

    facts: dict[str, int] = {}
    types = {a: "i32" for a in k._shrink_kernel.arg_names}
    types.update(x_ptr="*bf16", a_ptr="*bf16", y_ptr="*bf16", **INDEX)
    for name, (segments, seg_len, rows, width) in {"decode-1": (1, 1, 48, 4096), "decode-64": (64, 1, 48, 14336),
                                                   "prefill": (4, 512, 48, 4096)}.items():
        cfg = k.shrink_config(segments, seg_len, rows, width, 132)
        warps = cfg.pop("num_warps")
        cfg.pop("num_stages")
        kernel = compile_kernel(k._shrink_kernel, types, dict(ROWS=rows, K=width, DOT=cfg["BLOCK_T"] > 1, WIDEN=False,
                                                              IEEE=False, **cfg), num_warps=warps)
        facts[f"shrink-{name}"] = spill_bytes(kernel.asm["ptx"])
    types = {a: "i32" for a in k._expand_kernel.arg_names}
    types.update(y_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", scalings_ptr="*fp32", **INDEX)
    for name, (segments, seg_len, slices, r) in {"decode-1": (1, 1, 3, 16), "decode-64": (64, 1, 2, 64),
                                                 "prefill": (4, 512, 3, 64)}.items():
        cfg = k.expand_config(segments, seg_len, 6144, r, 132)
        warps = cfg.pop("num_warps")
        cfg.pop("num_stages")
        kernel = compile_kernel(k._expand_kernel, types, dict(R=r, N_SLICES=slices, DOT=cfg["BLOCK_T"] > 1,
                                                              WIDEN=False, IEEE=False, **cfg), num_warps=warps)
        facts[f"expand-{name}"] = spill_bytes(kernel.asm["ptx"])
    return facts


def test_kernels_compile_for_sm90_without_spills() -> None:
    facts = compiled_facts(__file__, timeout=600)
    assert len(facts) == 6 and all(v == 0 for v in facts.values()), facts


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
