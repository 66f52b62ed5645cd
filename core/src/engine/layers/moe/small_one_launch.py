"""The small-batch experts (``small_batch``) in one persistent launch instead of two.

With two launches the down launch's programs become resident only as gate/up's last wave retires:
its weights start streaming after gate/up's tail, and each launch pays its own ramp (on an H100 a
bare read of the 50 MB of gate/up weights takes 18.5 us and of the 25 MB of down weights 10.9 us,
while all 75 MB in one read take 26.4 us; ``scripts/bench_read_ceiling.py``). Here a grid of about
as many programs as fit on the GPU takes work items ("tickets") in order from one counter:

1. tickets ``0 .. up_tiles - 1``: gate/up tiles ``(slot, n)``, as ``_small_gate_up_kernel``'s programs;
   each one done adds 1 to its token's counter (a release after the tile's stores);
2. the rest: down tiles ``(token, n)``, as ``_small_down_kernel``'s programs. A program loads its
   down weights, then waits until its token's counter shows every gate/up tile of that token done,
   then reads the activations. So the down weights stream while the last gate/up tiles finish.

Tickets are taken in order by running programs, so every gate/up tile a down tile waits for
belongs to a program that is already running and waits on nothing: no deadlock, whatever the grid
size or what else occupies the GPU. The last program to finish zeroes the counters (the buffer is
zero between launches, also across CUDA graph replays). Under Triton's interpreter programs run one
after another: the first takes every ticket in order, which is still correct.

Results equal the two-launch path's (same tiles, same rounding); only the float32 order of the down
sums may differ when ``DOWN_BLOCK_K`` differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.moe.small_batch import _down_tile, _gate_up_tile, _scale_strides

#: Tokens a launch can serve: the counter buffer holds two counters and one per token.
ONE_LAUNCH_MAX_TOKENS = 62
_SYNC_SLOTS = 64

_sync_buffers: dict[torch.device, torch.Tensor] = {}


def sync_buffer(device: torch.device) -> torch.Tensor:
    """The zeroed int32 counters of ``device``'s one-launch kernels (one buffer per device: launches
    on one stream run one after another, and each leaves it zeroed)."""
    buf = _sync_buffers.get(device)
    if buf is None:
        buf = _sync_buffers[device] = torch.zeros(_SYNC_SLOTS, dtype=torch.int32, device=device)
    return buf


@triton.jit
def _small_experts_kernel(
    x_ptr, w13_ptr, s13_ptr, w2_ptr, s2_ptr, ids_ptr, topk_w_ptr, act_ptr, out_ptr, sync_ptr,
    tokens, num_programs,
    stride_xm, stride_w13e, stride_w13n, stride_s13e, stride_s13n,
    stride_w2e, stride_w2n, stride_s2e, stride_s2n, stride_am, stride_om,
    INTER: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr,
    UP_BLOCK_N: tl.constexpr, UP_BLOCK_K: tl.constexpr,
    BLOCK_TK: tl.constexpr, DOWN_BLOCK_N: tl.constexpr, DOWN_BLOCK_K: tl.constexpr,
    SYNC_SLOTS: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        # The ids are the previous kernel's output. The next kernel may start once every program
        # of this one runs (all of them are then past taking their first ticket's wait-free work).
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n_up = tl.cdiv(INTER, UP_BLOCK_N)
    up_tiles = tokens * TOP_K * n_up
    n_down = tl.cdiv(HIDDEN, DOWN_BLOCK_N)
    total = up_tiles + tokens * n_down
    done_ptr = sync_ptr + 2  # one counter per token: its gate/up tiles done
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    while ticket < total:
        # The next ticket is asked for now: its round trip overlaps this tile's loads.
        nxt = tl.atomic_add(sync_ptr, 1, sem="relaxed")
        if ticket < up_tiles:
            slot = ticket // n_up
            _gate_up_tile(x_ptr, w13_ptr, s13_ptr, ids_ptr, act_ptr, slot, ticket % n_up,
                          INTER, stride_xm, stride_w13e, stride_w13n, stride_s13e, stride_s13n, stride_am,
                          HIDDEN, TOP_K, HAS_SCALE, UP_BLOCK_N, UP_BLOCK_K)
            # Every thread's stores are issued before the count is raised (the release publishes them).
            tl.debug_barrier()
            tl.atomic_add(done_ptr + slot // TOP_K, 1, sem="release")
        else:
            down = ticket - up_tiles
            token = down // n_down
            _down_tile(act_ptr, w2_ptr, s2_ptr, ids_ptr, topk_w_ptr, out_ptr, token, down % n_down,
                       done_ptr + token, TOP_K * n_up,
                       HIDDEN, stride_am, stride_w2e, stride_w2n, stride_s2e, stride_s2n, stride_om,
                       INTER, TOP_K, HAS_SCALE, BLOCK_TK, DOWN_BLOCK_N, DOWN_BLOCK_K, 2)
        ticket = nxt
    # Every program has taken its last ticket and ended its waits once the exit count reaches the
    # grid size: the last one zeroes the counters for the next launch.
    tl.debug_barrier()
    finished = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel")
    if finished == num_programs - 1:
        offs = tl.arange(0, SYNC_SLOTS)
        tl.store(sync_ptr + offs, tl.zeros([SYNC_SLOTS], dtype=tl.int32), mask=offs < 2 + tokens)


def one_launch_programs(device: torch.device, per_sm: int) -> int:
    """The grid: ``per_sm`` programs per multiprocessor on a GPU; two under the interpreter (the
    second finds no ticket left, which the tests want to see)."""
    if device.type != "cuda":
        return 2
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def launch_experts_one_launch(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None,
                              w2: torch.Tensor, w2_scale: torch.Tensor | None, ids: torch.Tensor,
                              weights: torch.Tensor, act: torch.Tensor, out: torch.Tensor, tiles: dict[str, int],
                              pdl: bool = False) -> None:
    """Both steps of ``fused_moe_small_batch`` in one launch (``out [tokens, H]`` written; ``act``
    is the ``[slots, I]`` scratch between them). ``tiles``: ``small_batch_tiles``' keys, with
    ``ONE_LAUNCH_PER_SM`` programs per multiprocessor and ``ONE_LAUNCH_WARPS`` warps each.
    ``ids``: contiguous int32 ``[tokens, top_k]``; ``weights``: contiguous float32, same shape."""
    tokens, top_k = ids.shape
    if tokens > ONE_LAUNCH_MAX_TOKENS:
        raise ValueError(f"launch_experts_one_launch: {tokens} tokens; accepted: at most {ONE_LAUNCH_MAX_TOKENS}")
    inter, hidden = w2.shape[2], w2.shape[1]
    programs = one_launch_programs(x.device, tiles["ONE_LAUNCH_PER_SM"])
    _small_experts_kernel[(programs,)](
        x, w13, w13_scale if w13_scale is not None else w13, w2, w2_scale if w2_scale is not None else w2,
        ids, weights, act, out, sync_buffer(x.device), tokens, programs,
        x.stride(0), w13.stride(0), w13.stride(1), *_scale_strides(w13_scale),
        w2.stride(0), w2.stride(1), *_scale_strides(w2_scale), act.stride(0), out.stride(0),
        INTER=inter, HIDDEN=hidden, TOP_K=top_k, HAS_SCALE=w13_scale is not None,
        UP_BLOCK_N=tiles["UP_BLOCK_N"], UP_BLOCK_K=tiles["UP_BLOCK_K"], BLOCK_TK=triton.next_power_of_2(top_k),
        DOWN_BLOCK_N=tiles["DOWN_BLOCK_N"], DOWN_BLOCK_K=tiles["DOWN_BLOCK_K"], SYNC_SLOTS=_SYNC_SLOTS, PDL=pdl,
        num_warps=tiles.get("ONE_LAUNCH_WARPS", 8), num_stages=1, launch_pdl=pdl)
