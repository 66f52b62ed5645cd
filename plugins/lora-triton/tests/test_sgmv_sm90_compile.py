"""The SGMV kernels compile for an H100/H200 (sm_90) in the forms the launchers pick for
Llama-3-8B's projections (decode: one token a program; prefill: token tiles with ``tl.dot``), in
bfloat16 with programmatic dependent launch (the folded expand too), without register spills, each with one PDL trigger
before its one wait. The interpreter tests check the arithmetic; this checks that the code the GPU
runs (early returns, the slice selection, the constexpr branches) compiles.

Compiled in a subprocess without the interpreter (``engine.testing.aot``), as a script run.
"""

from __future__ import annotations

import json

from engine.testing.aot import compile_kernel, compiled_facts, pdl_order, spill_bytes

INDEX = dict(seg_indptr_ptr="*i32", weight_indices_ptr="*i32", ranks_ptr="*i32")


def _facts(kernel: object) -> dict[str, object]:
    ptx = kernel.asm["ptx"]  # type: ignore[attr-defined]
    return {**pdl_order(ptx), "spill_bytes": spill_bytes(ptx)}


def _compile_all() -> dict[str, dict[str, object]]:
    from engine_lora_triton import kernels as k
    from engine_lora_triton import launch
    from engine_lora_triton import slot_kernels as sk

    facts: dict[str, dict[str, object]] = {}
    types = {a: "i32" for a in k._shrink_kernel.arg_names}
    types.update(x_ptr="*bf16", a_ptr="*bf16", y_ptr="*bf16", **INDEX)
    for name, (segments, seg_len, rows, width) in {"decode-1": (1, 1, 48, 4096), "decode-64": (64, 1, 48, 14336),
                                                   "prefill": (4, 512, 48, 4096),
                                                   "prefill-split": (1, 128, 16, 14336)}.items():
        cfg = launch.shrink_config(segments, seg_len, rows, width, 132)
        warps = cfg.pop("num_warps")
        cfg.pop("num_stages")
        chunk = launch.split_chunk(segments, seg_len, rows, width, 132) or width
        assert (chunk < width) == (name == "prefill-split"), (name, chunk)
        kernel = compile_kernel(k._shrink_kernel, {**types, "y_ptr": "*fp32" if chunk < width else "*bf16"},
                                dict(ROWS=rows, K=width, K_CHUNK=chunk, ROW_TILES=-(-rows // cfg["BLOCK_R"]),
                                     DOT=cfg["BLOCK_T"] > 1, WIDEN=False, IEEE=False, PDL=True, **cfg),
                                num_warps=warps)
        facts[f"shrink-{name}"] = _facts(kernel)
    types = {a: "i32" for a in k._expand_kernel.arg_names}
    types.update(y_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", scalings_ptr="*fp32", **INDEX)
    slot_types = {a: "i32" for a in sk._expand_slots_kernel.arg_names}
    slot_types.update(y_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", scalings_ptr="*fp32", **INDEX)
    dense_types = {a: "i32" for a in sk._expand_dense_kernel.arg_names}
    dense_types.update(y_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", scalings_ptr="*fp32", **INDEX)
    for name, (segments, seg_len, r) in {"decode-1": (1, 1, 16), "decode-64": (64, 1, 64),
                                         "prefill": (4, 512, 64)}.items():
        cfg = launch.expand_config(segments, seg_len, 6144, r, 132, dense=True)
        warps = cfg.pop("num_warps")
        cfg.pop("num_stages")
        if cfg.pop("DENSE", 0):  # a decode batch: one program per column tile over every slot
            # From y and from 14 chunks' partial sums; 9 slots unrolled, 40 in a loop.
            for variant, (y_type, splits, slots) in {"": ("*bf16", 1, 9), "-partials": ("*fp32", 14, 9),
                                                     "-40-slots": ("*bf16", 1, 40)}.items():
                kernel = compile_kernel(sk._expand_dense_kernel, {**dense_types, "y_ptr": y_type},
                                        dict(R=r, NUM_SLOTS=slots, SEGS=segments, BLOCK_S=64, SPLITS=splits,
                                             WIDEN=False, IEEE=False, PDL=True, **cfg), num_warps=warps)
                facts[f"expand-{name}{variant}"] = _facts(kernel)
            # The per-slot expand (lora-triton.dense_expand=false).
            slot_cfg = launch.expand_config(segments, seg_len, 6144, r, 132, dense=False)
            kernel = compile_kernel(sk._expand_slots_kernel, slot_types, dict(
                R=r, SEGS=segments, BLOCK_S=64, SPLITS=1, TILES=1, WIDEN=False, IEEE=False, PDL=True,
                BLOCK_N=slot_cfg["BLOCK_N"], BLOCK_R=slot_cfg["BLOCK_R"]), num_warps=slot_cfg["num_warps"])
            facts[f"expand-{name}-slots"] = _facts(kernel)
            continue
        kernel = compile_kernel(k._expand_kernel, types, dict(R=r, SPLITS=1, DOT=cfg["BLOCK_T"] > 1, WIDEN=False,
                                                              IEEE=False, PDL=True, **cfg), num_warps=warps)
        facts[f"expand-{name}"] = _facts(kernel)
        if name == "prefill":  # the expand of a split shrink's partial sums (a short prefill)
            kernel = compile_kernel(k._expand_kernel, {**types, "y_ptr": "*fp32"},
                                    dict(R=r, SPLITS=16, DOT=True, WIDEN=False, IEEE=False, PDL=True, **cfg),
                                    num_warps=warps)
            facts["expand-prefill-partials"] = _facts(kernel)
    slot_shrink = {a: "i32" for a in sk._shrink_slots_kernel.arg_names}
    slot_shrink.update(x_ptr="*bf16", a_ptr="*bf16", p_ptr="*fp32", **INDEX)
    for name, (rows, width) in {"qkv": (48, 4096), "down": (16, 14336), "rank-64-qkv": (192, 4096)}.items():
        cfg = launch.slot_shrink_config(9, rows, width, 132)
        warps = cfg.pop("num_warps")
        cfg.pop("num_stages")
        kernel = compile_kernel(sk._shrink_slots_kernel, slot_shrink, dict(ROWS=rows, K=width, SEGS=64, BLOCK_S=64,
                                                                          WIDEN=False, IEEE=False, PDL=True, **cfg),
                                num_warps=warps)
        facts[f"slot-shrink-{name}"] = _facts(kernel)
    from engine_lora_triton import fold

    fold_types = {a: "i32" for a in fold._expand_folded_kernel.arg_names}
    fold_types.update(h_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", scalings_ptr="*fp32", **INDEX)
    # (tokens, rank, slots, one-token segments): the engine's decode batches take the one-token form.
    for name, (tokens, r, slots, one) in {"decode-1": (1, 16, 9, True), "decode-64": (64, 16, 9, True),
                                          "rank-64": (64, 64, 9, True), "40-slots": (64, 16, 40, False)}.items():
        cfg = fold.folded_config(tokens, 6144, r, 132)
        warps = cfg.pop("num_warps")
        cfg.pop("num_stages")
        segs = max(16, 1 << (tokens - 1).bit_length())
        kernel = compile_kernel(fold._expand_folded_kernel, fold_types,
                                dict(R=r, NUM_SLOTS=slots, ONE_TOKEN=one, SEGS=segs, BLOCK_S=min(64, segs), WIDEN=False,
                                     IEEE=False, PDL=True, **cfg), num_warps=warps)
        facts[f"fold-{name}"] = _facts(kernel)
    return facts


def test_kernels_compile_for_sm90_without_spills() -> None:
    facts = compiled_facts(__file__, timeout=600)
    assert len(facts) == 18, facts
    for name, got in facts.items():
        assert got["spill_bytes"] == 0, (name, got)
        assert got["waits"] == 1 and got["triggers"] == 1 and got["trigger_first"], (name, got)
        # rank, weights, scaling (and segment bounds); the per-slot shrink: rank and segment bounds
        assert got["loads_before_wait"] >= 3, (name, got)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
