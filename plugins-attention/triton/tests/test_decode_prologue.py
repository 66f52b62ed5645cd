"""The one-launch decode (``decode_prologue.py``: prologue, attention and merge) against the three
launches it replaces: the CUDA platform's ``qkv_prologue``, then ``decode_attention_fwd``'s split
kernel and merge.

Without a GPU both run in Triton's interpreter on CPU tensors (float32: the interpreter's 16-bit
``tl.dot`` is wrong); on a GPU the same cases run compiled, plus bf16 with programmatic dependent
launch and CUDA-graph replays. The pool after the step must equal the three launches' (K within one
unit in the last place on a GPU: the norm's sum of squares is reduced over another warp layout),
the output must agree within the dtype's tolerance (the merge adds the splits in order), the split
tickets must be back at 0, and a second launch must give the same output.
"""

from __future__ import annotations

import os

import pytest
import torch

prologue = pytest.importorskip("engine_platform_cuda.prologue")

from engine.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from engine_attention_triton.decode_attention import decode_attention_fwd, has_pdl  # noqa: E402
from engine_attention_triton.decode_prologue import decode_attention_prologue_fwd  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="no GPU and Triton's interpreter is off (TRITON_INTERPRET=1 runs these on CPU)")
TOLERANCE = {torch.bfloat16: (2e-2, 1e-2), torch.float16: (5e-3, 3e-3), torch.float32: (1e-4, 1e-5)}


