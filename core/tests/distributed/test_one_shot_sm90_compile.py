"""The one-shot all-reduce kernel compiles for an H100/H200 (sm_90) to the memory order its
protocol needs (engine.distributed.one_shot):

- each signal to a peer is one system-scope release exchange (one per rank slot: the rank is a
  run-time argument, so its own slot is skipped by a branch, not at compile time);
- each wait reads its flag with system-scope acquire loads (a first read and the loop's);
- every rank's buffer is read in 16-byte vectors bypassing L1 (``.cg``), the own-buffer copy
  and the result are written in 16-byte vectors; no register spills.

Compiled in a subprocess without the interpreter (``engine.testing.aot``) for 2 and 8 ranks, bf16.
"""

from __future__ import annotations

import json

from engine.testing.aot import compiled_facts, compile_kernel, spill_bytes

WORLDS = (2, 8)


def _compile_all() -> dict[str, dict[str, int]]:
    from engine.distributed.one_shot import BLOCK, NUM_WARPS, one_shot_all_reduce_kernel

    kernel = one_shot_all_reduce_kernel
    types = {"x_ptr": "*bf16", "n": "i32", "buf_ptrs": "*i64", "flag_ptrs": "*i64", "counts_ptr": "*i64",
             "rank": "i32", "half_elems": "i32"}
    out = {}
    for world in WORLDS:
        # Triton specialises n and half_elems divisible by 16 at run time (decode messages are).
        ptx = compile_kernel(kernel, types, dict(WORLD=world, BLOCK=BLOCK), num_warps=NUM_WARPS,
                             divisible=("n", "half_elems")).asm["ptx"]
        out[str(world)] = {
            "release_exch": ptx.count("atom.global.sys.release.exch.b64"),
            "acquire_loads": ptx.count("ld.global.sys.acquire.b64"),
            "cg_vector_loads": ptx.count("ld.global.cg.v4"),
            "vector_stores": ptx.count("st.global.v4"),
            "spill_bytes": spill_bytes(ptx),
        }
    return out


def test_one_shot_compiles_to_its_memory_order() -> None:
    info = compiled_facts(__file__, timeout=600)
    for world in WORLDS:
        f = info[str(world)]
        assert f["release_exch"] == world, (world, f)
        assert f["acquire_loads"] == 2 * world, (world, f)
        assert f["cg_vector_loads"] == world, (world, f)
        assert f["vector_stores"] == 2, (world, f)
        assert f["spill_bytes"] == 0, (world, f)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
