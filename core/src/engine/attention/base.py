"""Base class of attention backends (docs/plugins-reference.md, "Attention backends", is the guide).

A backend is created once per model runner by its plugin's factory,
``factory(ctx: AttentionContext) -> AttentionBackend``; ``ctx`` carries the model's head
shapes, the device and dtype, the page size, both KV pools and the options of the backend's
plugin (``PluginOption`` defaults overridden by the user's ``plugin_options: {<plugin>: {<key>: value}}``
in YAML or ``--plugin-option <plugin>.<key>=<value>``, ``<plugin>`` being the plugin's entry-point
name). For every batch the runner calls
``init_forward_metadata(forward_batch)`` once; then each attention layer calls ``forward``,
which writes the new tokens' K/V into the paged pool at ``out_cache_loc`` and attends over
every token of each row (cached prefix + new tokens), reading the pool through ``req_to_token``.

Batches (``forward_batch.forward_mode``):
- DECODE: one new token per row; ``seq_lens`` includes it.
- EXTEND: each row adds ``extend_seq_lens[i]`` tokens after ``extend_prefix_lens[i]`` cached
  ones (a prompt, a chunk of one, or the uncached tail after a prefix-cache hit).
- EXTEND with ``tree_mask`` (speculative tree verification, only when ``supports_tree_mask``):
  new token i of a row attends to the prefix and to the row's new tokens j with ``mask[i, j]``
  (a subset of the causal mask: ancestors come first); its position is ``prefix + depth``.
- MIXED (``--enable-mixed-chunk``, only when ``supports_mixed``): EXTEND's fields for every row;
  the first ``num_extend_reqs`` rows are extend rows, the rest decode rows with one new token.
  ``forward`` sends MIXED to ``forward_extend``.

Tensor layouts (all backends share them):
- ``q``: ``[num_tokens, num_heads * head_dim]``; ``k``/``v``: ``[num_tokens, num_kv_heads * head_dim]``
  (``None`` when the layer re-uses K/V it already saved, e.g. cross-layer sharing), rows in
  batch order (row 0's new tokens, then row 1's, ...);
- K/V pool of layer L (``token_to_kv_pool.get_kv_buffer(L)``): ``[pool_rows, num_kv_heads, head_dim]``;
- ``req_to_token_pool.req_to_token[req_pool_indices[i], pos]``: KV slot of position ``pos`` of row ``i``
  (int32, already written for the new tokens too);
- returns ``[num_tokens, num_heads * head_dim]`` in q's dtype.

KV layouts (``AttentionBackendSpec.kv_layouts``; the layer's ``kv_layout``, the pool's ``kv_layout``):
- "mha": the above; K and V in separate buffers of each layer.
- "mla" (multi-head latent attention, DeepSeek-V2/V3; ``MLATokenToKVPool``): the layer calls the
  backend as an MQA layer with one KV head, ``head_dim = kv_lora_rank + rope_dim`` (576 for
  DeepSeek) and ``v_head_dim = kv_lora_rank`` (512): q ``[T, num_heads * head_dim]`` (queries
  already projected into the latent space), k ``[T, head_dim]`` (the latent and the rotated
  rope key), v the view of k's leading ``v_head_dim`` dims. The pool has ONE buffer per layer,
  ``get_key_buffer(L)`` ``[rows, 1, head_dim]``; ``get_value_buffer(L)`` is the view of its leading
  ``v_head_dim`` dims (not a buffer of its own). The backend returns
  ``[T, num_heads * v_head_dim]``; an fp8 pool's V is read with ``k_scale``.

FP8 KV cache (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``): the pool's ``dtype`` (storage) is then a
float8 type while q stays in the activation dtype. ``save_kv`` stores ``k / layer.k_scale`` and
``v / layer.v_scale`` (saturated); a backend reads ``stored * scale`` (``k_scale``/``v_scale`` are
per-layer Python floats, 1.0 unless the checkpoint gives them). Attention is computed over K/V as
stored, the new tokens' included, so every backend sees the same values. A backend accepts the
values of ``--kv-cache-dtype`` listed in ``AttentionBackendSpec.kv_cache_dtypes``; the engine
refuses the others before allocating the pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from engine.layers.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayerInfo:
    """What a backend needs to know about the calling layer (RadixAttention satisfies this)."""

    layer_id: int
    num_heads: int  # query heads on this tensor-parallel rank
    num_kv_heads: int  # key/value heads on this rank
    head_dim: int
    scaling: float  # softmax scale, usually head_dim ** -0.5
    logit_cap: float = 0.0  # tanh soft cap on scores; 0 disables
    # Keys with q_pos - k_pos < sliding_window_size are attended (HF's convention); -1 = no window.
    sliding_window_size: int = -1
    v_head_dim: int = -1  # -1 means head_dim
    # FP8 KV cache: the pool stores k / k_scale and v / v_scale; readers multiply back.
    k_scale: float = 1.0
    v_scale: float = 1.0
    # The KV pool's layout: "mha", or "mla" (one latent row per token; see the module docstring).
    kv_layout: str = "mha"


@dataclass
class AttentionContext:
    """What a backend factory receives: ``factory(ctx) -> AttentionBackend``."""

    device: torch.device
    dtype: torch.dtype  # activation dtype (q, outputs); the pool's storage dtype is token_to_kv_pool.dtype
    num_layers: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    page_size: int
    max_context_len: int
    req_to_token_pool: ReqToTokenPool
    # ``MHATokenToKVPool``, or ``MLATokenToKVPool`` for an "mla" model (``token_to_kv_pool.kv_layout``).
    token_to_kv_pool: MHATokenToKVPool
    # The backend plugin's options: its PluginOption defaults overridden by the user's
    # ``plugin_options: {<plugin entry-point name>: {<key>: value}}``.
    options: dict[str, Any] = field(default_factory=dict)


class AttentionBackend(ABC):
    """One attention implementation over the paged KV pool."""

    #: whether ``forward_extend`` accepts MIXED batches (extend rows then decode rows).
    supports_mixed: bool = True
    #: whether ``forward_extend`` honours ``forward_batch.tree_mask`` (speculative tree drafts:
    #: each new token attends to the cached prefix and to the new tokens its row's mask allows).
    #: Without it the speculator verifies chains only. Positions come from ``positions`` as always.
    supports_tree_mask: bool = False

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plans the batch (indices, workspaces); called once before the layers run."""

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayerInfo,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Attention for EXTEND/MIXED batches: new tokens over prefix + themselves, causal.

        ``k``/``v`` None (with ``save_kv_cache=False``): the new tokens' K/V are already in the
        pool at ``forward_batch.out_cache_loc`` (the layer's fused prologue stored them); read
        them there. The same holds for ``forward_decode``."""

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayerInfo,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Attention for DECODE batches: one query token per row over its whole sequence."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayerInfo,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    # -- CUDA graph support (optional) ---------------------------------------
    #: whether the backend can be captured in CUDA graphs for decode.
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocates static buffers the captured graphs will read (graph-capable backends)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """Points the metadata at static buffers before capturing a decode graph of ``bs`` rows.

        ``req_pool_indices`` and ``seq_lens`` are the graph runner's own static buffers: they live
        as long as the graph, and each replay refreshes them before calling
        ``init_forward_metadata_replay_cuda_graph`` with them, so a backend may read them in place
        rather than keep copies."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: list[int],
    ) -> None:
        """Refreshes the static buffers in place before replaying the graph of ``bs`` rows."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Sequence length written into padded rows of a captured batch."""
        return 1

    # -- helpers shared by backends -----------------------------------------
    @staticmethod
    def save_kv(
        layer: AttentionLayerInfo,
        forward_batch: ForwardBatch,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
    ) -> None:
        """Writes the new tokens' K/V into the pool at ``out_cache_loc`` (an fp8 pool quantizes
        them with the layer's ``k_scale``/``v_scale``). An "mla" pool stores k alone (v is a view
        of it, and may be None)."""
        if k is None:
            return
        pool = forward_batch.token_to_kv_pool
        assert pool is not None
        head_dim_v = layer.v_head_dim if layer.v_head_dim > 0 else layer.head_dim
        pool.set_kv_buffer(
            layer.layer_id,
            forward_batch.out_cache_loc,
            k.view(-1, layer.num_kv_heads, layer.head_dim),
            None if v is None else v.view(-1, layer.num_kv_heads, head_dim_v),
            getattr(layer, "k_scale", 1.0),
            getattr(layer, "v_scale", 1.0),
        )
