"""The LM head's folded final norm compiles for an H100 (sm_90) on a machine without one, and the
order it adds the squares in is the order ``kernels.rms_norm`` compiled adds them.

The fold is bit-equal to the separate norm only if ``gemv_tiles._rms_tree_sum`` adds the squares
as ``rms_norm``'s compiled code does; ``kernels.rms_norm_sum_order`` states that order. Read
here from ``rms_norm``'s TTGIR and PTX, for hidden sizes from 32 to 16384 in bf16 and fp16, with
and without the residual: the register layout (values a thread, warps), the chain of
multiply-adds each thread runs over its values (traced back through the conversions and the
residual adds to the vector load and place each value came from), and the butterfly shuffles
after it (lanes 16 apart first, then the warps). A Triton that compiled ``rms_norm`` otherwise
fails this test before it could change a logit.

The fused kernel itself (``NORM`` with the tree, ``ROUND``: float32 logits) for the LM head shapes:
no spills, one PDL wait after the first weight tile's loads, and the accumulator reduced over K in
the same register layout as the plain kernel's (the logits are summed in the same order). The
float32 store of the plain "fma" and "dot" kinds and of the split-K sum compiles too. Like the
other sm_90 compile tests, the compile runs in a subprocess without the interpreter.
"""

from __future__ import annotations

import json
import re

from engine.testing.aot import compiled_facts

#: hidden sizes whose rms_norm order is read: every row layout from one warp to 16 warps x 4 reps.
HIDDEN = [32, 64, 128, 256, 512, 896, 1024, 1536, 2048, 2560, 3584, 4096, 5120, 8192, 16384]
#: (vocab, hidden) of LM heads: Qwen3-30B-A3B / Qwen3-4B(2560) / Qwen3-0.6B, Llama-3-8B, Qwen2.5-7B, 14B.
LM_HEADS = [(151936, 2048), (151936, 2560), (151936, 1024), (128256, 4096), (152064, 3584), (152064, 5120)]


def test_rms_norm_adds_in_the_order_the_fold_reproduces() -> None:
    facts = compiled_facts(__file__, timeout=1500)
    orders = facts["rms_norm"]
    assert len(orders) == 2 * 2 * len(HIDDEN)
    for name, got in orders.items():
        warps, vector, steps = got["expected"]
        assert got["layout"] == [vector, warps], (name, got)
        # Each thread: its values in order (the first two in either order: one add, commutative).
        chain = got["chain"]
        assert sorted(chain[:2]) == chain[:2] or chain[:2] == [1, 0], (name, got)
        assert sorted(chain[:2]) + chain[2:] == list(range(steps)), (name, got)
        lane_steps = [16, 8, 4, 2, 1]
        warp_steps = [warps >> i for i in range(1, warps.bit_length())]
        assert got["shuffles"] == lane_steps + warp_steps, (name, got)


def test_the_folded_lm_head_compiles_and_reduces_k_as_the_plain_kernel() -> None:
    facts = compiled_facts(__file__, timeout=1500)
    for name, got in facts["gemv"].items():
        assert got["spill_bytes"] == 0 and got["local"] == 0, (name, got)
        if got["norm"]:
            # The tree's loads come after the wait; the first weight tile's before it.
            assert got["gdc_wait"] == 1 and got["v4_before_wait"] > 0, (name, got)
            assert got["acc_layout"] == got["plain_acc_layout"], (name, got)
            assert got["acc_layout"] is not None, (name, got)
        if got["round"]:
            assert got["f32_out_stores"] > 0, (name, got)


# -- the compile (run as a script without the interpreter) ---------------------------------------

_V4_LOAD = r"ld\.global(?:\.[\w:]+)*\.v4"


