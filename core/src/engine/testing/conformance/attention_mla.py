"""The attention kit's MLA cases: a backend whose spec lists "mla" in ``kv_layouts`` against a
float64 reference of weight-absorbed multi-head latent attention.

The pool is an ``MLATokenToKVPool``: one row per token, ``[c_kv || k_pe]`` of
``mla_kv_lora_rank + mla_rope_dim`` values, read as the key of every query head; V is the row's
leading ``mla_kv_lora_rank`` values (the same storage). The layer is what DeepSeek's builds:
``RadixAttention(H, rank + rope, scaling, 1, ..., v_head_dim=rank, kv_layout="mla")`` with a
scaling that is not ``head_dim ** -0.5`` (DeepSeek's is ``(qk_nope + qk_rope) ** -0.5``), and is
called as the model calls it: ``k`` the new rows ``[T, rank + rope]``, ``v`` the view of their
leading dims. An fp8 pool stores ``row / k_scale``; V is read with ``k_scale`` too (the layer's
``v_scale`` is set to another value, which a backend must not use).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest
import torch

from engine import plugins
from engine.hookspecs import resolve_factory
from engine.testing.conformance._attention_rows import (
    FP8_K_SCALE,
    FP8_OUTLIER,
    FP8_V_SCALE,
    draw_rows,
    place_rows,
)
from engine.testing.conformance._common import derive_seed, device_or_skip, generator, randn


class MLACases:
    """Mixed into ``AttentionBackendConformance``: skipped unless the backend reads "mla"."""

    backend_name: ClassVar[str]
    device: ClassVar[str]
    dtypes: ClassVar[tuple[torch.dtype, ...]]
    page_sizes: ClassVar[tuple[int, ...]]
    atol: ClassVar[dict[torch.dtype, float]]
    num_heads: ClassVar[int]
    seed: ClassVar[int]
    #: the MLA cases' latent width and rope width (48 in all: not a power of two).
    mla_kv_lora_rank: ClassVar[int] = 32
    mla_rope_dim: ClassVar[int] = 16
    #: DeepSeek's softmax scale for a 24-dim q_nope plus the rope dims.
    mla_scaling: ClassVar[float] = (24 + 16) ** -0.5

    def _spec(self) -> Any: ...  # provided by AttentionBackendConformance

    def _require_selectable(self, device: torch.device, page_size: int) -> None: ...

    def _mla_skip_unless_declared(self) -> None:
        layouts = getattr(self._spec(), "kv_layouts", ("mha",))
        if "mla" not in layouts:
            pytest.skip(f"attention backend '{self.backend_name}' does not read the 'mla' KV layout "
                        f"(AttentionBackendSpec.kv_layouts={layouts!r})")

    @pytest.mark.parametrize("mode", ["extend", "decode", "mixed"])
    def test_mla_matches_reference(self, mode: str) -> None:
        """Absorbed MLA: qk dim rank + rope, V the rows' leading rank dims, one KV head, the
        layer's scaling; extend rows with prefix-cache hits, decode rows, MIXED batches."""
        self._mla_skip_unless_declared()
        for dtype in self.dtypes:
            for page_size in self.page_sizes:
                self._run_mla(mode, dtype, page_size)

    @pytest.mark.parametrize("mode", ["extend", "decode"])
    def test_mla_fp8_kv_cache_matches_reference(self, mode: str) -> None:
        """An fp8 MLA pool: rows stored as ``row / k_scale``; K and V both read with ``k_scale``."""
        self._mla_skip_unless_declared()
        kinds = [d for d in self._spec().kv_cache_dtypes if d.startswith("fp8")]
        if not kinds:
            pytest.skip(f"attention backend '{self.backend_name}' declares no fp8 KV cache")
        # One format a mode (the last page size): the interpreted kernels are slow, and the
        # formats differ in the cast only, which the MHA fp8 cases check in every mode.
        kind = kinds[0] if mode == "extend" else kinds[-1]
        self._run_mla(mode, self.dtypes[0], self.page_sizes[-1], kv_cache_dtype=kind)

    def _run_mla(self, mode: str, dtype: torch.dtype, page_size: int, kv_cache_dtype: str = "auto") -> None:
        from engine.attention import AttentionContext
        from engine.layers.radix_attention import RadixAttention
        from engine.mem_cache.memory_pool import (
            MLATokenToKVPool,
            ReqToTokenPool,
            TokenToKVPoolAllocator,
            resolve_kv_cache_dtype,
        )
        from engine.model_executor.forward_batch import ForwardBatch, ForwardMode
        from engine.testing.reference import reference_attention

        seed = derive_seed(self.seed, self.backend_name, "mla", mode, dtype, page_size, kv_cache_dtype)
        where = f"MLA {mode}, {dtype}, page {page_size}, KV {kv_cache_dtype}, seed {seed}"
        gen = generator(seed)
        device = device_or_skip(self.device)
        self._require_selectable(device, page_size)
        rank, H = self.mla_kv_lora_rank, self.num_heads
        D = rank + self.mla_rope_dim
        r2t = ReqToTokenPool(16, 1024, device)
        kv = MLATokenToKVPool(4096, page_size, resolve_kv_cache_dtype(kv_cache_dtype, dtype), rank,
                              self.mla_rope_dim, 1, device)
        alloc = TokenToKVPoolAllocator(4096, page_size, device)
        order = torch.randperm(len(alloc.free_pages), generator=gen).to(alloc.free_pages.device)
        alloc.free_pages = alloc.free_pages[order]  # rows scattered through the pool
        ctx = AttentionContext(device=device, dtype=dtype, num_layers=1, num_heads=H, num_kv_heads=1, head_dim=D,
                               page_size=page_size, max_context_len=1024, req_to_token_pool=r2t,
                               token_to_kv_pool=kv, options=plugins.declared_options("attention", self.backend_name))
        backend = resolve_factory(self._spec().factory)(ctx)
        if mode == "mixed" and not backend.supports_mixed:
            pytest.skip(f"{type(backend).__name__}.supports_mixed is False: the scheduler never sends it MIXED batches")
        layer = RadixAttention(H, D, self.mla_scaling, 1, 0, v_head_dim=rank, kv_layout="mla")
        if kv.is_fp8:
            layer.k_scale, layer.v_scale = FP8_K_SCALE, FP8_V_SCALE
        rows = draw_rows(random.Random(seed), mode)
        if mode != "decode":
            rows.prefix[0] = max(rows.prefix[0], 17)  # at least one prefix-cache hit among the extend rows
        prefix, ext, bs = rows.prefix, rows.extend, len(rows.prefix)
        seq = [p + e for p, e in zip(prefix, ext, strict=True)]
        slots = r2t.alloc(bs)
        pre_loc = alloc.alloc_extend([0] * bs, prefix, [-1] * bs)
        new_loc = place_rows(r2t, alloc, slots, prefix, ext, pre_loc)
        kv.set_kv_buffer(0, pre_loc, randn(gen, len(pre_loc), 1, D, device=device, dtype=dtype), None,
                         layer.k_scale, layer.v_scale)
        n = sum(ext)
        q = randn(gen, n, H * D, device=device, dtype=dtype)
        k = randn(gen, n, D, device=device, dtype=dtype)
        if kv.is_fp8:
            k[0, 0] = FP8_OUTLIER  # a latent value past the format's range: the write must saturate
        v = k.view(n, 1, D)[..., :rank]  # as DeepSeek's layer passes it: a view, not a copy
        fmode = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND, "mixed": ForwardMode.MIXED}[mode]
        fb = ForwardBatch.build(fmode, [0] * n, slots, seq, prefix, new_loc, device,
                                num_extend_reqs=rows.num_extend_reqs)
        fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = r2t, kv, backend
        backend.init_forward_metadata(fb)
        out = backend.forward(q, k, v, layer, fb)
        assert out.numel() == n * H * rank, f"output shape {tuple(out.shape)}: expected {(n, H * rank)} ({where})"
        out = out.reshape(n, H, rank)
        assert torch.isfinite(out).all(), f"non-finite output ({where})"
        off = 0
        for i in range(bs):
            kv_rows = kv.k_buffer[0][r2t.req_to_token[slots[i], : seq[i]].long()].double() * layer.k_scale
            ref = reference_attention(q[off : off + ext[i]].view(-1, H, D), kv_rows, kv_rows[..., :rank],
                                      torch.arange(prefix[i], seq[i], device=device), self.mla_scaling)
            err = (out[off : off + ext[i]].double() - ref).abs().max().item()
            kind = "extend" if i < rows.num_extend_reqs else "decode"
            bar = self.atol[dtype] * (max(1.0, ref.abs().max().item()) if kv.is_fp8 else 1.0)
            assert err <= bar, (f"row {i} ({kind}, prefix {prefix[i]}, {ext[i]} new): max abs error {err} > {bar} "
                                f"({where})")
            off += ext[i]

