"""The MoE layer's small-batch launches with programmatic dependent launch compile for an H100
(sm_90) to the order the PDL rule needs (docs/platforms.md, "Programmatic dependent launch").

- The router's top-k and the gate/up launch read their predecessor's output at once: one wait,
  no global load before it, and the trigger only after it (the down launch reads the routing
  before its own wait, which is safe only once gate/up has waited).
- The down launch loads the routing and its first weight tile before its wait (that is its gain)
  and triggers after it.
- The routed variants (``fused_moe_small_batch_routed``, no top-k launch before them): gate/up
  waits before any load (the logits are the router GEMM's output) and triggers after; its routing
  rounds stay inside a warp (``redux.sync``; between the logits load and the next load only the one
  cross-warp step that hands the slot's expert to every warp, two barriers). Down loads the logits
  and its first weight tile and runs all of its routing (the softmax sums and ``top_k`` rounds of
  two ``redux.sync`` each) before its wait, none after.
- None spills registers.

Compiled in a subprocess without the interpreter (``engine.testing.aot``), at the
Qwen3-30B-A3B shape (128 experts, top 8, hidden 2048, expert intermediate 768) with the tiles
``small_batch_tiles`` picks, bf16 and fp8 expert weights.
"""

from __future__ import annotations

import json
import re

from engine.testing.aot import compile_kernel, compiled_facts, pdl_order, spill_bytes

WEIGHTS = ("bf16", "fp8e4nv")


def _types(fn: object, pointers: dict[str, str]) -> dict[str, str]:
    return {a: pointers.get(a, "i32") for a in fn.arg_names}  # type: ignore[attr-defined]


def _routing_facts(ptx: str) -> dict[str, int]:
    """Where the routing sits: ``redux.sync`` before and after the wait, and the barriers between
    the first two global loads after it (gate/up: the logits, then its first x/weight load)."""
    wait = ptx.find("griddepcontrol.wait")
    after = [m.start() for m in re.finditer(r"\bld\.global", ptx) if m.start() > wait]
    return {"redux_before_wait": ptx[:wait].count("redux.sync"), "redux_after_wait": ptx[wait:].count("redux.sync"),
            "barriers_routing": ptx[after[0]:after[1]].count("bar.sync") if len(after) > 1 else -1}


