"""The MoE layer's small-batch launches with programmatic dependent launch compile for an H100
(sm_90) to the order the PDL rule needs (docs/cuda_kernels.md, "Programmatic dependent launch").

- The router's top-k (its arg-max rounds warp reductions of one instruction each, ``redux.sync``)
  and the gate/up launch read their predecessor's output at once: one wait,
  no global load before it, and the trigger only after it (the down launch reads the routing
  before its own wait, which is safe only once gate/up has waited).
- The down launch loads the routing and its first weight tile before its wait (that is its gain)
  and triggers after it.
- None spills registers.

Compiled in a subprocess without the interpreter (``engine.testing.aot``), at the
Qwen3-30B-A3B shape (128 experts, top 8, hidden 2048, expert intermediate 768) with the tiles
``small_batch_tiles`` picks, bf16 and fp8 expert weights; and at DeepSeek-V2-Lite's (top 6 of 64,
intermediate 1408) with its two shared experts in the same launches (bf16).
"""

from __future__ import annotations

import json

from engine.testing.aot import compiled_facts, compile_kernel, pdl_order, spill_bytes

WEIGHTS = ("bf16", "fp8e4nv")


def _types(fn: object, pointers: dict[str, str]) -> dict[str, str]:
    return {a: pointers.get(a, "i32") for a in fn.arg_names}  # type: ignore[attr-defined]


def _compile_all() -> dict[str, dict[str, object]]:
    from engine.layers.moe import router_kernel, small_batch, small_batch_kernel

    out: dict[str, dict[str, object]] = {}
    topk = compile_kernel(router_kernel._softmax_topk_kernel,
                          _types(router_kernel._softmax_topk_kernel,
                                 {"logits_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32"}),
                          dict(TOP_K=8, RENORMALIZE=True, BLOCK_E=128, BLOCK_K=8, PDL=True), num_warps=1)
    out["topk"] = {**pdl_order(topk.asm["ptx"]), "spill_bytes": spill_bytes(topk.asm["ptx"]),
                   "redux": topk.asm["ptx"].count("redux.sync")}
    shapes = [(w, 8, 0, 2048, 768) for w in WEIGHTS] + [("bf16", 6, 2, 2048, 1408)]
    for w, top_k, shared, hidden, inter in shapes:
        scale = w != "bf16"
        tiles = small_batch.small_batch_tiles(top_k + shared, hidden, inter)
        up = compile_kernel(small_batch_kernel._small_gate_up_kernel,
                            _types(small_batch_kernel._small_gate_up_kernel,
                                   {"x_ptr": "*bf16", "w_ptr": "*" + w, "scale_ptr": "*fp32", "ids_ptr": "*i32",
                                    "act_ptr": "*bf16", "ws_ptr": "*" + w}),
                            dict(K=hidden, TOP_K=top_k, SHARED=shared, HAS_SCALE=scale, BLOCK_N=tiles["UP_BLOCK_N"],
                                 BLOCK_K=tiles["UP_BLOCK_K"], PDL=True), num_warps=tiles["UP_WARPS"])
        down = compile_kernel(small_batch_kernel._small_down_kernel,
                              _types(small_batch_kernel._small_down_kernel,
                                     {"act_ptr": "*bf16", "w_ptr": "*" + w, "scale_ptr": "*fp32", "ids_ptr": "*i32",
                                      "topk_w_ptr": "*fp32", "out_ptr": "*bf16", "ws_ptr": "*" + w}),
                              dict(K=inter, TOP_K=top_k, SHARED=shared, HAS_SCALE=scale, BLOCK_TK=8,
                                   BLOCK_N=tiles["DOWN_BLOCK_N"], BLOCK_K=tiles["DOWN_BLOCK_K"], PDL=True,
                                   AHEAD=bool(tiles["DOWN_AHEAD"])), num_warps=tiles["DOWN_WARPS"])
        kernels = [("gate_up", up), ("down", down)]
        if shared:
            # The down launch the other way round: DOWN_AHEAD (each step's weights requested a
            # step ahead) where the default tile does not take it, and the reverse.
            kernels.append(("down_other", compile_kernel(
                small_batch_kernel._small_down_kernel, _types(small_batch_kernel._small_down_kernel, {
                    "act_ptr": "*bf16", "w_ptr": "*" + w, "scale_ptr": "*fp32", "ids_ptr": "*i32",
                    "topk_w_ptr": "*fp32", "out_ptr": "*bf16", "ws_ptr": "*" + w}),
                dict(K=inter, TOP_K=top_k, SHARED=shared, HAS_SCALE=scale, BLOCK_TK=8, BLOCK_N=tiles["DOWN_BLOCK_N"],
                     BLOCK_K=tiles["DOWN_BLOCK_K"], PDL=True, AHEAD=not tiles["DOWN_AHEAD"]),
                num_warps=tiles["DOWN_WARPS"])))
        for name, kernel in kernels:
            ptx = kernel.asm["ptx"]
            out[f"{name}-{w}{'-shared' if shared else ''}"] = {**pdl_order(ptx), "spill_bytes": spill_bytes(ptx)}
    return out


def test_pdl_launches_compile_to_the_rule() -> None:
    info = compiled_facts(__file__, timeout=600)
    waits_first = {"waits": 1, "triggers": 1, "trigger_first": False, "loads_before_wait": 0}
    assert {k: v for k, v in info["topk"].items() if k not in ("spill_bytes", "redux")} == waits_first, info["topk"]
    # Each of the 8 arg-max rounds is two single-instruction warp reductions (int32 max, id min).
    assert info["topk"]["redux"] >= 2 * 8, info["topk"]
    for w in (*WEIGHTS, "bf16-shared"):
        up, down = info[f"gate_up-{w}"], info[f"down-{w}"]
        assert {k: v for k, v in up.items() if k != "spill_bytes"} == waits_first, (w, up)
        assert down["waits"] == 1 and down["triggers"] == 1 and not down["trigger_first"], (w, down)
        # The routing ids and weights and the first weight tile: several loads before the wait.
        assert down["loads_before_wait"] >= 3, (w, down)
    # The down launch with the other DOWN_AHEAD choice than the shape's default.
    down_other = info["down_other-bf16-shared"]
    assert down_other["waits"] == 1 and down_other["triggers"] == 1 and not down_other["trigger_first"], down_other
    assert down_other["loads_before_wait"] >= 3, down_other
    assert all(v["spill_bytes"] == 0 for v in info.values()), info


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
