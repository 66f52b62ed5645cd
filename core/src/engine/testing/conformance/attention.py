"""``AttentionBackendConformance``: a backend against a float64 reference on random paged batches."""

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
    MAX_PREFIX,
    draw_rows,
    place_rows,
)
from engine.testing.conformance._common import (
    KIT_SEED,
    derive_seed,
    device_or_skip,
    generator,
    randn,
)
from engine.testing.conformance.attention_mla import MLACases


class AttentionBackendConformance(MLACases):
    """Set ``backend_name``; optionally ``device``, ``dtypes``, ``page_sizes``, ``atol``, shapes.

    The backend must declare the kit's device in ``AttentionBackendSpec.device_types`` (default
    ``("cuda",)``) and accept the kit's page sizes: the engine would refuse it otherwise. A backend
    whose spec lists ``fp8_e4m3``/``fp8_e5m2`` in ``kv_cache_dtypes`` must pass the fp8-KV cases
    (the reference attends over the pool's dequantized values, so the tolerance is the dtype's).
    A backend whose spec lists ``"mla"`` in ``kv_layouts`` must pass the MLA cases too
    (``engine.testing.conformance.attention_mla``: weight-absorbed latent attention over an
    ``MLATokenToKVPool``, fp8 included when declared).
    Every batch is drawn from a seed derived from ``seed`` and the test's parameters; a
    failure message names that seed.
    """

    backend_name: ClassVar[str] = ""
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    page_sizes: ClassVar[tuple[int, ...]] = (1, 4)
    atol: ClassVar[dict[torch.dtype, float]] = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
    num_heads: ClassVar[int] = 4
    num_kv_heads: ClassVar[int] = 2
    head_dim: ClassVar[int] = 32
    #: base of every test's seed; change it to draw other batches.
    seed: ClassVar[int] = KIT_SEED

    def _spec(self) -> Any:
        return plugins.get_attention_backend(self.backend_name)

    def _require_selectable(self, device: torch.device, page_size: int) -> None:
        from engine.attention import check_backend_selectable
        from engine.errors import ConfigError

        spec = self._spec()
        try:
            check_backend_selectable(spec, device.type, page_size)
        except ConfigError as exc:
            default = " (the default when a spec names none)" if spec.device_types == ("cuda",) else ""
            pytest.fail(
                f"the kit runs attention backend '{spec.name}' on {device.type} with page size {page_size}, "
                f"but the engine would refuse that configuration: {exc}. Its AttentionBackendSpec declares "
                f"device_types={spec.device_types!r}{default} and page_sizes={spec.page_sizes!r}: declare what "
                f"the backend runs on, or set the kit's `device` / `page_sizes` to match.", pytrace=False)

    def _setup(self, dtype: torch.dtype, page_size: int, gen: torch.Generator,
               kv_cache_dtype: str = "auto") -> tuple[Any, Any, Any, Any]:
        from engine.attention import AttentionContext
        from engine.mem_cache.memory_pool import (
            MHATokenToKVPool,
            ReqToTokenPool,
            TokenToKVPoolAllocator,
            resolve_kv_cache_dtype,
        )

        device = device_or_skip(self.device)
        self._require_selectable(device, page_size)
        pool_tokens = 4096
        r2t = ReqToTokenPool(16, 1024, device)
        kv = MHATokenToKVPool(pool_tokens, page_size, resolve_kv_cache_dtype(kv_cache_dtype, dtype),
                              self.num_kv_heads, self.head_dim, 1, device)
        alloc = TokenToKVPoolAllocator(pool_tokens, page_size, device)
        # Shuffle free pages so rows are scattered through the pool.
        order = torch.randperm(len(alloc.free_pages), generator=gen).to(alloc.free_pages.device)
        alloc.free_pages = alloc.free_pages[order]
        ctx = AttentionContext(device=device, dtype=dtype, num_layers=1, num_heads=self.num_heads,
                               num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, page_size=page_size,
                               max_context_len=1024, req_to_token_pool=r2t, token_to_kv_pool=kv,
                               options=plugins.declared_options("attention", self.backend_name))
        return resolve_factory(self._spec().factory)(ctx), r2t, kv, alloc

    def _fill_rows(self, r2t: Any, kv: Any, alloc: Any, gen: torch.Generator, prefix: list[int], ext: list[int],
                   dtype: torch.dtype, layer: Any) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
        """A batch's rows in the pools: each row's prefix allocated and filled with random K/V
        (through the pool's own write, so an fp8 pool holds x / scale as the engine stores it),
        then its new tokens allocated; returns the request slots, the new tokens' KV slots and
        random q, k, v for the new tokens."""
        bs, device = len(prefix), kv.device
        Hkv, D = self.num_kv_heads, self.head_dim
        slots = r2t.alloc(bs)
        pre_loc = alloc.alloc_extend([0] * bs, prefix, [-1] * bs)
        new_loc = place_rows(r2t, alloc, slots, prefix, ext, pre_loc)
        kv.set_kv_buffer(0, pre_loc, randn(gen, len(pre_loc), Hkv, D, device=device, dtype=dtype),
                         randn(gen, len(pre_loc), Hkv, D, device=device, dtype=dtype), layer.k_scale, layer.v_scale)
        n = sum(ext)
        q = randn(gen, n, self.num_heads * D, device=device, dtype=dtype)
        k = randn(gen, n, Hkv * D, device=device, dtype=dtype)
        v = randn(gen, n, Hkv * D, device=device, dtype=dtype)
        return slots, new_loc, q, k, v

    def _run(self, mode: str, dtype: torch.dtype, page_size: int, window: int = -1, cap: float = 0.0,
             kv_cache_dtype: str = "auto", kv_in_pool: bool = False) -> None:
        from engine.layers.radix_attention import RadixAttention
        from engine.model_executor.forward_batch import ForwardBatch, ForwardMode
        from engine.testing.reference import reference_attention

        parts: tuple[object, ...] = (mode, dtype, page_size, window, cap)
        if kv_cache_dtype != "auto":  # the other cases keep the seeds they had
            parts += (kv_cache_dtype,)
        if kv_in_pool:
            parts += ("kv_in_pool",)
        seed = derive_seed(self.seed, self.backend_name, *parts)
        where = f"{mode}, {dtype}, page {page_size}, window {window}, cap {cap}, KV {kv_cache_dtype}, seed {seed}"
        gen = generator(seed)
        backend, r2t, kv, alloc = self._setup(dtype, page_size, gen, kv_cache_dtype)
        fp8 = kv.is_fp8
        layer = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, 0,
                               logit_cap=cap, sliding_window_size=window)
        if fp8:
            layer.k_scale, layer.v_scale = FP8_K_SCALE, FP8_V_SCALE
        if mode == "mixed" and not backend.supports_mixed:
            pytest.skip(f"{type(backend).__name__}.supports_mixed is False: the scheduler never sends it MIXED batches")
        device = kv.device
        rows = draw_rows(random.Random(seed), mode)
        prefix, ext, bs = rows.prefix, rows.extend, len(rows.prefix)
        seq = [p + e for p, e in zip(prefix, ext, strict=True)]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        slots, new_loc, q, k, v = self._fill_rows(r2t, kv, alloc, gen, prefix, ext, dtype, layer)
        n = sum(ext)
        if fp8:
            k[0, 0], v[-1, -1] = FP8_OUTLIER, -FP8_OUTLIER
        fmode = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND, "mixed": ForwardMode.MIXED}[mode]
        fb = ForwardBatch.build(fmode, [0] * n, slots, seq, prefix, new_loc, device,
                                num_extend_reqs=rows.num_extend_reqs)
        fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = r2t, kv, backend
        backend.init_forward_metadata(fb)
        out = _attend(backend, kv, layer, fb, q, k, v, kv_in_pool)
        assert out.shape == (n, H * D), f"output shape {tuple(out.shape)} != {(n, H * D)} ({where})"
        assert torch.isfinite(out).all(), f"non-finite output ({where})"
        if fp8:
            _check_fp8_store(kv, new_loc, k.view(n, Hkv, D), v.view(n, Hkv, D), where)
        off = 0
        for i in range(bs):
            kv_rows = r2t.req_to_token[slots[i], : seq[i]].long()
            # The pool's values as every reader must see them: stored * scale (scales are 1.0
            # unless the pool is fp8).
            ref = reference_attention(
                q[off : off + ext[i]].view(-1, H, D), kv.k_buffer[0][kv_rows].double() * layer.k_scale,
                kv.v_buffer[0][kv_rows].double() * layer.v_scale,
                torch.arange(prefix[i], seq[i], device=device), D**-0.5, window, cap)
            got = out[off : off + ext[i]].view(-1, H, D).double()
            err = (got - ref).abs().max().item()
            kind = "extend" if i < rows.num_extend_reqs else "decode"
            # 16-bit outputs round relative to their size: a row that attends to the saturated
            # outlier (e5m2 saturates at 57344 x scale, about 1e3) is held to atol relative to its
            # largest value (measured on an H100: up to 0.18 absolute on such rows, triton and
            # flashinfer alike); every other row keeps the absolute bar.
            bar = self.atol[dtype] * (max(1.0, ref.abs().max().item()) if fp8 else 1.0)
            assert err <= bar, (
                f"row {i} ({kind}, prefix {prefix[i]}, {ext[i]} new): max abs error {err} > {bar} "
                f"({where})")
            off += ext[i]

    def test_declares_the_kit_device_and_page_sizes(self) -> None:
        """What the kit runs is what the engine would select: the spec names the device and pages."""
        device = device_or_skip(self.device)
        for page_size in self.page_sizes:
            self._require_selectable(device, page_size)

    @pytest.mark.parametrize("mode", ["extend", "decode"])
    def test_matches_reference(self, mode: str) -> None:
        for dtype in self.dtypes:
            for page_size in self.page_sizes:
                self._run(mode, dtype, page_size)

    def test_mixed_batch_matches_reference(self) -> None:
        """Extend rows then decode rows in one batch (``--enable-mixed-chunk``)."""
        for dtype in self.dtypes:
            for page_size in self.page_sizes:
                self._run("mixed", dtype, page_size)

    @pytest.mark.parametrize("mode", ["extend", "decode", "mixed", "tree"])
    def test_reads_new_kv_from_the_pool(self, mode: str) -> None:
        """``k = v = None`` with ``save_kv_cache=False``: the new tokens' K/V were stored already
        (a platform's fused attention prologue does that, in every mode, tree verification
        included) and are read there."""
        if mode == "tree":
            self._run_tree(self.dtypes[0], self.page_sizes[0], kv_in_pool=True)
        else:
            self._run(mode, self.dtypes[0], self.page_sizes[0], kv_in_pool=True)

    @pytest.mark.parametrize("mode", ["extend", "decode", "mixed"])
    def test_sliding_window_and_logit_cap(self, mode: str) -> None:
        self._run(mode, self.dtypes[0], self.page_sizes[0], window=16, cap=30.0)

    def test_tree_mask_matches_reference(self) -> None:
        """Speculative tree verification (``supports_tree_mask``): EXTEND rows whose new tokens
        form random trees (plus a chain row and a one-token row) attend to the whole prefix and
        to their ancestors and themselves, at positions ``prefix + depth``; the reference builds
        the mask densely from the parent links."""
        for page_size in self.page_sizes:
            self._run_tree(self.dtypes[0], page_size)

    def _run_tree(self, dtype: torch.dtype, page_size: int, kv_in_pool: bool = False) -> None:
        from engine.layers.radix_attention import RadixAttention
        from engine.model_executor.forward_batch import ForwardBatch, ForwardMode
        from engine.speculative.tree import depths, tree_mask_of_rows

        seed = derive_seed(self.seed, self.backend_name, "tree", dtype, page_size,
                           *(("kv_in_pool",) if kv_in_pool else ()))
        gen = generator(seed)
        backend, r2t, kv, alloc = self._setup(dtype, page_size, gen)
        if not backend.supports_tree_mask:
            pytest.skip(f"{type(backend).__name__}.supports_tree_mask is False: the speculator verifies "
                        "chains only on it")
        rng = random.Random(seed)
        layer = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, 0)
        device = kv.device
        parents = [[-1] + [rng.randrange(j) for j in range(1, rng.randint(2, 40))] for _ in range(rng.randint(2, 4))]
        parents += [list(range(-1, 9)), [-1]]
        bs = len(parents)
        prefix = [rng.randint(0, MAX_PREFIX) for _ in range(bs)]
        ext = [len(p) for p in parents]
        seq = [p + e for p, e in zip(prefix, ext, strict=True)]
        H, D = self.num_heads, self.head_dim
        slots, new_loc, q, k, v = self._fill_rows(r2t, kv, alloc, gen, prefix, ext, dtype, layer)
        n = sum(ext)
        fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * n, slots, seq, prefix, new_loc, device)
        fb.positions = torch.tensor([p + d for p, par in zip(prefix, parents, strict=True) for d in depths(par)],
                                    dtype=torch.int64, device=device)
        fb.tree_mask, fb.tree_mask_indptr = tree_mask_of_rows(parents, device)
        fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = r2t, kv, backend
        backend.init_forward_metadata(fb)
        out = _attend(backend, kv, layer, fb, q, k, v, kv_in_pool)
        where = f"tree, {dtype}, page {page_size}, seed {seed}"
        assert torch.isfinite(out).all(), f"non-finite output ({where})"
        off = 0
        for i in range(bs):
            kv_rows = r2t.req_to_token[slots[i], : seq[i]].long()
            tree = torch.tensor([[_is_ancestor_or_self(parents[i], a, b) for b in range(ext[i])]
                                 for a in range(ext[i])], dtype=torch.bool, device=device)
            mask = torch.cat([torch.ones(ext[i], prefix[i], dtype=torch.bool, device=device), tree], dim=1)
            ref = _reference_masked(q[off : off + ext[i]].view(-1, H, D), kv.k_buffer[0][kv_rows],
                                    kv.v_buffer[0][kv_rows], mask, D**-0.5)
            err = (out[off : off + ext[i]].view(-1, H, D).double() - ref).abs().max().item()
            assert err <= self.atol[dtype], (
                f"tree row {i} (prefix {prefix[i]}, parents {parents[i]}): max abs error {err} ({where})")
            off += ext[i]

    @pytest.mark.parametrize("mode", ["extend", "decode", "mixed"])
    def test_fp8_kv_cache_matches_reference(self, mode: str) -> None:
        """``--kv-cache-dtype fp8_*``: writes store x / scale saturated, reads give stored * scale."""
        kinds = [d for d in self._spec().kv_cache_dtypes if d.startswith("fp8")]
        if not kinds:
            pytest.skip(f"attention backend '{self.backend_name}' declares no fp8 KV cache "
                        f"(AttentionBackendSpec.kv_cache_dtypes={self._spec().kv_cache_dtypes!r})")
        for kind in kinds:
            for page_size in self.page_sizes:
                self._run(mode, self.dtypes[0], page_size, kv_cache_dtype=kind)
        self._run(mode, self.dtypes[0], self.page_sizes[0], window=16, cap=30.0, kv_cache_dtype=kinds[0])


