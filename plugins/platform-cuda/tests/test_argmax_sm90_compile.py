"""The greedy argmax kernel compiles for an H100 (sm_90) on a machine without one, in both of its
forms (one program a row; a split row with the ticket) and the three logits dtypes: the logits are
read with 16-byte loads (float32), the split form orders its partials before the ticket (a CTA
barrier, then an acquire-release atomic at GPU scope) and reads the other programs' partials from
L2 (``ld.global.cg``), and nothing spills. The interpreter, which runs test_argmax.py on the CPU,
accepts code a real compile refuses (a non-constexpr global once), hence this test. Like the other
sm_90 compile tests, the compile runs in a subprocess without the interpreter (``engine.testing.aot``)."""

from __future__ import annotations

import json

from engine.testing.aot import compiled_facts


def test_both_forms_compile_with_ordered_partials_and_wide_loads() -> None:
    facts = compiled_facts(__file__, timeout=600)
    assert sorted(facts) == [f"{d}-{s}" for d in ("bf16", "fp16", "fp32") for s in ("single", "split")]
    for name, got in facts.items():
        assert got["spill_bytes"] == 0, (name, got)
        if name.startswith("fp32"):
            assert got["v4_loads"] >= 1, (name, got)
        if name.endswith("split"):
            assert got["atomics"] == got["acq_rel_gpu_atomics"] == 1, (name, got)
            assert got["barrier_between_partials_and_ticket"], (name, got)
            assert got["cg_loads"] >= 2, (name, got)  # the partial values and indices
        else:
            assert got["atomics"] == 0 and got["cg_loads"] == 0, (name, got)


if __name__ == "__main__":
    import re

    from engine_platform_cuda.argmax import BLOCK, DEFAULT_PROGRAMS, _argmax_kernel

    from engine.testing.aot import compile_kernel, spill_bytes

    out = {}
    for dtype in ("fp32", "bf16", "fp16"):
        for split in (False, True):
            types = {"x_ptr": f"*{dtype}", "out_ptr": "*i64", "part_val_ptr": "*fp32", "part_idx_ptr": "*i32",
                     "ticket_ptr": "*i32", "n": "i32", "stride_row": "i32", "tiles_per_part": "i32"}
            consts = {"BLOCK": BLOCK, "SPLIT": split, "PARTS_BLOCK": 256}
            assert DEFAULT_PROGRAMS <= 256
            ptx = compile_kernel(_argmax_kernel, types, consts, num_warps=4, divisible=("n",)).asm["ptx"]
            atomic = re.search(r"atom\.\S+", ptx)
            out[f"{dtype}-{'split' if split else 'single'}"] = {
                "spill_bytes": spill_bytes(ptx),
                "v4_loads": len(re.findall(r"ld\.global(?:\.[\w:]+)*\.v4", ptx)),
                "atomics": len(re.findall(r"\batom\.", ptx)),
                "acq_rel_gpu_atomics": len(re.findall(r"\batom\.global\.gpu\.acq_rel\.", ptx)),
                # The CTA barrier sits after the last partial store and before the ticket.
                "barrier_between_partials_and_ticket": atomic is not None and "bar.sync" in ptx[
                    ptx.rfind("st.global", 0, atomic.start()):atomic.start()],
                "cg_loads": len(re.findall(r"ld\.global\.cg", ptx)),
            }
    print(json.dumps(out))
