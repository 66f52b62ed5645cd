"""The hierarchical cache's Triton copy kernels (``engine.mem_cache.kv_copy_kernel``) compile for
an H200 (sm_90): the gather and the scatter of a Llama-3-8B pool (64 parts, 8 heads x 128, moved
as 16-bit words), dense (every part one width: 16-byte vector loads and stores) and with narrower
V parts (masked), without register spills. Compiled in a subprocess without the interpreter
(``engine.testing.aot``)."""

from __future__ import annotations

import json

from engine.testing.aot import compile_kernel, compiled_facts, spill_bytes


def _compile_all() -> dict[str, dict[str, int]]:
    from engine.mem_cache.kv_copy_kernel import BLOCK_T, BLOCK_T_MASKED, _get_kernels

    kernels = _get_kernels()
    out: dict[str, dict[str, int]] = {}
    for name in ("gather", "scatter"):
        fn = kernels[name]
        rows_arg = "out_ptr" if name == "gather" else "rows_ptr"
        types = {"part_ptrs": "*i64", "part_dims": "*i32", "idx_ptr": "*i64", rows_arg: "*i16", "n": "i32"}
        for dense in (True, False):
            k = compile_kernel(fn, types, dict(HEADS=8, WIDTH=128, PARTS=64, BLOCK_T=BLOCK_T if dense else BLOCK_T_MASKED, BLOCK_E=1024,
                                               DENSE=dense), num_warps=4)
            ptx = k.asm["ptx"]
            out[f"{name}-{'dense' if dense else 'masked'}"] = {
                "v4_loads": ptx.count("ld.global.v4"), "v4_stores": ptx.count("st.global.v4"),
                "spill_bytes": spill_bytes(ptx)}
    return out


def test_copy_kernels_compile_for_sm90_with_vector_access_when_dense() -> None:
    facts = compiled_facts(__file__, timeout=600)
    for name, f in facts.items():
        assert f["spill_bytes"] == 0, (name, f)
    for name in ("gather-dense", "scatter-dense"):
        assert facts[name]["v4_loads"] > 0 and facts[name]["v4_stores"] > 0, (name, facts[name])


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
