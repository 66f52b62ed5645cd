"""``decode_fp8_mma`` compiles for an H100 (sm_90) to what it is for: the tensor-core operands built in
registers, nothing through shared memory.

- No shared memory at all (``ld/st.shared``, ``ldmatrix``, ``stmatrix``, barriers): the widened K and
  V tiles are the ``mma`` operands where they were gathered (the layout conversions are asserted
  trivial in the kernel; this checks what reaches the PTX).
- K and V are gathered as vectors of words (``ld.global.v4`` / ``.v2``), widened by the paired hardware conversion
  (``cvt.rn.f16x2.e4m3x2``), never through bf16.
- No register spills under each block size's register cap (``MAXNREG``); with PDL, one trigger before
  one wait and only lengths and slots read before it.

Compiled in a subprocess without the interpreter (``engine.testing.aot.compiled_facts``) at
Llama-3-8B's heads (GQA group 4, head dim 128) and at head dim 64, 16- and 32-key blocks.
"""

from __future__ import annotations

import json
import re

import pytest
from engine.testing.aot import compiled_facts, pdl_order, spill_bytes

pytest.importorskip("triton.experimental.gluon", reason="decode_fp8_mma is a Gluon kernel")

from engine_attention_triton.decode_fp8_mma import MAXNREG  # noqa: E402

#: name -> (D, BLOCK, PDL), each under its block's register cap (``MAXNREG``).
CONFIGS = {"d128": (128, 16, False), "d128-pdl": (128, 16, True), "d128-32": (128, 32, True), "d64": (64, 16, True),
           "d64-32": (64, 32, False)}


def _compile_all() -> dict[str, dict[str, object]]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from engine_attention_triton.decode_fp8_mma import decode_fp8_mma_kernel as fn

    out: dict[str, dict[str, object]] = {}
    names = fn.arg_names
    for name, (d, block, pdl) in CONFIGS.items():
        maxnreg = MAXNREG[block]
        consts = dict(GROUP=4, D=d, BLOCK=block, SLIDING_WINDOW=-1, PDL=pdl)
        types = {a: "i32" for a in names}
        types.update(Q="*bf16", K_Buf="*i32", V_Buf="*i32", Req_To_Token="*i32", Req_Pool_Indices="*i64",
                     Seq_Lens="*i64", Out="*bf16", sm_scale="fp32", v_scale="fp32")
        signature = {a: "constexpr" if a in consts else types[a] for a in names}
        # Pointers and strides divisible by 16, as Triton specializes them at a launch on an aligned pool.
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
                 if a not in consts and (signature[a].startswith("*") or a.startswith("stride"))}
        src = GluonASTSource(fn=fn, signature=signature, attrs=attrs,
                             constexprs={(names.index(c),): v for c, v in consts.items()})
        options = {"num_warps": 1, **({"maxnreg": maxnreg} if maxnreg else {})}
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        out[name] = {"shared": len(re.findall(r"\b(ld|st)\.shared|ldmatrix|stmatrix|bar\.sync", ptx)),
                     "vector_loads": len(re.findall(r"ld\.global(\.\w+)*\.v[24]\.b32", ptx)),
                     "cvt_e4m3x2": ptx.count("cvt.rn.f16x2.e4m3x2"), "cvt_bf16": ptx.count("cvt.bf16.f16"),
                     "mma": ptx.count("mma.sync.aligned.m16n8k16"),
                     "maxnreg": re.findall(r"\.maxnreg (\d+)", ptx), "spill_bytes": spill_bytes(ptx),
                     **(pdl_order(ptx) if pdl else {})}
    return out


def test_operands_are_built_in_registers() -> None:
    info = compiled_facts(__file__, timeout=600)
    for name, (d, block, pdl) in CONFIGS.items():
        got = info[name]
        assert got["shared"] == 0 and got["spill_bytes"] == 0, (name, got)
        assert got["maxnreg"] == ([str(MAXNREG[block])] if MAXNREG[block] else []), (name, got)  # ptxas obeys it
        # A lane gathers block / 8 K rows and block / 4 V rows a block, each part as one vector load
        # (d / 4 and d / 8 contiguous bytes), in the loop and before it.
        assert got["vector_loads"] >= 2 * (block // 8 + block // 4), (name, got)
        assert got["cvt_e4m3x2"] > 0 and got["cvt_bf16"] == 0 and got["mma"] > 0, (name, got)
        if pdl:
            assert got["waits"] == 1 and got["triggers"] == 1 and got["trigger_first"], (name, got)
            assert got["loads_before_wait"] >= 3, (name, got)  # length, request, slots


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
