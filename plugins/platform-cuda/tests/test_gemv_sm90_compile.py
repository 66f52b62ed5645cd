"""The skinny GEMM compiles for an H100 (sm_90) on a machine without one, to what it was written for.

For every launch shape ``choose_config`` picks on the decode shapes (``test_gemv_kernel.SHAPES``
at 1, 2, 4 and 8 rows): the "fma" kind streams W with 16-byte loads and moves nothing between
register layouts inside its K loop (no shared memory there: both operands are loaded in the
product's layout); the "dot" kind copies its tiles with cp.async (pipelined) into tensor-core
MMAs; no kind spills registers (``ptxas -v``). The "fma" kind with the RMSNorm folded in
(``norm_skinny_linear``, at the fma kind's rows: 1 by the default rule; PDL on, with and without a
residual) too; with PDL the first ``GemvConfig.pdl_steps`` weight tiles (one with the norm) are
requested before the one wait.

Triton compiles ahead of time with its bundled ptxas; the interpreter (which the root conftest
turns on without a GPU) plays no part, so the compile runs in a subprocess without it. Pointers,
strides and N are declared divisible by 16, as Triton specializes them at a real launch.
"""

from __future__ import annotations

import json
import re

from engine.testing.aot import compile_kernel, compiled_facts, spill_bytes

_V4_LOAD = r"ld\.global(?:\.[\w:]+)*\.v4"
SHAPES = [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048), (6144, 4096), (4096, 4096),
          (28672, 4096), (4096, 14336), (128256, 4096)]


def _loop_bodies(ptx: str) -> list[str]:
    """The instructions of each innermost loop (the K loop; with the norm also its row loops)."""
    lines = ptx.splitlines()
    bodies = []
    for start in (i for i, line in enumerate(lines) if "Inner Loop Header" in line):
        label = lines[start].split(":")[0]
        end = next(i for i in range(start, len(lines)) if "bra" in lines[i] and label in lines[i])
        bodies.append("\n".join(lines[start:end]))
    return bodies


def _loop_body(ptx: str) -> str | None:
    """The instructions of the K loop: of the innermost loops, the one with the most 16-byte loads
    (the weight tiles); None where a slice of K is one step (no loop)."""
    bodies = _loop_bodies(ptx)
    return max(bodies, key=lambda b: len(re.findall(_V4_LOAD, b))) if bodies else None