def _compile_all() -> dict[str, dict[str, object]]:
    from engine.layers.moe import router_kernel, small_batch

    tiles = small_batch.small_batch_tiles(8, 2048, 768)
    out: dict[str, dict[str, object]] = {}
    topk = compile_kernel(router_kernel._softmax_topk_kernel,
                          _types(router_kernel._softmax_topk_kernel,
                                 {"logits_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32"}),
                          dict(TOP_K=8, RENORMALIZE=True, BLOCK_E=128, BLOCK_K=8, PDL=True), num_warps=1)
    out["topk"] = {**pdl_order(topk.asm["ptx"]), "spill_bytes": spill_bytes(topk.asm["ptx"])}
    for w in WEIGHTS:
        scale = w != "bf16"
        up = compile_kernel(small_batch._small_gate_up_kernel,
                            _types(small_batch._small_gate_up_kernel,
                                   {"x_ptr": "*bf16", "w_ptr": "*" + w, "scale_ptr": "*fp32", "ids_ptr": "*i32",
                                    "act_ptr": "*bf16"}),
                            dict(K=2048, TOP_K=8, HAS_SCALE=scale, BLOCK_N=tiles["UP_BLOCK_N"],
                                 BLOCK_K=tiles["UP_BLOCK_K"], PDL=True), num_warps=tiles["UP_WARPS"])
        down = compile_kernel(small_batch._small_down_kernel,
                              _types(small_batch._small_down_kernel,
                                     {"act_ptr": "*bf16", "w_ptr": "*" + w, "scale_ptr": "*fp32", "ids_ptr": "*i32",
                                      "topk_w_ptr": "*fp32", "out_ptr": "*bf16"}),
                              dict(K=768, TOP_K=8, HAS_SCALE=scale, BLOCK_TK=8, BLOCK_N=tiles["DOWN_BLOCK_N"],
                                   BLOCK_K=tiles["DOWN_BLOCK_K"], PDL=True), num_warps=tiles["DOWN_WARPS"])
        # The routed variants, as launch_gate_up / launch_down launch them (contiguous bf16 logits:
        # Triton specializes a unit stride).
        route = dict(NUM_EXPERTS=128, BLOCK_E=128, stride_le=1)
        up_routed = compile_kernel(
            small_batch._small_gate_up_routed_kernel,
            _types(small_batch._small_gate_up_routed_kernel,
                   {"x_ptr": "*bf16", "w_ptr": "*" + w, "scale_ptr": "*fp32", "logits_ptr": "*bf16",
                    "act_ptr": "*bf16"}),
            dict(K=2048, TOP_K=8, HAS_SCALE=scale, BLOCK_N=tiles["UP_BLOCK_N"], BLOCK_K=tiles["UP_BLOCK_K"],
                 ROUTE_ROWS=tiles["UP_WARPS"], PDL=True, **route), num_warps=tiles["UP_WARPS"])
        down_routed = compile_kernel(
            small_batch._small_down_routed_kernel,
            _types(small_batch._small_down_routed_kernel,
                   {"act_ptr": "*bf16", "w_ptr": "*" + w, "scale_ptr": "*fp32", "logits_ptr": "*bf16",
                    "out_ptr": "*bf16"}),
            dict(K=768, TOP_K=8, HAS_SCALE=scale, RENORMALIZE=True, BLOCK_TK=8, BLOCK_N=tiles["DOWN_BLOCK_N"],
                 BLOCK_K=tiles["DOWN_BLOCK_K"], ROUTE_ROWS=tiles["DOWN_WARPS"], PDL=True, **route),
            num_warps=tiles["DOWN_WARPS"])
        for name, kernel in (("gate_up", up), ("down", down), ("gate_up_routed", up_routed),
                             ("down_routed", down_routed)):
            ptx = kernel.asm["ptx"]
            out[f"{name}-{w}"] = {**pdl_order(ptx), **_routing_facts(ptx), "spill_bytes": spill_bytes(ptx)}
    return out


def test_pdl_launches_compile_to_the_rule() -> None:
    info = compiled_facts(__file__, timeout=600)
    waits_first = {"waits": 1, "triggers": 1, "trigger_first": False, "loads_before_wait": 0}
    assert {k: v for k, v in info["topk"].items() if k != "spill_bytes"} == waits_first, info["topk"]
    order = ("waits", "triggers", "trigger_first", "loads_before_wait")
    for w in WEIGHTS:
        up, down = info[f"gate_up-{w}"], info[f"down-{w}"]
        assert {k: up[k] for k in order} == waits_first, (w, up)
        assert down["waits"] == 1 and down["triggers"] == 1 and not down["trigger_first"], (w, down)
        # The routing ids and weights and the first weight tile: several loads before the wait.
        assert down["loads_before_wait"] >= 3, (w, down)

        up, down = info[f"gate_up_routed-{w}"], info[f"down_routed-{w}"]
        assert {k: up[k] for k in order} == waits_first, (w, up)
        # The softmax sum (two halves) and at least one round (max, min), after the wait, in a warp.
        assert up["redux_after_wait"] >= 4 and up["barriers_routing"] <= 2, (w, up)
        assert down["waits"] == 1 and down["triggers"] == 1 and not down["trigger_first"], (w, down)
        # The logits and the first weight tile before the wait; all routing too (2 + 2 * top_k).
        assert down["loads_before_wait"] >= 2, (w, down)
        assert down["redux_before_wait"] == 2 + 2 * 8 and down["redux_after_wait"] == 0, (w, down)
    assert all(v["spill_bytes"] == 0 for v in info.values()), info


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
