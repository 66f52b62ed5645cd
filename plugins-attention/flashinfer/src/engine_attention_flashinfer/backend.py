"""``FlashInferAttnBackend``: FlashInfer's paged kernels behind the attention-backend contract.

Per batch, ``init_forward_metadata`` gathers the rows' page ids from ``req_to_token``
(one device gather, no host loop) into a ``PagedKVLayout``. Each layer then saves its
new K/V into the pool and attends over the pool through a planned wrapper:

- EXTEND/MIXED: ``BatchPrefillWithPagedKVCacheWrapper``, causal, queries aligned to the
  end of each row (cached prefix and new tokens are both read from the pool);
- DECODE: ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores from GQA group 4).

FlashInfer fixes the softmax scale, sliding window and logit cap at ``plan()`` time,
so wrappers are keyed by ``LayerKey``; a wrapper is planned the first time a layer
with its key runs in the batch, i.e. once per batch for a uniform model.

CUDA graphs capture decode only: one wrapper per (batch size, key) built over static
index buffers; the capture hook plans it, the replay hook re-plans it in place.

FP8 KV cache: the wrappers are planned with ``kv_data_type`` = the pool's float8 dtype and q in
the activation dtype; ``run()`` gets the layer's ``k_scale``/``v_scale`` (FlashInfer folds
``k_scale`` into the softmax scale and multiplies the output by ``v_scale``). Scales of 1.0 are
not passed, so a pool without checkpoint scales costs no extra multiply.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.attention import AttentionBackend, AttentionContext, AttentionLayerInfo
from engine_attention_flashinfer.options import parse_options
from engine_attention_flashinfer.planning import (
    LayerKey,
    PagedKVLayout,
    build_paged_kv_layout,
    check_dtype,
    check_head_dim,
    padding_layout,
    pages_per_row,
    qo_indptr,
    tree_custom_mask,
)
from engine_attention_flashinfer.wrappers import GraphBuffers, WrapperFactory

if TYPE_CHECKING:
    from engine.model_executor.forward_batch import ForwardBatch



@dataclass
class BatchPlan:
    """What the layers of one batch read (``forward_batch.attn_metadata``)."""

    is_decode: bool
    layout: PagedKVLayout
    # EXTEND/MIXED: [bs + 1] host offsets of each row's new tokens.
    qo_indptr_cpu: torch.Tensor | None
    # The wrappers this batch draws from (eager ones, or one batch size's graph ones).
    wrappers: dict[LayerKey, Any]
    # Decode graphs: the batch size whose static buffers new wrappers must use.
    graph_bs: int | None = None
    # Keys already planned for this batch.
    planned: set[LayerKey] = field(default_factory=set)
    # Tree batches (speculative verification): FlashInfer's custom mask over each row's new
    # tokens x whole sequence (``planning.tree_custom_mask``); None: causal.
    custom_mask: torch.Tensor | None = None


class FlashInferAttnBackend(AttentionBackend):
    """FlashInfer paged prefill and decode over the engine's KV pool."""

    supports_mixed = True
    supports_cuda_graph = True
    # Tree masks go to the prefill wrapper's ``plan(custom_mask=...)``. Not yet run on a GPU:
    # docs/speculative_internals.md, "Trees".
    supports_tree_mask = True

    def __init__(self, ctx: AttentionContext) -> None:
        options = parse_options(ctx.options)
        check_head_dim(ctx.head_dim)
        check_dtype(ctx.dtype)
        self.device = torch.device(ctx.device)
        if self.device.type != "cuda":
            raise ValueError(f"attention backend 'flashinfer' needs a CUDA device; got {self.device}")
        pool = ctx.token_to_kv_pool
        if pool.v_head_dim != ctx.head_dim:
            raise ValueError(
                f"attention backend 'flashinfer': value head dim {pool.v_head_dim} differs from "
                f"key head dim {ctx.head_dim}; accepted: equal head dims (use --attention triton)"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = ctx.num_heads, ctx.num_kv_heads, ctx.head_dim
        self.page_size = ctx.page_size
        self.max_context_len = ctx.max_context_len
        self.req_to_token = ctx.req_to_token_pool.req_to_token
        self.token_to_kv_pool = pool
        self.factory = WrapperFactory(
            self.device, options["workspace_mb"] << 20, ctx.num_heads, ctx.num_kv_heads,
            ctx.head_dim, ctx.page_size, ctx.dtype, pool.dtype,
        )
        self.q_dtype = ctx.dtype
        self.kv_fp8 = pool.is_fp8
        self._prefill_wrappers: dict[LayerKey, Any] = {}
        self._decode_wrappers: dict[LayerKey, Any] = {}
        # Every key seen so far: capture plans them all before the graph records.
        self._known_keys: set[LayerKey] = set()
        self._graph_buffers: GraphBuffers | None = None
        self._graph_wrappers: dict[int, dict[LayerKey, Any]] = {}
        self.forward_metadata: BatchPlan | None = None

    # -- per-batch planning -------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Gathers the batch's page ids; wrappers are planned as their layers arrive."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
        else:
            layout = build_paged_kv_layout(
                self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                forward_batch.seq_lens_cpu, self.page_size)
            if mode.is_decode():
                self.forward_metadata = BatchPlan(True, layout, None, self._decode_wrappers)
            else:
                lens = forward_batch.extend_seq_lens_cpu
                if lens is None:
                    raise ValueError("flashinfer attention: an EXTEND/MIXED batch needs extend_seq_lens_cpu")
                self.forward_metadata = BatchPlan(False, layout, qo_indptr(lens), self._prefill_wrappers)
                if forward_batch.tree_mask is not None:
                    assert forward_batch.extend_prefix_lens_cpu is not None
                    self.forward_metadata.custom_mask = tree_custom_mask(
                        forward_batch.tree_mask, lens, forward_batch.extend_prefix_lens_cpu)
        forward_batch.attn_metadata = self.forward_metadata

    def _wrapper(self, layer: AttentionLayerInfo) -> Any:
        """The batch's wrapper for this layer's key, planned on first use in the batch."""
        plan = self.forward_metadata
        if plan is None:
            raise RuntimeError("flashinfer attention: forward before init_forward_metadata")
        key = LayerKey.of(layer)
        if key in plan.planned:
            return plan.wrappers[key]
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"flashinfer attention: layer {layer.layer_id} has settings {key} that were not "
                "planned before CUDA-graph capture; call warmup(layers) or run one eager step first")
        self._known_keys.add(key)
        self._plan(plan, key)
        return plan.wrappers[key]

    def _plan(self, plan: BatchPlan, key: LayerKey) -> None:
        wrapper = plan.wrappers.get(key)
        if plan.is_decode:
            if wrapper is None:
                wrapper = self.factory.decode(plan.graph_bs, self._graph_buffers)
            self.factory.plan_decode(wrapper, plan.layout, key)
        else:
            if wrapper is None:
                wrapper = self.factory.prefill()
            assert plan.qo_indptr_cpu is not None
            self.factory.plan_prefill(wrapper, plan.qo_indptr_cpu, plan.layout, key, plan.custom_mask)
        plan.wrappers[key] = wrapper
        plan.planned.add(key)

    # -- forward ----------------------------------------------------------------------
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                       layer: AttentionLayerInfo, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        """Saves the new K/V, then prefill attention over the pool (MIXED decode rows included)."""
        if save_kv_cache and k is not None:
            self.save_kv(layer, forward_batch, k, v)
        return self._attend(q, layer)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                       layer: AttentionLayerInfo, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        """Saves the new token's K/V, then decode attention over the pool."""
        if save_kv_cache and k is not None:
            self.save_kv(layer, forward_batch, k, v)
        return self._attend(q, layer)

    def _attend(self, q: torch.Tensor, layer: AttentionLayerInfo) -> torch.Tensor:
        wrapper = self._wrapper(layer)
        q3 = q.reshape(-1, layer.num_heads, layer.head_dim)  # a view unless q is strided oddly
        if q3.dtype != self.q_dtype:
            q3 = q3.to(self.q_dtype)  # the kernels were planned (and compiled) for this dtype
        out = wrapper.run(q3, self._kv_pages(layer.layer_id), **self._kv_scales(layer))
        return out.view(-1, layer.num_heads * layer.head_dim).to(q.dtype)

    def _kv_scales(self, layer: AttentionLayerInfo) -> dict[str, float]:
        """``run()``'s ``k_scale``/``v_scale`` for an fp8 pool (left out when 1.0 or unused)."""
        if not self.kv_fp8:
            return {}
        scales = {"k_scale": float(layer.k_scale), "v_scale": float(layer.v_scale)}
        return {name: value for name, value in scales.items() if value != 1.0}

    def _kv_pages(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V pool as ``[num_pages, page_size, num_kv_heads, head_dim]`` views."""
        k_buf, v_buf = self.token_to_kv_pool.get_kv_buffer(layer_id)
        rows = k_buf.shape[0] // self.page_size * self.page_size
        shape = (rows // self.page_size, self.page_size, self.num_kv_heads, self.head_dim)
        return k_buf[:rows].view(shape), v_buf[:rows].view(shape)

    # -- start-up -----------------------------------------------------------------------
    # no_grad, not inference_mode: wrappers built here keep buffers that later plans
    # update in place, which inference tensors forbid outside inference mode.
    @torch.no_grad()
    def warmup(self, layers: Iterable[AttentionLayerInfo] | None = None) -> None:
        """Compiles (JIT) and loads the kernels before serving: a tiny extend and decode per key.

        FlashInfer builds its kernels on first use (about 10 s for decode and a minute or
        more for prefill per dtype/window/cap combination, cached under ~/.cache/flashinfer
        afterwards). Pass the model's attention layers so every key they use is built and
        remembered for CUDA-graph capture; without them the default key (no window, no cap,
        scale ``head_dim ** -0.5``) is warmed. Writes nothing to the KV pool.
        """
        infos = list(layers) if layers is not None else [AttentionLayerInfo(
            0, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)]
        seq_len = 2
        layout = padding_layout(seq_len, self.page_size, self.device)
        q = torch.randn(seq_len, self.num_heads * self.head_dim, device=self.device).to(self.q_dtype)
        saved = self.forward_metadata
        try:
            for info in infos:
                self.forward_metadata = BatchPlan(False, layout, qo_indptr([seq_len]), self._prefill_wrappers)
                self._attend(q, info)
                self.forward_metadata = BatchPlan(True, layout, None, self._decode_wrappers)
                self._attend(q[:1], info)
        finally:
            self.forward_metadata = saved
        torch.cuda.synchronize(self.device)

    # -- CUDA graphs (decode) -------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocates the static index buffers every captured decode graph reads."""
        max_pages = max_bs * pages_per_row([self.max_context_len], self.page_size)[0]
        self._graph_buffers = GraphBuffers(
            kv_indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            kv_indices=torch.zeros(max_pages, dtype=torch.int32, device=self.device),
            kv_last_page_len=torch.ones(max_bs, dtype=torch.int32, device=self.device),
        )

    def _graph_plan(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    seq_lens_cpu: list[int]) -> BatchPlan:
        if self._graph_buffers is None:
            raise RuntimeError("flashinfer attention: init_cuda_graph_state was not called")
        max_bs = self._graph_buffers.kv_last_page_len.shape[0]
        if bs > max_bs:
            raise ValueError(f"flashinfer attention: graph batch size {bs} exceeds max_bs={max_bs}")
        layout = build_paged_kv_layout(self.req_to_token, req_pool_indices[:bs], seq_lens[:bs],
                                       seq_lens_cpu[:bs], self.page_size)
        return BatchPlan(True, layout, None, self._graph_wrappers.setdefault(bs, {}), graph_bs=bs)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        """Builds and plans this batch size's wrappers (every known key) before capture."""
        # Capture happens once per batch size at start-up: reading the lengths back is fine.
        plan = self._graph_plan(bs, req_pool_indices, seq_lens, seq_lens[:bs].tolist())
        for key in self._known_keys or {self._default_key()}:
            self._plan(plan, key)
        self.forward_metadata = plan

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> None:
        """Re-plans the captured wrappers of ``bs`` in place for this step's rows."""
        plan = self._graph_plan(bs, req_pool_indices, seq_lens, seq_lens_cpu)
        for key in list(plan.wrappers):
            self._plan(plan, key)
        self.forward_metadata = plan

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Padded rows get length 1: one real (ignored) position, never an empty softmax."""
        return 1

    def _default_key(self) -> LayerKey:
        return LayerKey(window_left=-1, logits_soft_cap=0.0, sm_scale=self.head_dim ** -0.5)


def create(ctx: AttentionContext) -> FlashInferAttnBackend:
    """Factory named by the plugin's registration (``engine_attention_flashinfer.backend:create``)."""
    return FlashInferAttnBackend(ctx)


__all__ = ["BatchPlan", "FlashInferAttnBackend", "create"]