def _sum_chain(ptx: str, packed: str) -> tuple[list[tuple[int, int]], list[int]]:
    """Which of a thread's values the first multiply-add chain adds, in order, as (vector load of
    x, place in it), and the butterfly shuffles' lane offsets after it."""
    defs: dict[str, tuple[int, int]] = {}  # register -> (load index, place in the load)
    loads = 0
    chain: list[int] = []
    shuffles: list[int] = []
    last = None
    for line in ptx.splitlines():
        line = line.strip()
        load = re.match(r"(?:@%p\d+ )?ld\.global(?:\.v(\d))?\.b(16|32) \{?\s*([^}\]]*?)\s*\}?, \[", line)
        if load:
            regs = [r.strip() for r in load.group(3).split(",")]
            for i, reg in enumerate(regs):
                defs[reg] = (loads, i * (2 if load.group(2) == "32" else 1))
            loads += 1
            continue
        add = re.match(rf"add(?:\.rn)?\.{packed}(?:x2)? \s*(%\w+), (%\w+), (%\w+);", line)
        if add and add.group(2) in defs:
            defs[add.group(1)] = defs[add.group(2)]  # x + residual: x's place
            continue
        unpack = re.match(r"mov\.b32 \s*\{(%\w+), (%\w+)\}, (%\w+);", line)
        if unpack and unpack.group(3) in defs:
            src = defs[unpack.group(3)]
            defs[unpack.group(1)], defs[unpack.group(2)] = src, (src[0], src[1] + 1)
            continue
        cvt = re.match(rf"cvt\.f32\.{packed} \s*(%\w+), (%\w+);", line)
        if cvt and cvt.group(2) in defs:
            defs[cvt.group(1)] = defs[cvt.group(2)]
            continue
        if last is None:
            mul = re.match(r"mul\.f32 \s*(%\w+), (%\w+), (%\w+);", line)
            if mul and mul.group(2) == mul.group(3) and mul.group(2) in defs:
                chain.append(mul.group(2))
                last = mul.group(1)
            continue
        fma = re.match(r"fma\.rn\.f32 \s*(%\w+), (%\w+), (%\w+), (%\w+);", line)
        if not shuffles and fma and fma.group(4) == last and fma.group(2) == fma.group(3):
            chain.append(fma.group(2))
            last = fma.group(1)
            continue
        shfl = re.match(r"shfl\.sync\.bfly\.b32 \s*%\w+, %\w+, (\d+), 31, -1;", line)
        if shfl:
            shuffles.append(int(shfl.group(1)))
        if "div.full.f32" in line:  # the mean: the sum is complete
            break
    return [defs[r] for r in chain], shuffles


def _rms_norm_orders() -> dict[str, dict[str, object]]:
    import triton
    from engine_platform_cuda.kernels import _rmsnorm_kernel, norm_num_warps, rms_norm_sum_order

    from engine.testing.aot import compile_kernel

    out: dict[str, dict[str, object]] = {}
    for dtype, packed in (("bf16", "bf16"), ("fp16", "f16")):
        for n in HIDDEN:
            for res in (True, False):
                block = triton.next_power_of_2(n)
                types = {"x_ptr": f"*{dtype}", "r_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                         "res_out_ptr": f"*{dtype}", "stride_x": "i32", "stride_r": "i32", "n_cols": "i32",
                         "eps": "fp32"}
                compiled = compile_kernel(_rmsnorm_kernel, types, {"HAS_RESIDUAL": res, "BLOCK": block,
                                                                   "TRIGGER": True},
                                          num_warps=norm_num_warps(block), divisible=("n_cols",))
                layout = re.search(r"sizePerThread = \[(\d+)\], threadsPerWarp = \[32\], warpsPerCTA = \[(\d+)\]",
                                   compiled.asm["ttgir"])
                places, shuffles = _sum_chain(compiled.asm["ptx"], packed)
                vector = int(layout.group(1)) if layout else 0
                # A thread's step: its x loads are one vector of the layout each, in register order.
                out[f"{dtype}-{n}-{'res' if res else 'plain'}"] = {
                    "expected": rms_norm_sum_order(n),
                    "layout": [vector, int(layout.group(2))] if layout else None,
                    "chain": [load * vector + place for load, place in places], "shuffles": shuffles}
    return out