class _Step:
    """One decode step of ``lens`` rows on shuffled KV slots: a fused qkv output with padded rows,
    positions, the newest slots (holding stale values before the step), norm weights, rotary."""

    def __init__(self, lens: list[int], kv_heads: int, group: int, head_dim: int, rotary_dim: int,
                 dtype: torch.dtype, norm: bool, kv: torch.dtype | None = None, seed: int = 0) -> None:
        if DEVICE == "cpu":
            from engine_attention_triton.interpreter_compat import patch_interpreter_index

            patch_interpreter_index()
        gen = torch.Generator().manual_seed(seed)
        self.lens, self.dtype, self.kv_heads, self.head_dim = lens, dtype, kv_heads, head_dim
        self.heads, self.rotary_dim = kv_heads * group, rotary_dim
        bs, slots = len(lens), sum(lens) + 9
        self.kv_dtype = kv or dtype
        self.pool = MHATokenToKVPool(slots, 1, self.kv_dtype, kv_heads, head_dim, 1, DEVICE)
        for buf in self.pool.k_buffer + self.pool.v_buffer:
            buf.copy_(torch.randn(buf.shape, generator=gen).to(self.kv_dtype))
        self.req = ReqToTokenPool(bs + 3, max(lens) + 17, DEVICE)
        self.req.req_to_token.copy_(torch.randint(0, slots, self.req.req_to_token.shape, generator=gen))
        order, cursor = torch.randperm(slots - 1, generator=gen) + 1, 0
        self.req_slots = (torch.randperm(bs + 3, generator=gen)[:bs]).to(DEVICE)
        for slot, n in zip(self.req_slots.tolist(), lens):
            self.req.req_to_token[slot, :n] = order[cursor:cursor + n].to(DEVICE, torch.int32)
            cursor += n
        self.loc = torch.stack([self.req.req_to_token[s, n - 1] for s, n in zip(self.req_slots.tolist(), lens)])
        self.loc = self.loc.to(torch.int64)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        self.positions = (self.seq_lens - 1).to(torch.int64)
        width = (self.heads + 2 * kv_heads) * head_dim
        self.qkv = (torch.randn(bs, width + 8, generator=gen) * 2).to(dtype).to(DEVICE)
        self.rope = RotaryEmbedding(head_dim, rotary_dim, 4096, 10000.0).to(DEVICE)
        self.q_w = torch.randn(head_dim, generator=gen).to(dtype).to(DEVICE) if norm else None
        self.k_w = torch.randn(head_dim, generator=gen).to(dtype).to(DEVICE) if norm else None
        self.scales = (0.37, 0.0219) if kv is not None else (1.0, 1.0)

    def views(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_size, k_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return qkv[:, :q_size], qkv[:, q_size:q_size + k_size], qkv[:, q_size + k_size:q_size + 2 * k_size]

    def workspaces(self, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs = len(self.lens)
        # A spare split: the kernels must use the strides, not the shape. NaN: nothing unwritten is read.
        part_out = torch.full((bs, self.heads, splits + 1, self.head_dim), float("nan"), device=DEVICE)
        part_lse = torch.full((bs, self.heads, splits + 1), float("nan"), device=DEVICE)
        tickets = torch.zeros((bs + 2, self.kv_heads), dtype=torch.int32, device=DEVICE)
        return part_out, part_lse, tickets

    def three_launches(self, splits: int, window: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        qkv = self.qkv.clone()
        q, k, v = self.views(qkv)
        pool = self._fresh_pool()
        k_buf, v_buf = pool.get_kv_buffer(0)
        prologue.qkv_prologue(self.positions, q, k, v, k_buf, v_buf, self.loc, self.rope.cos_cache,
                              self.rope.sin_cache, self.rotary_dim, self.q_w, self.k_w, 1e-6, *self.scales)
        out = torch.full((len(self.lens), self.heads, self.head_dim), float("nan"), dtype=self.dtype, device=DEVICE)
        part_out, part_lse, _ = self.workspaces(splits)
        decode_attention_fwd(q.reshape(-1, self.heads, self.head_dim), k_buf, v_buf, out, self.req.req_to_token,
                             self.req_slots, self.seq_lens, part_out, part_lse, splits, self.head_dim**-0.5,
                             0.0, window, k_scale=self.scales[0], v_scale=self.scales[1])
        return out, [k_buf, v_buf]

    def one_launch(self, splits: int, window: int, pdl: bool = False, pool: MHATokenToKVPool | None = None,
                   work: tuple[torch.Tensor, ...] | None = None, out: torch.Tensor | None = None,
                   check: bool = True, merge: bool = True) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        qkv = self.qkv.clone()
        q, k, v = self.views(qkv)
        pool = pool or self._fresh_pool()
        k_buf, v_buf = pool.get_kv_buffer(0)
        part_out, part_lse, tickets = work or self.workspaces(splits)
        if out is None:
            out = torch.full((len(self.lens), self.heads, self.head_dim), float("nan"), dtype=self.dtype,
                             device=DEVICE)
        decode_attention_prologue_fwd(
            q, k, v, out, k_buf, v_buf, self.req.req_to_token, self.req_slots, self.seq_lens, self.loc,
            self.positions, self.rope.cos_cache, self.rope.sin_cache, self.rotary_dim, self.q_w, self.k_w, 1e-6,
            part_out, part_lse, tickets, splits, self.head_dim**-0.5, 0.0, window,
            k_scale=self.scales[0], v_scale=self.scales[1], pdl=pdl, merge_in_kernel=merge)
        if check:  # (not while a CUDA graph is being captured)
            assert torch.equal(qkv, self.qkv), "the projection's output was changed"
        return out, [k_buf, v_buf], tickets

    def _fresh_pool(self) -> MHATokenToKVPool:
        pool = MHATokenToKVPool(self.pool.size, 1, self.kv_dtype, self.kv_heads, self.head_dim, 1, DEVICE)
        for dst, src in zip(pool.k_buffer + pool.v_buffer, self.pool.k_buffer + self.pool.v_buffer, strict=True):
            dst.copy_(src)
        # The newest slots hold stale values: the step must write them, and attend to what it wrote.
        for dst in pool.k_buffer + pool.v_buffer:
            dst[self.loc] = torch.full_like(dst[self.loc], 5.0)
        return pool


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (unwritten or bad math)"
    err = (out.double() - ref.double()).abs()
    atol, rtol = TOLERANCE[dtype]
    rel = (err.norm() / ref.double().norm().clamp_min(1e-30)).item()
    assert err.max().item() <= atol and rel <= rtol, f"{what}: max abs err {err.max().item():.3g}, rel {rel:.3g}"


def assert_pool_equal(got: list[torch.Tensor], ref: list[torch.Tensor], what: str) -> None:
    """V (copied, or quantized alike) bit-equal; K bit-equal in the interpreter, within one unit in
    the last place compiled (the norm's sum of squares runs over another warp layout)."""
    k, v = got
    k_ref, v_ref = ref
    assert torch.equal(v.float(), v_ref.float()), f"{what}: V differs"
    if DEVICE == "cpu":
        assert torch.equal(k.float(), k_ref.float()), f"{what}: K differs"
    else:
        ulp = torch.finfo(k_ref.dtype).eps * k_ref.float().abs().clamp_min(torch.finfo(k_ref.dtype).tiny)
        assert ((k.float() - k_ref.float()).abs() <= ulp).all(), f"{what}: K differs by more than one ulp"


# id, lens, kv heads, group, head_dim, rotary_dim, splits, window, norm, fp8 KV
CASES = [
    ("bs1-3splits-norm", [77], 2, 4, 32, 32, 3, -1, True, None),
    ("bs3-1split", [1, 40, 33], 2, 2, 32, 32, 1, -1, False, None),
    ("bs2-8splits-partial-rotary", [64, 9], 1, 3, 64, 32, 8, -1, True, None),
    ("bs3-window", [90, 31, 2], 2, 2, 32, 16, 4, 20, True, None),
    ("bs2-fp8", [50, 17], 2, 2, 32, 32, 2, -1, True, torch.float8_e4m3fn),
]


@pytest.mark.parametrize("merge", [True, False], ids=["merged-inside", "merge-kernel"])
@pytest.mark.parametrize("lens,kv_heads,group,head_dim,rotary_dim,splits,window,norm,kv",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_launch_equals_the_three_it_replaces(lens: list[int], kv_heads: int, group: int, head_dim: int,
                                                 rotary_dim: int, splits: int, window: int, norm: bool,
                                                 kv: torch.dtype | None, merge: bool) -> None:
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    step = _Step(lens, kv_heads, group, head_dim, rotary_dim, dtype, norm, kv)
    ref, ref_pool = step.three_launches(splits, window)
    out, pool, tickets = step.one_launch(splits, window, merge=merge)
    assert_pool_equal(pool, ref_pool, "pool")
    assert_close(out, ref, dtype, "output")
    assert not tickets.any(), "the split tickets were not put back to 0"
    again, _, _ = step.one_launch(splits, window, merge=merge)
    assert torch.equal(again, out)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cpu" or not has_pdl(torch.device("cuda")), reason="PDL needs an sm_90+ GPU")
@pytest.mark.parametrize("splits", [1, 4, 16])
def test_pdl_launches_and_graph_replays_equal_the_plain_launch(splits: int) -> None:
    """Qwen3-30B-A3B's heads (32 q, 4 KV, 128) in bf16; lengths put the newest key first in a
    block, last in one, and deep in a long row."""
    step = _Step([1, 64, 65, 1000, 129], 4, 8, 128, 128, torch.bfloat16, True)
    plain, plain_pool, _ = step.one_launch(splits, -1)
    ref, _ = step.three_launches(splits, -1)
    assert_close(plain, ref, torch.bfloat16, "against the three launches")
    out, pool, _ = step.one_launch(splits, -1, pdl=True)
    assert torch.equal(out, plain) and all(torch.equal(a, b) for a, b in zip(pool, plain_pool))
    work = step.workspaces(splits)
    pool_g = step._fresh_pool()
    out_g = torch.empty_like(plain)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.one_launch(splits, -1, pdl=True, pool=pool_g, work=work, out=out_g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.one_launch(splits, -1, pdl=True, pool=pool_g, work=work, out=out_g, check=False)
    for _ in range(3):
        out_g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_g, plain), "graph replay differs"
    assert not work[2].any()
