"""One-split decode attention over an e4m3 pool, with the tensor-core operands built in registers (Gluon).

The Triton kernel (``decode_attention``, ``words`` 3) gathers each block's K/V as int32 words and
widens them to float16, but ``tl.dot`` then sends the widened tiles through shared memory into the
tensor cores' operand layout. Here the words are gathered straight into registers in a layout that,
once widened, IS the operand layout of ``mma.sync.m16n8k16`` (sm_80+), so nothing goes through shared
memory. Both products put the keys or value columns in the 16-row operand and the GQA group (up to 8
query heads) in the 8-column one:

- scores transposed, ``S^T[key, head] = K[key, :] . q[head, :]``: K is operand A (16 keys by
  ``D``), q^T operand B (``D`` by 8 heads);
- output transposed, ``O^T[dv, head] += V^T[dv, key] P^T[key, head]``: V^T is operand A (``D`` by
  16 keys), P^T operand B.

Operand A's lane ``4g + t`` holds rows ``g`` and ``g + 8`` of each 16-row tile at columns ``2t, 2t+1,
2t+8, 2t+9`` of each 16-column chunk. The sums over ``d`` and over keys do not depend on their order,
nor does the output on the order its columns are computed in, so each thread's gather reads
contiguous bytes and the operand's positions are a fixed permutation of them:

- K: lane ``(g, t)`` reads keys ``g`` and ``g + 8``, bytes ``[t D/4, (t+1) D/4)`` of each row; byte
  ``t D/4 + 4c + 2a + b`` is operand column ``16c + 8a + 2t + b`` (q is gathered in the same order);
- V: lane ``(g, t)`` reads bytes ``[g D/8, (g+1) D/8)`` of four keys, the block's key positions
  ``8a + 2t + b``; two keys' words are interleaved bytewise (``prmt``) so one conversion widens a
  (key, key) pair of one value column; operand row ``32w + 16h + 8l + g`` is value column
  ``g D/8 + 4w + 2h + l``, which the final store undoes.

The softmax runs over the score tile's rows (keys), a head's maximum over 8 lanes, its sum
accumulated element-wise and reduced once at the end. Each block's slots are loaded two blocks
ahead and its K/V one block ahead into registers, so a block's gathers are in flight while the
previous one is attended.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from engine_attention_triton.jit_math import E4M3_WORD_TO_F16_ASM, word_aligned

#: Registers a thread (Triton's ``maxnreg``; 0: no cap) by keys a block (16 or 32, one or two of the
#: operands' 16-row tiles). 16-key blocks need 136 uncapped; the 128 cap (no spills) lets more one-warp
#: programs share an SM. 32-key blocks take 215 uncapped (fewer programs an SM, each with twice the
#: bytes in flight); capped, they spill. On an H200 (8 KV heads,
#: 1,552-token rows, ``benchmarks/bench_decode.py --mma``, 2026-11-29): batch 1,024, 783 us (16 keys,
#: capped) / 894 (16, uncapped) / 790 (32); batch 128, 137 / 139 / 111 us.
MAXNREG = {16: 128, 32: 0}


@gluon.jit
def _widen_pairs(x):
    """int32 words of four e4m3 values -> four float16 (the hardware's paired conversion, sm_89+)."""
    return gl.inline_asm_elementwise(
        asm=E4M3_WORD_TO_F16_ASM, constraints="=h,=h,=h,=h,r", args=[x],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=1)


@gluon.jit
def _widen_interleaved(x, y):
    """Two int32 words (four e4m3 values each, of two keys) -> eight float16: value j of x, then of y,
    for j = 0..3 (each pair one register for the tensor cores)."""
    return gl.inline_asm_elementwise(
        asm="""
        {
        .reg .b16 l0, h0, l1, h1;
        .reg .b32 p0, p1, r0, r1, r2, r3;
        prmt.b32 p0, $8, $9, 0x5140;
        prmt.b32 p1, $8, $9, 0x7362;
        mov.b32 {l0, h0}, p0;
        mov.b32 {l1, h1}, p1;
        cvt.rn.f16x2.e4m3x2 r0, l0;
        cvt.rn.f16x2.e4m3x2 r1, h0;
        cvt.rn.f16x2.e4m3x2 r2, l1;
        cvt.rn.f16x2.e4m3x2 r3, h1;
        mov.b32 {$0, $1}, r0;
        mov.b32 {$2, $3}, r1;
        mov.b32 {$4, $5}, r2;
        mov.b32 {$6, $7}, r3;
        }
        """,
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r", args=[x, y],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True, pack=1)


@gluon.jit
def _k_operand(kw, BLOCK: gl.constexpr, D: gl.constexpr, OP_A: gl.constexpr):
    """K's gathered words ``[BLOCK, D/4]`` (lane (g, t): rows g + 8r; words t D/16 ...) -> operand A
    ``[BLOCK, D]`` float16, column ``16c + 8a + 2t + b`` holding byte ``4(t D/16 + c) + 2a + b``."""
    e0, e1, e2, e3 = _widen_pairs(kw)
    x = gl.join(gl.join(e0, e1), gl.join(e2, e3))  # [BLOCK, D/4, b, a]
    x = gl.reshape(x, [BLOCK, 4, D // 16, 2, 2])  # [n, t, c, b, a]
    x = gl.permute(x, [0, 2, 4, 1, 3])  # [n, c, a, t, b]
    return gl.convert_layout(gl.reshape(x, [BLOCK, D]), OP_A, assert_trivial=True)


@gluon.jit
def _v_operand(vw, BLOCK: gl.constexpr, D: gl.constexpr, OP_A: gl.constexpr):
    """V's gathered words ``[BLOCK, D/4]`` (lane (g, t): rows t + 4r holding key positions
    16s + 8a + 2t + b, r = 4s + 2a + b; words g D/32 ...) -> V^T as operand A ``[D, BLOCK]`` float16
    over key positions."""
    x = gl.reshape(vw, [BLOCK // 16, 2, 2, 4, D // 4])  # [s, a, b, t, w]
    x = gl.permute(x, [0, 1, 3, 4, 2])  # [s, a, t, w, b]
    v0, v1 = gl.split(x)
    o0, o1, o2, o3, o4, o5, o6, o7 = _widen_interleaved(v0, v1)
    j0 = gl.join(o0, o1)  # [s, a, t, w, b]
    j1 = gl.join(o2, o3)
    j2 = gl.join(o4, o5)
    j3 = gl.join(o6, o7)
    x = gl.join(gl.join(j0, j1), gl.join(j2, j3))  # [s, a, t, w, b, l, h]: value 2h + l of word w
    x = gl.reshape(x, [BLOCK // 16, 2, 4, 8, D // 32, 2, 2, 2])  # [s, a, t, g, w', b, l, h]
    x = gl.permute(x, [4, 7, 6, 3, 0, 1, 2, 5])  # [w', h, l, g, s, a, t, b]
    return gl.convert_layout(gl.reshape(x, [D, BLOCK]), OP_A, assert_trivial=True)


@gluon.jit
def decode_fp8_mma_kernel(
    Q, K_Buf, V_Buf, Req_To_Token, Req_Pool_Indices, Seq_Lens, Out,
    sm_scale, v_scale,
    stride_qb, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_r2t,
    stride_ob, stride_oh,
    GROUP: gl.constexpr,
    D: gl.constexpr,
    BLOCK: gl.constexpr,
    SLIDING_WINDOW: gl.constexpr,
    PDL: gl.constexpr,
):
    # Strides of K_Buf / V_Buf (int32 views of the pool) are in words; one program per (KV head, row).
    kv_head = gl.program_id(0)
    row = gl.program_id(1).to(gl.int64)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    op_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    op_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # K: lane (g, t) = lane // 4, lane % 4 gathers rows g, g+8 and D/16 words from t D/16.
    k_lay: gl.constexpr = gl.BlockedLayout([1, D // 16], [8, 4], [1, 1], [1, 0])
    # V: lane (g, t) gathers rows t + 4r and D/32 words from g D/32.
    v_lay: gl.constexpr = gl.BlockedLayout([1, D // 32], [4, 8], [1, 1], [0, 1])
    q_lay: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [1, 1], [0, 1])
    heads_of: gl.constexpr = gl.SliceLayout(0, mma)

    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    seq_len = gl.load(Seq_Lens + row).to(gl.int32)
    req = gl.load(Req_Pool_Indices + row).to(gl.int64)
    lo = 0
    if SLIDING_WINDOW >= 0:
        lo = gl.maximum(seq_len - 1 - SLIDING_WINDOW, 0)
    token_row = Req_To_Token + req * stride_r2t

    # Key positions within a block: K's rows in order; V's row i holds position 8a + 2t + b.
    kn = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, k_lay))
    vi = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, v_lay))
    vn = (vi // 8) * 8 + (vi % 4) * 2 + (vi // 4) % 2
    kc = gl.arange(0, D // 4, layout=gl.SliceLayout(0, k_lay))
    vc = gl.arange(0, D // 4, layout=gl.SliceLayout(0, v_lay))
    k_base = K_Buf + kv_head * stride_kh + kc[None, :]
    v_base = V_Buf + kv_head * stride_vh + vc[None, :]

    # q^T as operand B, its d in K's column order: column 16c + 8a + 2t + b is d = t D/4 + 4c + 2a + b.
    qk_ = gl.arange(0, D, layout=gl.SliceLayout(1, q_lay))
    qd = ((qk_ // 2) % 4) * (D // 4) + (qk_ // 16) * 4 + ((qk_ // 8) % 2) * 2 + qk_ % 2
    qh = gl.arange(0, 8, layout=gl.SliceLayout(0, q_lay))

    loc_k = gl.load(token_row + lo + kn, mask=lo + kn < seq_len, other=0).to(gl.int64)
    loc_v = gl.load(token_row + lo + vn, mask=lo + vn < seq_len, other=0).to(gl.int64)
    nk = lo + BLOCK + kn
    nv = lo + BLOCK + vn
    # The slots two blocks ahead stay int32 (fewer registers) until they address a gather.
    nloc_k = gl.load(token_row + nk, mask=nk < seq_len, other=0)
    nloc_v = gl.load(token_row + nv, mask=nv < seq_len, other=0)
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
    kw = gl.load(k_base + loc_k[:, None] * stride_kt, mask=(lo + kn < seq_len)[:, None], other=0)
    vw = gl.load(v_base + loc_v[:, None] * stride_vt, mask=(lo + vn < seq_len)[:, None], other=0)

    qv = gl.load(Q + row * stride_qb + (kv_head * GROUP + qh)[None, :] * stride_qh + qd[:, None],
                 mask=(qh < GROUP)[None, :], other=0.0).to(gl.float32)
    # float16 holds bf16 exactly below 65504; a larger q is scaled by 2^-16 (its scores by 2^16).
    fac = gl.where(gl.max(gl.max(gl.abs(qv), 1), 0) > 32768.0, 65536.0, 1.0)
    q_b = gl.convert_layout((qv / fac).to(gl.float16), op_b)
    scale = sm_scale * fac * 1.4426950408889634

    m_i = gl.full([8], float("-inf"), gl.float32, layout=heads_of)
    l_acc = gl.zeros([BLOCK, 8], gl.float32, layout=mma)
    acc = gl.zeros([D, 8], gl.float32, layout=mma)
    key_rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma))
    for start in range(lo, seq_len, BLOCK):
        # Gathers of the next block, then slots of the one after, before this block's attention.
        nxt = start + BLOCK
        kw_n = gl.load(k_base + nloc_k.to(gl.int64)[:, None] * stride_kt, mask=(nxt + kn < seq_len)[:, None], other=0)
        vw_n = gl.load(v_base + nloc_v.to(gl.int64)[:, None] * stride_vt, mask=(nxt + vn < seq_len)[:, None], other=0)
        nk = nxt + BLOCK + kn
        nv = nxt + BLOCK + vn
        nloc_k = gl.load(token_row + nk, mask=nk < seq_len, other=0)
        nloc_v = gl.load(token_row + nv, mask=nv < seq_len, other=0)

        s = mma_v2(_k_operand(kw, BLOCK, D, op_a), q_b, gl.zeros([BLOCK, 8], gl.float32, layout=mma))
        s = gl.where((start + key_rows < seq_len)[:, None], s * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_acc = l_acc * alpha[None, :] + p
        p_b = gl.convert_layout(p.to(gl.float16), op_b)
        acc = mma_v2(_v_operand(vw, BLOCK, D, op_a), p_b, acc * alpha[None, :])
        m_i = m_new
        kw = kw_n
        vw = vw_n

    l_i = gl.sum(l_acc, 0)
    # A row of length 0 (a padded CUDA-graph row may be one) attends to nothing and writes zeros.
    out = acc * (v_scale / gl.where(l_i > 0, l_i, 1.0))[None, :]
    # Operand row m = 32w + 16h + 8l + g is value column g D/8 + 4w + 2h + l.
    om = gl.arange(0, D, layout=gl.SliceLayout(1, mma))
    dv = (om % 8) * (D // 8) + (om // 32) * 4 + ((om // 16) % 2) * 2 + (om // 8) % 2
    oh = gl.arange(0, 8, layout=heads_of)
    gl.store(Out + row * stride_ob + (kv_head * GROUP + oh)[None, :] * stride_oh + dv[:, None],
             out.to(Out.dtype.element_ty), mask=(oh < GROUP)[None, :])


def decode_fp8_mma_fwd(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor,
                       req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       sm_scale: float, sliding_window_size: int = -1, *, k_scale: float = 1.0,
                       v_scale: float = 1.0, pdl: bool = False, block_n: int = 16, maxnreg: int | None = None) -> None:
    """Decode attention of bf16 ``q`` over an e4m3 pool in one split (``decode_attention_fwd``'s
    arguments; ``fits`` says which shapes this kernel takes). ``block_n``: keys a block, 16 or 32
    (``decode_tiles`` picks); ``maxnreg``: a register cap a thread (0: none; default ``MAXNREG[block_n]``)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if not fits(q, k_buffer, v_buffer):
        raise ValueError(f"decode_fp8_mma: needs bf16 q, an e4m3 pool with 4-byte aligned rows, head dims 64 or 128, "
                         f"at most 8 query heads a KV head and contiguous last dims; got q {tuple(q.shape)} {q.dtype} "
                         f"strides {q.stride()}, pool {tuple(k_buffer.shape)} / {tuple(v_buffer.shape)} "
                         f"{k_buffer.dtype} strides {k_buffer.stride()} / {v_buffer.stride()}")
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"decode_fp8_mma: out needs q's shape {tuple(q.shape)} and a contiguous last dim")
    if block_n not in (16, 32):
        raise ValueError(f"decode_fp8_mma: block_n={block_n}; accepted: 16, 32")
    if batch == 0:
        return
    maxnreg = MAXNREG[block_n] if maxnreg is None else maxnreg
    kw = k_buffer.view(torch.int32)
    vw = v_buffer.view(torch.int32)
    decode_fp8_mma_kernel[(num_kv_heads, batch)](
        q, kw, vw, req_to_token, req_pool_indices, seq_lens, out,
        sm_scale * k_scale, float(v_scale),
        q.stride(0), q.stride(1),
        kw.stride(0), kw.stride(1),
        vw.stride(0), vw.stride(1),
        req_to_token.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads,
        D=head_dim,
        BLOCK=block_n,
        SLIDING_WINDOW=sliding_window_size if sliding_window_size >= 0 else -1,
        PDL=pdl,
        num_warps=1,
        launch_pdl=pdl,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )


def fits(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """Whether this kernel takes these shapes: bf16 q over an e4m3 pool whose strides are whole words (the
    last dims contiguous), K and V of one head dim, 64 or 128, and at most 8 query heads a KV head (the
    operand's 8 columns)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    return (q.dtype == torch.bfloat16 and k_buffer.dtype == v_buffer.dtype == torch.float8_e4m3fn
            and head_dim in (64, 128) and k_buffer.shape[2] == v_buffer.shape[2] == head_dim
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 8
            and word_aligned(k_buffer, v_buffer)
            and q.stride(-1) == k_buffer.stride(-1) == v_buffer.stride(-1) == 1)