def _acc_layout(ttgir: str, rows: int, block_n: int, block_k: int) -> str | None:
    """The encoding (its definition) of the accumulator ``[rows, block_n, block_k]`` the kernel
    reduces over K."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, flags=re.M))
    match = re.search(rf"\}}\) : \(tensor<{rows}x{block_n}x{block_k}xf32, (#\w+)>\) -> tensor<{rows}x{block_n}xf32",
                      ttgir)
    return None if match is None else aliases.get(match.group(1), match.group(1))


def _gemv_facts() -> dict[str, dict[str, object]]:
    import triton
    from engine_platform_cuda import gemv
    from engine_platform_cuda.kernels import rms_norm_sum_order

    from engine.testing.aot import compile_kernel, spill_bytes

    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*fp32", "part_ptr": "*fp32",
             "M": "i32", "N": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32",
             "r_ptr": "*bf16", "nw_ptr": "*bf16", "normed_ptr": "*bf16", "res_ptr": "*bf16", "stride_rm": "i32",
             "eps": "fp32"}
    import triton.language as tl

    out: dict[str, dict[str, object]] = {}
    for m, n, k, norm in ([(1, n, k, True) for n, k in LM_HEADS] + [(1, 151936, 2048, False), (4, 151936, 2048, False),
                                                                     (1, 128, 2048, False)]):
        cfg = gemv.choose_config(m, n, k, sm_count=132)
        k_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
        consts: dict[str, object] = dict(K=k, K_SPLIT=k_split, HAS_BIAS=False, SPLIT=cfg.split_k > 1,
                                         EVEN_K=k % k_split == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                         ROUND=tl.bfloat16)
        if cfg.kind == "dot":
            fn = gemv._gemv_dot_kernel
            consts.update(DOT_FP32=False, BLOCK_M=16)
        else:
            fn = gemv._gemv_fma_kernel
            order = rms_norm_sum_order(k) if norm else (0, 0, 0)
            pre = 1 if norm else min(cfg.pdl_steps, k_split // cfg.block_k)
            consts.update(BLOCK_M=1, PDL=True, NORM=norm, HAS_RES=norm, PRE=pre,
                          ROW_BLOCK=min(triton.next_power_of_2(k), gemv.RULE.norm_row_tile) if norm else 16,
                          TREE_W=order[0], TREE_V=order[1], TREE_STEPS=order[2])
        compiled = compile_kernel(fn, types, consts, num_warps=cfg.num_warps, divisible=("N",))
        ptx = compiled.asm["ptx"]
        facts: dict[str, object] = {"norm": norm, "round": True, "spill_bytes": spill_bytes(ptx),
                                    "local": len(re.findall(r"\.local", ptx)),
                                    "acc_layout": (_acc_layout(compiled.asm["ttgir"], 1, cfg.block_n, cfg.block_k)
                                                   if cfg.kind == "fma" else "dot"),
                                    # float32 outputs: 32-bit global stores (the 16-bit ones are b16).
                                    "f32_out_stores": len(re.findall(r"st\.global(?:\.v\d)?\.b32", ptx))}
        if norm:
            # The kernel the fold replaces, as the LM head launches it today: a 16-bit store, PDL steps.
            plain = dict(consts, NORM=False, HAS_RES=False, ROW_BLOCK=16, TREE_W=0, TREE_V=0, TREE_STEPS=0,
                         ROUND=None, PRE=min(cfg.pdl_steps, k_split // cfg.block_k))
            plain_ir = compile_kernel(fn, dict(types, y_ptr="*bf16"), plain, num_warps=cfg.num_warps,
                                      divisible=("N",)).asm["ttgir"]
            wait_at = ptx.find("griddepcontrol.wait")
            facts.update(plain_acc_layout=_acc_layout(plain_ir, 1, cfg.block_n, cfg.block_k), gdc_wait=ptx.count("griddepcontrol.wait"),
                         v4_before_wait=len(re.findall(_V4_LOAD, ptx[:wait_at])) if wait_at >= 0 else 0)
        out[f"m{m}-{n}x{k}{'-norm' if norm else ''}-{cfg.kind}-s{cfg.split_k}"] = facts
    split = compile_kernel(gemv._splitk_sum_kernel, {"part_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*fp32",
                                                     "M": "i32", "N": "i32", "stride_ym": "i32"},
                           dict(SPLIT_K=4, HAS_BIAS=False, BLOCK=1024, PDL=True, ROUND=tl.bfloat16)).asm["ptx"]
    out["splitk-sum"] = {"norm": False, "round": True, "spill_bytes": spill_bytes(split),
                         "local": len(re.findall(r"\.local", split)),
                         "f32_out_stores": len(re.findall(r"st\.global(?:\.v\d)?\.b32", split))}
    return out


if __name__ == "__main__":
    print(json.dumps({"rms_norm": _rms_norm_orders(), "gemv": _gemv_facts()}))