def _is_ancestor_or_self(parents: list[int], i: int, j: int) -> bool:
    """The dense reference of the tree mask: walk i's parent links up to the root."""
    while i >= 0:
        if i == j:
            return True
        i = parents[i]
    return False


def _reference_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Attention of one row in float64 under an explicit ``[Lq, Lk]`` bool mask."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vd)


def _attend(backend: Any, kv: Any, layer: Any, fb: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv_in_pool: bool) -> torch.Tensor:
    """``backend.forward`` on the new tokens' q/k/v; with ``kv_in_pool`` as after a platform's fused
    prologue: K/V stored at ``out_cache_loc`` first, and the backend given none of them."""
    if not kv_in_pool:
        return backend.forward(q, k, v, layer, fb)
    n = q.shape[0]
    kv.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k.view(n, layer.num_kv_heads, layer.head_dim),
                     v.view(n, layer.num_kv_heads, layer.head_dim), layer.k_scale, layer.v_scale)
    return backend.forward(q, None, None, layer, fb, save_kv_cache=False)


def _check_fp8_store(kv: Any, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: str) -> None:
    """The new tokens' K/V in an fp8 pool are ``x / scale``, saturated and rounded to the format."""
    finfo = torch.finfo(kv.dtype)
    # Half an ulp relative (3 mantissa bits for e4m3, 2 for e5m2); near zero, half the subnormal step.
    mantissa = 3 if kv.dtype == torch.float8_e4m3fn else 2
    rel, tiny = 2.0 ** -(mantissa + 1), finfo.smallest_normal * 2.0 ** -(mantissa + 1)
    for name, stored, x, scale in (("K", kv.k_buffer[0][loc], k, FP8_K_SCALE),
                                   ("V", kv.v_buffer[0][loc], v, FP8_V_SCALE)):
        want = (x.double() / scale).clamp(-finfo.max, finfo.max)
        got = stored.double()
        assert torch.isfinite(got).all(), f"{name}: non-finite values stored in the fp8 pool ({where})"
        excess = (got - want).abs() - (rel * want.abs() + tiny)
        assert bool((excess <= 0).all()), (
            f"{name}: the fp8 pool holds values off x / {name.lower()}_scale (saturated) by "
            f"{excess.max().item():.3g} beyond the format's rounding ({where})")
