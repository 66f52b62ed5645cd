"""The small-batch MoE path's two Triton kernels (``small_batch``'s module docstring says what they
compute and ``small_batch.launch_gate_up`` / ``launch_down`` launch them): gate/up with SiLU-and-mul,
and down with the routing weights and the top-k sum (shared experts as extra slots in both)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _small_gate_up_kernel(
    x_ptr, w_ptr, scale_ptr, ids_ptr, act_ptr, ws_ptr,
    N, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am, stride_wsn,
    K: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    # Program row p is token p // (TOP_K + SHARED)'s slot j = p % (TOP_K + SHARED): a routed slot
    # (j < TOP_K), or chunk j - TOP_K of the shared experts' N-row pieces.
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = p // (TOP_K + SHARED)
    j = p % (TOP_K + SHARED)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if PDL:
        # The ids are the previous kernel's output: wait for it. Then let the down launch start:
        # its programs read the ids before they wait, which is safe once this program has waited.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    expert = tl.load(ids_ptr + token * TOP_K + tl.minimum(j, TOP_K - 1))
    held = expert >= 0
    # Rows past N read row N-1 again (unmasked 16-byte vectors; the store drops them).
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    # x is addressed with the tile's full [BLOCK_N, BLOCK_K] shape (stride 0 along N), so it lands
    # in the weights' register layout; the repeated addresses are served by L1.
    zero_n = tl.zeros([BLOCK_N], dtype=tl.int64)[:, None]
    x_ptrs = x_ptr + token.to(tl.int64) * stride_xm + zero_n + offs_k[None, :]
    g_ptrs = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
    up_rows = N * stride_wn
    if SHARED:
        # The shared experts' [gate (SHARED * N rows); up (SHARED * N rows)] weight: chunk c's gate
        # rows c * N .., its up rows (SHARED + c) * N ...
        shared = j >= TOP_K
        chunk_rows = (tl.maximum(j - TOP_K, 0) * N + rows).to(tl.int64)
        g_ptrs = tl.where(shared, ws_ptr + chunk_rows[:, None] * stride_wsn + offs_k[None, :], g_ptrs)
        up_rows = tl.where(shared, SHARED * N * stride_wsn, up_rows)
        held = held | shared
    u_ptrs = g_ptrs + up_rows
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for kk in range(0, K, BLOCK_K):
        k_ok = (offs_k[None, :] + kk < K) & held  # a slot held elsewhere: no memory request
        x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        acc_g += x * tl.load(g_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        acc_u += x * tl.load(u_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if HAS_SCALE:
        s_ptrs = scale_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_se + rows * stride_sn
        gate = gate * tl.load(s_ptrs, mask=held, other=0.0)
        up = up * tl.load(s_ptrs + N * stride_sn, mask=held, other=0.0)
    # Rounded where the grouped kernel's epilogue rounds (gate and up, then SiLU, then the product).
    out_ty = act_ptr.dtype.element_ty
    gate = gate.to(out_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32) * up.to(out_ty).to(tl.float32)
    tl.store(act_ptr + p.to(tl.int64) * stride_am + offs_n, act.to(out_ty), mask=n_ok)


@triton.jit
def _small_down_kernel(
    act_ptr, w_ptr, scale_ptr, ids_ptr, topk_w_ptr, out_ptr, ws_ptr,
    N, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om, stride_wsn,
    K: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_TK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    AHEAD: tl.constexpr,
):
    # With PDL everything up to gdc_wait runs while the gate/up launch drains: the ids and routing
    # weights (written before it) and the first weight tile are loaded then; the activations (its
    # output) only after the wait.
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_TK)
    t_ok = offs_t < TOP_K
    slots = token * TOP_K + offs_t
    expert = tl.load(ids_ptr + slots, mask=t_ok, other=-1)
    held = expert >= 0
    weight = tl.load(topk_w_ptr + slots, mask=held, other=0.0).to(tl.float32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    zero_n = tl.zeros([BLOCK_N], dtype=tl.int64)[None, :, None]
    k3 = offs_k[None, None, :]
    a_rows = token * (TOP_K + SHARED) + offs_t
    a_ptrs = act_ptr + a_rows[:, None, None] * stride_am + zero_n + k3
    w_ptrs = (w_ptr + tl.maximum(expert, 0).to(tl.int64)[:, None, None] * stride_we
              + rows[None, :, None] * stride_wn + k3)
    if SHARED:
        # Slots TOP_K .. TOP_K + SHARED - 1: the shared experts' down weight [N, SHARED * K], chunk
        # c's columns c * K ...
        shared = (offs_t >= TOP_K) & (offs_t < TOP_K + SHARED)
        chunk_cols = (tl.maximum(offs_t - TOP_K, 0) * K).to(tl.int64)
        w_ptrs = tl.where(shared[:, None, None],
                          ws_ptr + chunk_cols[:, None, None] + rows[None, :, None] * stride_wsn + k3, w_ptrs)
        held = held | shared
    held3 = held[:, None, None]
    acc = tl.zeros([BLOCK_TK, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if AHEAD:
        # Each step's weights are requested one step ahead (the first before the PDL wait), so a
        # program has two K steps of loads in flight instead of waiting on every step's.
        w = tl.load(w_ptrs, mask=(k3 < K) & held3, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        for kk in range(0, K, BLOCK_K):
            w_next = tl.load(w_ptrs + BLOCK_K, mask=(k3 + kk + BLOCK_K < K) & held3, other=0.0)
            a = tl.load(a_ptrs, mask=(k3 + kk < K) & held3, other=0.0).to(tl.float32)
            acc += a * w.to(tl.float32)
            w = w_next
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    else:
        if PDL:
            ok = (k3 < K) & held3
            w = tl.load(w_ptrs, mask=ok, other=0.0)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
            acc += tl.load(a_ptrs, mask=ok, other=0.0).to(tl.float32) * w.to(tl.float32)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        # K is a compile-time constant (the trip count known to the compiler); with PDL the first
        # step ran above.
        for kk in range(BLOCK_K * PDL, K, BLOCK_K):
            ok = (k3 + kk < K) & held3
            a = tl.load(a_ptrs, mask=ok, other=0.0).to(tl.float32)
            acc += a * tl.load(w_ptrs, mask=ok, other=0.0).to(tl.float32)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)  # [BLOCK_TK, BLOCK_N]: each slot's down row
    if HAS_SCALE:
        s_ptrs = scale_ptr + tl.maximum(expert, 0).to(tl.int64)[:, None] * stride_se + rows[None, :] * stride_sn
        y = y * tl.load(s_ptrs, mask=held[:, None], other=0.0)
    # As the grouped down launch stores each slot's row (times its weight, in the activation dtype)
    # and sum_top_k adds them in slot order in float32.
    out_ty = out_ptr.dtype.element_ty
    routed = (y * weight[:, None]).to(out_ty).to(tl.float32)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        total += tl.sum(tl.where(offs_t[:, None] == k, routed, 0.0), axis=0)
    if SHARED:
        # As the shared experts' own down projection rounds its output and the model adds the two.
        total = total.to(out_ty).to(tl.float32)
        total += tl.sum(tl.where(shared[:, None], y, 0.0), axis=0).to(out_ty).to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs_n, total.to(out_ty), mask=offs_n < N)
