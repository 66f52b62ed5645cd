"""How fast a batch-1 MoE decode step could be as ONE persistent kernel with grid-wide barriers: a
skeleton that streams exactly the weight bytes a Qwen3-MoE-shaped step reads, with the step's
dependency structure, and computes nothing useful (an analysis, not a way to run a model; GPU only).

Why: sessions 12-20 bounded the launch-per-stage decode step at 0.82 of the roofline even with the
attention and top-k free (docs/benchmarks.md, "Mixture of experts"), and pointed at a persistent
kernel per step as the route to the 0.8 goal. Before building one, this measures what such a kernel
can reach at best on this GPU: the grid barrier's cost, and how much of it preloading the next
stage's known weights hides.

The kernel runs ``programs`` programs (all resident: checked from the compiled kernel's registers and
shared memory), each taking a contiguous, equal share of every stage's bytes. Per layer:

1. qkv projection: stream ``H x (q + 2 kv)`` weights; barrier;
2. ``--attention-hops`` latency stages (the attention's prologue, split kernel, merge): each program
   loads a value another program stored in the stage before and stores one; barrier after each;
3. output projection: stream; barrier; 4. router: stream; barrier;
5. top-k: every program loads 128 "router logits" and takes a top 8 by repeated max; the experts'
   addresses depend on the result, so their loads cannot start earlier;
6. gate/up: stream ``top_k x 2I x H``; barrier; 7. down: stream ``top_k x H x I``; barrier.

After the last layer: the final norm's hop and the LM head (stream ``V x H``), barrier. A stage's
first tile (``tile`` bf16 values a program, issued as 16-byte loads) of the weights known before the
barrier that precedes it (qkv, output projection, router, down) is requested inside that barrier in
the ``preload*`` variants, between the barrier's arrive and its wait (into registers: what Triton can
hold across a barrier without shared memory).
Weights come from ``--sets`` copies of a layer's buffers taken in turn (more bytes than L2 between
two reads of one copy).

Variants: ``stream`` (no barriers: the bytes alone), ``sync`` (barriers, nothing loaded early),
``preload`` (barriers, first tiles early), ``sync_only`` (barriers and hops, no weight bytes: what
the structure costs by itself). At these barriers every thread polls; ``sync1``, ``preload1`` and
``sync1_only`` are the same with thread 0 alone arriving and polling (inline PTX) while the
program's other threads wait at the CTA barrier. ``syncf``, ``preloadf`` and ``syncf_only``: a flag a
program instead of one counter; thread 0 stores the barrier's number to its program's flag with
release semantics (no read-modify-write on one address), and every thread acquire-polls some of
the flags until the program's minimum reaches it. Prints one JSON line per variant: the step's
median time, its share of the roofline (the step's weight bytes at ``--bandwidth``), and us per layer.

usage: python3 scripts/bench_persistent_floor.py [MODEL_DIR] [--variants stream,sync,preload,sync_only]
       [--programs-per-sm 1 2] [--attention-hops 3] [--tile 8192] [--num-warps 8] [--result-file out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

VARIANTS = ("stream", "sync", "preload", "sync_only", "sync1", "preload1", "sync1_only", "syncf", "preloadf",
            "syncf_only")
ROOT = pathlib.Path(__file__).resolve().parents[1]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton comes with torch's CUDA wheels and this project
    triton = None


def step_bytes(config: dict) -> dict[str, int]:
    """bf16 elements of each stage's weights for one decode token of ``config`` (a Qwen3-MoE /
    Mixtral-style ``config.json``): per layer qkv, o, router, gate/up (top_k experts), down; and the
    LM head once."""
    try:
        h = int(config["hidden_size"])
        heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        d = int(config.get("head_dim") or h // heads)
        e, k = int(config["num_experts"]) if "num_experts" in config else int(config["num_local_experts"]), \
            int(config["num_experts_per_tok"])
        inter = int(config.get("moe_intermediate_size") or config["intermediate_size"])
        return {"qkv": h * (heads + 2 * kv) * d, "o": heads * d * h, "router": e * h, "gate_up": k * 2 * inter * h,
                "down": k * h * inter, "lm_head": int(config["vocab_size"]) * h,
                "layers": int(config["num_hidden_layers"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"bench_persistent_floor: config field {exc} missing or not a number; accepted: a MoE "
                         "config.json with hidden_size, num_attention_heads, num_key_value_heads, num_experts "
                         "(or num_local_experts), num_experts_per_tok, moe_intermediate_size, vocab_size, "
                         "num_hidden_layers") from exc


def roofline_ms(elems: dict[str, int], bandwidth_tb_s: float) -> float:
    per_layer = sum(elems[s] for s in ("qkv", "o", "router", "gate_up", "down"))
    return 2 * (elems["layers"] * per_layer + elems["lm_head"]) / (bandwidth_tb_s * 1e12) * 1e3


if triton is not None:

    @triton.jit
    def _ld_acquire(ptr):
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                         is_pure=False, pack=1)

    # Split-phase grid barrier: ``_arrive`` after a stage's stores, ``_wait`` before the next
    # stage's dependent loads; a preload goes between them (a release orders every memory access
    # before it, so a load issued before the arrive would hold the arrive back until it completed).
    # SYNC 1: Triton's scalar release add, acquire polls by every thread. SYNC 2: thread 0 alone
    # adds (``red``) and polls, in inline PTX (labels inside braces are local to the block, so it
    # can be inlined many times), the CTA barrier holding the other threads. A poll count past
    # MAX_SPIN sets the flag and goes on (no hang).
    def _thread0_only(instruction: str):
        """Inline PTX running ``instruction`` in thread 0 of the program only (returns 0)."""
        return tl.constexpr("{\n .reg .pred p_other;\n .reg .b32 r_tid;\n mov.u32 $0, 0;\n mov.u32 r_tid, %tid.x;\n"
                            " setp.ne.u32 p_other, r_tid, 0;\n @p_other bra SKIP;\n " + instruction + "\n SKIP:\n}")

    _ARRIVE_ONE = _thread0_only("red.release.gpu.global.add.s32 [$1], 1;")
    _STORE_ONE = _thread0_only("st.release.gpu.global.b32 [$1], $2;")
    _WAIT_ONE = tl.constexpr("""{
      .reg .pred p_other, p_wait, p_more;
      .reg .b32 r_tid, r_n;
      mov.u32 $0, $2;
      mov.u32 r_tid, %tid.x;
      setp.ne.u32 p_other, r_tid, 0;
      @p_other bra DONE;
      mov.u32 r_n, 0;
      WAIT:
      ld.acquire.gpu.global.b32 $0, [$1];
      add.u32 r_n, r_n, 1;
      setp.lt.s32 p_wait, $0, $2;
      setp.lt.u32 p_more, r_n, $3;
      and.pred p_wait, p_wait, p_more;
      @p_wait bra WAIT;
      DONE:
    }""")

    @triton.jit
    def _arrive(bar_ptr, pid, k, SYNC: tl.constexpr):
        # Barrier ``k`` (1, 2, ... in the launch). SYNC 1 and 2 add to one counter (target k x P);
        # SYNC 3 stores k to the program's own flag (no read-modify-write on one address).
        if SYNC != 0:
            tl.debug_barrier()
        if SYNC == 1:
            tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        elif SYNC == 2:
            tl.inline_asm_elementwise(_ARRIVE_ONE, "=r,l", [bar_ptr], dtype=tl.int32, is_pure=False, pack=1)
        elif SYNC == 3:
            tl.inline_asm_elementwise(_STORE_ONE, "=r,l,r", [bar_ptr + pid, k], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _wait(bar_ptr, flag_ptr, k, pid, P, SYNC: tl.constexpr, MAX_SPIN: tl.constexpr, PW: tl.constexpr):
        if SYNC == 1:
            target = k * P
            cur = _ld_acquire(bar_ptr)
            spins = tl.full([], 0, tl.int32)
            while (cur < target) & (spins < MAX_SPIN):
                cur = _ld_acquire(bar_ptr)
                spins += 1
            if cur < target:
                tl.store(flag_ptr, 1)
        elif SYNC == 2:
            target = k * P
            cur = tl.inline_asm_elementwise(_WAIT_ONE, "=r,l,r,r", [bar_ptr, target, tl.full([], MAX_SPIN, tl.int32)],
                                            dtype=tl.int32, is_pure=False, pack=1)
            if cur < target:
                tl.store(flag_ptr, 1)
        elif SYNC == 3:
            # Every thread acquire-loads some programs' flags; the CTA's minimum decides.
            offs = tl.arange(0, PW)
            ptrs = bar_ptr + tl.where(offs < P, offs, 0)
            low = tl.min(_ld_acquire(ptrs), axis=0)
            spins = tl.full([], 0, tl.int32)
            while (low < k) & (spins < MAX_SPIN):
                low = tl.min(_ld_acquire(ptrs), axis=0)
                spins += 1
            if low < k:
                tl.store(flag_ptr, 1)
        if SYNC != 0:
            tl.debug_barrier()

    @triton.jit
    def _grid_sync(bar_ptr, flag_ptr, k, pid, P, SYNC: tl.constexpr, MAX_SPIN: tl.constexpr, PW: tl.constexpr):
        _arrive(bar_ptr, pid, k, SYNC)
        _wait(bar_ptr, flag_ptr, k, pid, P, SYNC, MAX_SPIN, PW)

    @triton.jit
    def _share(n, pid, P, BLOCK: tl.constexpr):
        share = tl.cdiv(tl.cdiv(n, P), BLOCK) * BLOCK
        lo = pid.to(tl.int64) * share
        return lo, tl.minimum(lo + share, n)

    @triton.jit
    def _first_tile(w_ptr, n, pid, P, TILE: tl.constexpr, BLOCK: tl.constexpr):
        lo, hi = _share(n, pid, P, BLOCK)
        offs = lo + tl.arange(0, TILE // BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        return tl.load(w_ptr + offs, mask=offs < hi, other=0.0)

    @triton.jit
    def _stream(w_ptr, n, pid, P, x, TILE: tl.constexpr, BLOCK: tl.constexpr):
        # ``x``: the share's first tile, loaded by the caller (just now, or before a barrier). Each
        # step requests the next tile before adding the current one, so two tiles are in flight.
        lo, hi = _share(n, pid, P, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        grid = tl.arange(0, TILE // BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        for s in range(lo + TILE, hi, TILE):
            nxt = tl.load(w_ptr + s + grid, mask=s + grid < hi, other=0.0)
            acc += tl.sum(x.to(tl.float32), axis=0)
            x = nxt
        acc += tl.sum(x.to(tl.float32), axis=0)
        return tl.sum(acc)

    @triton.jit
    def _weight_stage(w_ptr, n, t_pre, scratch_ptr, src, dst, pid, P, PRELOAD: tl.constexpr, TILE: tl.constexpr,
                      BLOCK: tl.constexpr):
        # A projection: its input (a value another program stored in stage ``src``) and its weights
        # (from ``t_pre``, the first tile requested inside the barrier before, with PRELOAD) in
        # flight together; the result stored in slot ``dst``.
        x = tl.load(scratch_ptr + src * P + (pid + 1) % P)
        if PRELOAD:
            t = t_pre
        else:
            t = _first_tile(w_ptr, n, pid, P, TILE, BLOCK)
        acc = _stream(w_ptr, n, pid, P, t, TILE, BLOCK)
        tl.store(scratch_ptr + dst * P + pid, acc + x)

    @triton.jit
    def _hop(scratch_ptr, src, dst, pid, P, extra):
        # One dependent round trip: a value another program stored in an earlier stage.
        v = tl.load(scratch_ptr + src * P + (pid + 1) % P)
        tl.store(scratch_ptr + dst * P + pid, v + extra)

    @triton.jit
    def _skeleton_kernel(qkv_ptr, o_ptr, r_ptr, gu_ptr, dn_ptr, lm_ptr, scratch_ptr, bar_ptr, flag_ptr,
                         n_layers, n_qkv, n_o, n_r, n_gu, n_dn, n_lm,
                         SETS: tl.constexpr, HOPS: tl.constexpr, SYNC: tl.constexpr, PRELOAD: tl.constexpr,
                         TILE: tl.constexpr, BLOCK: tl.constexpr, MAX_SPIN: tl.constexpr,
                         PW: tl.constexpr):
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        NB: tl.constexpr = 5 + HOPS  # barriers a layer
        # Scratch slots a layer: 0 qkv, 1..HOPS attention, HOPS+1 o, +2 router, +3 gate/up, +4 down.
        S_O: tl.constexpr = HOPS + 1
        S_R: tl.constexpr = HOPS + 2
        S_GU: tl.constexpr = HOPS + 3
        S_DN: tl.constexpr = HOPS + 4
        # With PRELOAD a stage's first tile is requested inside the barrier before the stage (where
        # its weights are known then); without, at the stage's start.
        t_qkv = _first_tile(qkv_ptr, n_qkv, pid, P, TILE, BLOCK)
        t_o = t_qkv
        t_r = t_qkv
        t_dn = t_qkv
        for layer in range(n_layers):
            base = layer * NB
            s = layer % SETS
            # qkv: its input is the previous layer's output (a hop), its weights stream meanwhile.
            _weight_stage(qkv_ptr + s * n_qkv, n_qkv, t_qkv, scratch_ptr, S_DN, 0, pid, P, PRELOAD, TILE, BLOCK)
            _arrive(bar_ptr, pid, base + 1, SYNC)
            if PRELOAD:
                t_o = _first_tile(o_ptr + s * n_o, n_o, pid, P, TILE, BLOCK)
            _wait(bar_ptr, flag_ptr, base + 1, pid, P, SYNC, MAX_SPIN, PW)
            for h in tl.static_range(HOPS):
                _hop(scratch_ptr, h, h + 1, pid, P, 1.0)
                _grid_sync(bar_ptr, flag_ptr, base + 2 + h, pid, P, SYNC, MAX_SPIN, PW)
            _weight_stage(o_ptr + s * n_o, n_o, t_o, scratch_ptr, HOPS, S_O, pid, P, PRELOAD, TILE, BLOCK)
            _arrive(bar_ptr, pid, base + 2 + HOPS, SYNC)
            if PRELOAD:
                t_r = _first_tile(r_ptr + s * n_r, n_r, pid, P, TILE, BLOCK)
            _wait(bar_ptr, flag_ptr, base + 2 + HOPS, pid, P, SYNC, MAX_SPIN, PW)
            _weight_stage(r_ptr + s * n_r, n_r, t_r, scratch_ptr, S_O, S_R, pid, P, PRELOAD, TILE, BLOCK)
            _grid_sync(bar_ptr, flag_ptr, base + 3 + HOPS, pid, P, SYNC, MAX_SPIN, PW)
            # Top-k: 128 logits, 8 rounds of max; the experts' set depends on the result (never
            # switched at run time: the logits stay finite), so no expert load starts before it.
            offs = tl.arange(0, 128)
            logits = tl.load(scratch_ptr + S_R * P + (offs * 7) % P)
            picked = 0.0
            for _r in tl.static_range(8):
                m = tl.max(logits, axis=0)
                picked += m
                logits = tl.where(logits == m, float("-inf"), logits)
            e = (layer + (picked > 3.0e38).to(tl.int32)) % SETS
            acc = _stream(gu_ptr + e * n_gu, n_gu, pid, P, _first_tile(gu_ptr + e * n_gu, n_gu, pid, P, TILE, BLOCK),
                          TILE, BLOCK)
            tl.store(scratch_ptr + S_GU * P + pid, acc + picked)
            _arrive(bar_ptr, pid, base + 4 + HOPS, SYNC)
            if PRELOAD:
                t_dn = _first_tile(dn_ptr + e * n_dn, n_dn, pid, P, TILE, BLOCK)
            _wait(bar_ptr, flag_ptr, base + 4 + HOPS, pid, P, SYNC, MAX_SPIN, PW)
            _weight_stage(dn_ptr + e * n_dn, n_dn, t_dn, scratch_ptr, S_GU, S_DN, pid, P, PRELOAD, TILE, BLOCK)
            _arrive(bar_ptr, pid, base + 5 + HOPS, SYNC)
            if PRELOAD:
                t_qkv = _first_tile(qkv_ptr + ((layer + 1) % SETS) * n_qkv, n_qkv, pid, P, TILE, BLOCK)
            _wait(bar_ptr, flag_ptr, base + 5 + HOPS, pid, P, SYNC, MAX_SPIN, PW)
        # The final norm's hop, then the LM head.
        x = tl.load(scratch_ptr + S_DN * P + (pid + 1) % P)
        acc = _stream(lm_ptr, n_lm, pid, P, _first_tile(lm_ptr, n_lm, pid, P, TILE, BLOCK), TILE, BLOCK)
        tl.store(scratch_ptr + pid, acc + x)
        _grid_sync(bar_ptr, flag_ptr, n_layers * NB + 1, pid, P, SYNC, MAX_SPIN, PW)


def launch_args(bufs: dict, elems: dict, variant: str, hops: int, tile: int, block: int, sets: int,
                max_spin: int, programs: int) -> tuple[tuple, dict]:
    """The kernel's run-time arguments and constexprs for ``variant``."""
    if variant not in VARIANTS:
        raise ValueError(f"bench_persistent_floor: variant {variant!r}; accepted: {', '.join(VARIANTS)}")
    no_bytes = variant.endswith("_only")
    n = {s: 0 if no_bytes else elems[s] for s in ("qkv", "o", "router", "gate_up", "down", "lm_head")}
    args = (bufs["qkv"], bufs["o"], bufs["router"], bufs["gate_up"], bufs["down"], bufs["lm_head"], bufs["scratch"],
            bufs["bar"], bufs["flag"], elems["layers"], n["qkv"], n["o"], n["router"], n["gate_up"], n["down"],
            n["lm_head"])
    kind = variant.replace("preload", "sync").removesuffix("_only")
    consts = {"SETS": sets, "HOPS": hops, "SYNC": {"stream": 0, "sync": 1, "sync1": 2, "syncf": 3}[kind],
              "PW": triton.next_power_of_2(programs),
              "PRELOAD": variant.startswith("preload"),
              "TILE": tile, "BLOCK": block, "MAX_SPIN": max_spin}
    return args, consts


