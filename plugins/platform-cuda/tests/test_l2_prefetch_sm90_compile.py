"""The L2 prefetch kernel (``cuda.l2_prefetch_mb``) compiles for an H100 (sm_90) on a machine
without one: each thread issues one bulk prefetch to L2 under an ``evict_last`` cache policy,
ptxas accepts it, and the kernel stores nothing it does not mask off. Like the other sm_90 compile
tests, the compile runs in a subprocess without the interpreter (``engine.testing.aot``)."""

from __future__ import annotations

import json

from engine.testing.aot import compiled_facts


def test_one_bulk_prefetch_a_thread_with_an_evict_last_policy() -> None:
    facts = compiled_facts(__file__, timeout=300)
    assert facts["bulk_prefetches"] == 1  # one element a thread: 128 elements, 4 warps
    assert facts["evict_last_policies"] == 1
    assert facts["loads"] == 0
    assert facts["ptxas_ok"]


if __name__ == "__main__":
    import re

    from engine_platform_cuda.l2_prefetch import CHUNK_BYTES, PER_PROGRAM, _l2_prefetch_kernel

    from engine.testing.aot import compile_kernel, ptxas_report

    kernel = compile_kernel(_l2_prefetch_kernel, {"addr": "i64", "flag_ptr": "*i32", "n_chunks": "i32"},
                            {"CHUNK": CHUNK_BYTES, "PER_PROGRAM": PER_PROGRAM}, num_warps=4)
    ptx = kernel.asm["ptx"]
    ptxas_report(ptx)  # raises if ptxas rejects it
    print(json.dumps({
        "bulk_prefetches": len(re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global\.L2::cache_hint", ptx)),
        "evict_last_policies": len(re.findall(r"createpolicy\.fractional\.L2::evict_last", ptx)),
        "loads": len(re.findall(r"ld\.global", ptx)),
        "ptxas_ok": True,
    }))