def _compile_all() -> dict[str, dict[str, object]]:
    import triton
    from engine_platform_cuda import gemv

    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
             "M": "i32", "N": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32",
             "r_ptr": "*bf16", "nw_ptr": "*bf16", "normed_ptr": "*bf16", "res_ptr": "*bf16", "stride_rm": "i32",
             "eps": "fp32"}
    seen: dict[tuple[object, ...], str] = {}
    out: dict[str, dict[str, object]] = {}
    # Every chosen shape without PDL; at the fma kind's rows (1 by the default rule) also with it,
    # and with the norm folded in (res True/False: with/without a residual; PDL on, as models
    # launch it).
    fma_rows = [m for m in (1, 2) if m <= gemv.RULE.fma_max_rows]
    runs: list[tuple[int, bool, bool | None]] = [
        (m, pdl, None) for m in (1, 2, 4, 8) for pdl in (False, True) if not pdl or m in fma_rows]
    runs += [(m, True, res) for m in fma_rows for res in (True, False)]
    for m, pdl, res in runs:
        for n, k in SHAPES:
            cfg = gemv.choose_config(m, n, k, sm_count=132)
            k_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
            rows = 16 if cfg.kind == "dot" else triton.next_power_of_2(m)
            consts: dict[str, object] = dict(K=k, K_SPLIT=k_split, HAS_BIAS=False, SPLIT=cfg.split_k > 1,
                                             EVEN_K=k % k_split == 0, BLOCK_M=rows, BLOCK_N=cfg.block_n,
                                             BLOCK_K=cfg.block_k)
            fn = gemv._gemv_fma_kernel
            if cfg.kind == "dot":
                fn, consts["DOT_FP32"] = gemv._gemv_dot_kernel, False
                pdl = False  # skinny_linear launches only the fma kind with PDL
            else:
                # As gemv's launches: the plain kernel's row tile is fixed, the norm's from the rule.
                row_block = min(triton.next_power_of_2(k), gemv.RULE.norm_row_tile // rows)
                # As _launch: the weight steps before the wait, one with the norm.
                pre = min(cfg.pdl_steps, k_split // cfg.block_k) if pdl and res is None else 1
                consts.update(PDL=pdl, NORM=res is not None, HAS_RES=bool(res),
                              ROW_BLOCK=16 if res is None else row_block, PRE=pre)
            key = (cfg, tuple(sorted(consts.items())))
            name = f"m{m}-{n}x{k}" + ("-pdl" if pdl else "") + {None: "", True: "-norm-res", False: "-norm"}[res]
            if key in seen:
                out[name] = out[seen[key]]
                continue
            seen[key] = name
            compiled = compile_kernel(fn, types, consts, num_warps=cfg.num_warps, divisible=("N",),
                                      num_stages=cfg.num_stages)
            ptx = compiled.asm["ptx"]
            loop = _loop_body(ptx)
            body = ptx if loop is None else loop
            wait_at = ptx.find("griddepcontrol.wait")
            first_load = re.search(r"ld\.global", ptx)
            out[name] = {
                "kind": cfg.kind,
                "norm": res is not None,
                # PDL's point: a (weight) load is issued before the wait for the previous kernel.
                "load_before_wait": first_load is not None and 0 <= first_load.start() < wait_at,
                # 16-byte weight loads before the wait, and how many K steps of them were asked for.
                "v4_before_wait": len(re.findall(_V4_LOAD, ptx[:wait_at])) if wait_at >= 0 else 0,
                "pre": consts.get("PRE", 1),
                # One weight step's 16-byte loads a thread (the tile over the program's threads).
                "step_v4": cfg.block_n * cfg.block_k * 2 // (16 * 32 * cfg.num_warps),
                "loop": loop is not None,
                "v4_loads_in_loop": len(re.findall(_V4_LOAD, body)),
                # Without a loop the whole kernel is searched, and its final cross-warp sum uses shared memory.
                "shared_in_loop": len(re.findall(r"(?:ld|st)\.shared|ldmatrix|bar\.sync", loop or "")),
                "cp_async": "cp.async" in ptx,
                "mma": "mma.sync" in ptx or "wgmma.mma_async" in ptx,
                "spill_bytes": spill_bytes(ptx),
                "local": len(re.findall(r"\.local", ptx)),
                "pdl": pdl,
                "gdc_wait": ptx.count("griddepcontrol.wait"),
                "gdc_launch": ptx.count("griddepcontrol.launch_dependents"),
            }
    return out


def test_chosen_configs_compile_for_sm90_as_designed() -> None:
    from engine_platform_cuda.gemv import RULE

    info = compiled_facts(__file__, timeout=1500)
    fma_rows = min(RULE.fma_max_rows, 2)
    assert len(info) == (4 + 3 * fma_rows) * len(SHAPES)
    assert sum(bool(got["norm"]) for got in info.values()) == 2 * fma_rows * len(SHAPES)
    for name, got in info.items():
        assert got["spill_bytes"] == 0 and got["local"] == 0, (name, got)
        # With PDL the kernel lets its successor launch and waits for its predecessor, once each.
        assert (got["gdc_wait"], got["gdc_launch"]) == ((1, 1) if got["pdl"] else (0, 0)), (name, got)
        if got["pdl"]:
            assert got["load_before_wait"], (name, got)
            # Every requested step's whole tile, in 16-byte vectors, before the wait.
            assert got["v4_before_wait"] >= got["pre"] * got["step_v4"] > 0, (name, got)
        if got["kind"] == "fma":
            assert got["v4_loads_in_loop"] > 0 and got["shared_in_loop"] == 0, (name, got)
        else:
            # One K step per program (the router's slices) leaves nothing to pipeline.
            assert got["mma"] and (got["cp_async"] or not got["loop"]), (name, got)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