def _resident(kernel, num_warps: int, per_sm: int) -> tuple[bool, str]:
    kernel._init_handles()  # loads the module: n_regs and n_spills are known from then
    regs = kernel.n_regs * num_warps * 32 * per_sm
    shared = kernel.metadata.shared * per_sm
    ok = regs <= 65536 and shared <= 227 * 1024 and num_warps * per_sm <= 64
    return ok, f"{kernel.n_regs} registers a thread, {kernel.metadata.shared} B shared, {kernel.n_spills} B spilled"


def run(model_dir: pathlib.Path, variants: list[str], per_sm_list: list[int], hops: int, tile: int, sets: int,
        bandwidth: float, num_warps: int, result_file: str | None) -> None:
    import torch
    from engine_platform_cuda.graph_timing import graph_median_us

    from engine.bench.results import append_rows

    elems = step_bytes(json.loads((model_dir / "config.json").read_text()))
    block = 8 * 32 * num_warps  # 16-byte loads: 8 bf16 a thread
    if tile % block:
        raise ValueError(f"bench_persistent_floor: --tile {tile}; accepted: a multiple of {block} (8 x 32 x warps)")
    dev = "cuda"
    bufs = {s: torch.randn(sets * elems[s] + tile, device=dev, dtype=torch.bfloat16)
            for s in ("qkv", "o", "router", "gate_up", "down")}
    bufs["lm_head"] = torch.randn(elems["lm_head"] + tile, device=dev, dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    roof = roofline_ms(elems, bandwidth)
    for per_sm in per_sm_list:
        programs = sms * per_sm
        bufs["scratch"] = torch.rand((hops + 5) * programs, device=dev)
        bufs["bar"] = torch.zeros(programs, device=dev, dtype=torch.int32)  # a counter, or a flag a program
        bufs["flag"] = torch.zeros(1, device=dev, dtype=torch.int32)
        for variant in variants:
            args, consts = launch_args(bufs, elems, variant, hops, tile, block, sets, max_spin=1 << 16, programs=programs)
            compiled = _skeleton_kernel.warmup(*args, **consts, grid=(programs,), num_warps=num_warps, num_stages=1)
            ok, facts = _resident(compiled, num_warps, per_sm)
            row = {"bench": "persistent_floor", "variant": variant, "programs": programs, "programs_per_sm": per_sm,
                   "attention_hops": hops, "tile": tile, "num_warps": num_warps, "kernel": facts,
                   "gpu": torch.cuda.get_device_name(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            if not ok:
                row["skipped"] = "not every program can be resident at once: the grid barrier would hang"
            else:
                def call(args=args, consts=consts, programs=programs):
                    bufs["bar"].zero_()
                    _skeleton_kernel[(programs,)](*args, **consts, num_warps=num_warps, num_stages=1)
                us = graph_median_us([call], reps=10)
                torch.cuda.synchronize()
                if int(bufs["flag"].item()):
                    row["error"] = "a barrier timed out (programs not all resident?)"
                    bufs["flag"].zero_()
                row.update(step_ms=round(us / 1e3, 4), roofline_ms=round(roof, 4),
                           of_roofline=round(roof / (us / 1e3), 3), us_per_layer=round(us / elems["layers"], 2))
            print(json.dumps(row), flush=True)
            append_rows(result_file, row)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", default=str(ROOT / "docs" / "bench_configs" / "qwen3-30b-a3b"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--programs-per-sm", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--attention-hops", type=int, default=3)
    ap.add_argument("--tile", type=int, default=8192, help="bf16 values a program loads per step (and preloads)")
    ap.add_argument("--num-warps", type=int, default=8)
    ap.add_argument("--sets", type=int, default=4, help="copies of a layer's weights taken in turn")
    ap.add_argument("--bandwidth", type=float, default=3.02, help="TB/s the roofline is taken at")
    ap.add_argument("--result-file", default=None)
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    problems = []
    if bad or not variants:
        problems.append(f"--variants {a.variants!r}; accepted: comma-separated of {', '.join(VARIANTS)}")
    if a.attention_hops < 0:
        problems.append(f"--attention-hops {a.attention_hops}; accepted: an int >= 0")
    if any(p < 1 for p in a.programs_per_sm):
        problems.append(f"--programs-per-sm {a.programs_per_sm}; accepted: ints >= 1")
    if a.num_warps not in (1, 2, 4, 8, 16, 32):
        problems.append(f"--num-warps {a.num_warps}; accepted: 1, 2, 4, 8, 16 or 32")
    if a.sets < 2:
        problems.append(f"--sets {a.sets}; accepted: an int >= 2")
    model_dir = pathlib.Path(a.model_dir)
    if not (model_dir / "config.json").is_file():
        problems.append(f"model_dir {a.model_dir!r}: no config.json; accepted: a directory holding a MoE config.json")
    if problems:
        print(f"bench_persistent_floor: {problems[0]}", file=sys.stderr)
        return 2
    try:
        import torch
        if triton is None or not torch.cuda.is_available():
            print("bench_persistent_floor: needs a CUDA GPU (and Triton); none here", file=sys.stderr)
            return 2
        run(model_dir, variants, a.programs_per_sm, a.attention_hops, a.tile, a.sets, a.bandwidth, a.num_warps,
            a.result_file)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
