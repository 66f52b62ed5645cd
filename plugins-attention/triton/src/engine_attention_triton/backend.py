"""``TritonAttnBackend``: the project's own Triton kernels behind the attention-backend contract.

Both kernels read KV slots straight from ``req_to_token`` (one index per position,
so any page size works unchanged), which leaves little to plan per batch:

- decode: the number of sequence splits and the float32 workspaces of the split
  kernel (partial outputs and log-sum-exps);
- extend/MIXED: the longest new-token run, which sizes the launch grid.

FP8 KV cache: the kernels load the pool's float8 K/V and widen them to q's dtype (exact);
``k_scale`` is folded into the softmax scale and ``v_scale`` multiplies the normalised output,
both in float32, which equals dequantizing every element first. Extend rows then read their new
tokens back from the pool too, so they attend over K/V as stored, like every other backend.

CUDA graphs capture decode steps and speculative verify steps. A decode graph reads request
slots and lengths from buffers this backend owns, refreshed in place before every replay, and
uses a split count that depends on the batch size alone, so a replay neither allocates nor
synchronises with the host. A verify graph runs the extend kernel with every row
``tokens_per_row`` long (a fixed grid); its slots, prefix lengths and offsets are the graph
runner's static buffers (``engine.model_executor.cuda_graph_runner.VerifyGraphRunner``).

An "mla" pool (``MLATokenToKVPool``: one latent+rope row per token, V its leading dims) runs the
kernels of ``mla_attention`` instead, with the same metadata, workspaces and graph paths; decode
then splits each row over ``mla_head_blocks`` programs per split instead of one per KV head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.attention import AttentionBackend, AttentionContext, AttentionLayerInfo
from engine_attention_triton import extend_attention, interpreting
from engine_attention_triton.decode_attention import (
    choose_num_kv_splits,
    decode_attention_fwd,
    has_pdl,
)
from engine_attention_triton.extend_attention import (
    extend_attention_fwd,
    gather_widened,
    warm_extend,
)
from engine_attention_triton.mla_attention import mla_decode_fwd, mla_extend_fwd, mla_head_blocks

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engine.model_executor.forward_batch import ForwardBatch

#: Split-count heuristic's SM count under Triton's interpreter (no GPU to ask).
_INTERPRETER_SMS = 4

#: Options accepted under ``attention.triton.<key>``, with their defaults.
DEFAULT_OPTIONS: dict[str, int] = {
    # Upper bound on decode splits per row; also the split count of CUDA-graph workspaces.
    "max_kv_splits": 16,
    # 1: decode kernels use programmatic dependent launch where the GPU has it (sm_90+); 0: never.
    "pdl": 1,
}


@dataclass
class DecodeMetadata:
    """What the decode kernel needs for one batch."""

    # [batch] request slots and total lengths the kernels read (static buffers under graphs).
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    # Splits per row of the first stage.
    num_kv_splits: int
    # float32 workspaces: [batch, num_heads, splits, v_dim] and [batch, num_heads, splits].
    part_out: torch.Tensor
    part_lse: torch.Tensor


@dataclass
class ExtendMetadata:
    """What the extend kernel needs for one batch beyond the ForwardBatch tensors."""

    # Longest run of new tokens in the batch (host int, sizes the grid without a sync).
    max_extend_len: int


@dataclass
class _GraphState:
    """Workspaces the captured decode graphs use, and each captured batch size's metadata (its
    slots and lengths are the graph runner's static buffers, read in place)."""

    part_out: torch.Tensor  # [max_bs, num_heads, max_kv_splits, v_dim]
    part_lse: torch.Tensor  # [max_bs, num_heads, max_kv_splits]
    captured: dict[int, DecodeMetadata] = field(default_factory=dict)


def _parse_options(options: dict[str, Any]) -> dict[str, int]:
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown option(s) for attention backend 'triton': {', '.join(unknown)}; "
            f"accepted: {', '.join(sorted(DEFAULT_OPTIONS))}"
        )
    parsed = {**DEFAULT_OPTIONS, **{k: int(v) for k, v in options.items()}}
    if parsed["max_kv_splits"] < 1:
        raise ValueError(
            f"attention.triton.max_kv_splits={parsed['max_kv_splits']}; accepted: an int >= 1"
        )
    if parsed["pdl"] not in (0, 1):
        raise ValueError(f"attention.triton.pdl={parsed['pdl']}; accepted: on/off (1/0)")
    return parsed


class TritonAttnBackend(AttentionBackend):
    """Split-KV decode and paged extend attention written in Triton."""

    supports_mixed = True
    supports_cuda_graph = True
    # Tree verification runs eagerly through the extend kernel's tree-mask input (verify graphs
    # are captured for chains only).
    supports_tree_mask = True

    def __init__(self, ctx: AttentionContext) -> None:
        options = _parse_options(ctx.options)
        self.device = torch.device(ctx.device)
        self.q_dtype = ctx.dtype
        if self.device.type != "cuda" and not (self.device.type == "cpu" and interpreting()):
            raise ValueError(
                f"attention backend 'triton' needs a CUDA device (or the CPU under "
                f"TRITON_INTERPRET=1); got {self.device}"
            )
        self.num_heads = ctx.num_heads
        self.num_kv_heads = ctx.num_kv_heads
        self.v_head_dim = ctx.token_to_kv_pool.v_head_dim
        self.max_kv_splits = options["max_kv_splits"]
        #: Decode kernels launched with programmatic dependent launch (``decode_attention_fwd``).
        self.pdl = bool(options["pdl"]) and has_pdl(self.device)
        self.req_to_token = ctx.req_to_token_pool.req_to_token
        self.token_to_kv_pool = ctx.token_to_kv_pool
        if self.device.type == "cpu":
            from engine_attention_triton.interpreter_compat import patch_interpreter_index

            patch_interpreter_index()
        self.kv_fp8 = ctx.token_to_kv_pool.is_fp8
        self.mla = getattr(ctx.token_to_kv_pool, "kv_layout", "mha") == "mla"
        # Decode programs per row and split: one per KV head, or per block of query heads (MLA).
        self.kv_programs = mla_head_blocks(self.num_heads) if self.mla else self.num_kv_heads
        self.num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda" else _INTERPRETER_SMS
        )
        self.forward_metadata: DecodeMetadata | ExtendMetadata | None = None
        self._graph: _GraphState | None = None

    # -- per-batch planning -------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plans the batch: decode splits and workspaces, or the extend grid size."""
        if forward_batch.forward_mode.is_decode():
            bs = forward_batch.batch_size
            max_seq_len = max(forward_batch.seq_lens_cpu, default=1)
            splits = choose_num_kv_splits(
                bs, self.kv_programs, self.num_sms, self.max_kv_splits, max_seq_len
            )
            part_out, part_lse = self._workspaces(bs, splits)
            self.forward_metadata = DecodeMetadata(
                forward_batch.req_pool_indices, forward_batch.seq_lens, splits, part_out, part_lse
            )
        elif forward_batch.forward_mode.is_extend():
            lens = forward_batch.extend_seq_lens_cpu
            if lens is None:
                raise ValueError(
                    "triton attention: an EXTEND/MIXED batch needs extend_seq_lens_cpu"
                )
            self.forward_metadata = ExtendMetadata(max_extend_len=max(lens, default=0))
        else:
            self.forward_metadata = None
        forward_batch.attn_metadata = self.forward_metadata

    def _workspaces(self, bs: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        part_out = torch.empty(
            (bs, self.num_heads, splits, self.v_head_dim), dtype=torch.float32, device=self.device
        )
        part_lse = torch.empty(
            (bs, self.num_heads, splits), dtype=torch.float32, device=self.device
        )
        return part_out, part_lse

    def warmup(self, layers: Any = None) -> None:
        """Compiles the extend kernels the layers will use (``warm_extend``) before serving."""
        if self.mla or self.device.type != "cuda" or not layers:
            return
        # One layer for each distinct set of the kernel's compile-time choices (heads, dims, cap, window).
        first = {(ly.num_heads, ly.head_dim, ly.v_head_dim, ly.logit_cap > 0, _kernel_window(ly)): ly for ly in layers}
        for ly in first.values():
            k_buffer, v_buffer = self.token_to_kv_pool.get_kv_buffer(ly.layer_id)
            try:
                warm_extend(self.q_dtype, ly.num_heads, ly.head_dim, v_buffer.shape[2], k_buffer, v_buffer,
                            self.req_to_token, ly.logit_cap, _kernel_window(ly))
            except Exception as exc:  # noqa: BLE001 - a warm-up is an optimisation: serving compiles on first use
                logger.warning("triton attention: extend warm-up failed (%s: %s); the kernels compile on their first "
                               "use instead", type(exc).__name__, exc)
                return

    # -- forward ------------------------------------------------------------
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayerInfo,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Saves the new K/V, then runs the extend kernel (MIXED decode rows included)."""
        metadata = self.forward_metadata
        if not isinstance(metadata, ExtendMetadata):
            raise RuntimeError("triton attention: forward_extend before init_forward_metadata")
        if self.mla:
            return self._mla_extend(q, k, layer, forward_batch, metadata, save_kv_cache)
        v_dim = layer.v_head_dim if layer.v_head_dim > 0 else layer.head_dim
        k_buffer, v_buffer = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        if k is not None and v is not None and save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        if self.kv_fp8 and extend_attention.WIDEN_NEW_KV_FIRST and extend_attention.GATHER_WIDENED:
            # The new tokens are attended as stored (quantized): read back and widened in one launch.
            k_new, v_new = gather_widened(k_buffer, v_buffer, forward_batch.out_cache_loc, q.dtype)
        elif k is None or v is None or self.kv_fp8:
            # The layer re-uses K/V already in the pool, or the pool is fp8 and the new tokens
            # are attended as stored (quantized): read them from there.
            loc = forward_batch.out_cache_loc
            k_new, v_new = k_buffer[loc], v_buffer[loc]
        else:
            k_new = k.view(-1, layer.num_kv_heads, layer.head_dim).to(q.dtype)
            v_new = v.view(-1, layer.num_kv_heads, v_dim).to(q.dtype)
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        out = q.new_empty((q3.shape[0], layer.num_heads, v_dim))
        assert forward_batch.extend_prefix_lens is not None
        assert forward_batch.extend_seq_lens is not None
        assert forward_batch.extend_start_loc is not None
        k_scale, v_scale = self._kv_scales(layer)
        extend_attention_fwd(
            q3, k_new, v_new, out, k_buffer, v_buffer, self.req_to_token,
            forward_batch.req_pool_indices, forward_batch.extend_prefix_lens,
            forward_batch.extend_seq_lens, forward_batch.extend_start_loc,
            metadata.max_extend_len, layer.scaling, layer.logit_cap, _kernel_window(layer),
            k_scale=k_scale, v_scale=v_scale,
            tree_mask=forward_batch.tree_mask, tree_mask_indptr=forward_batch.tree_mask_indptr,
        )
        return out.view(-1, layer.num_heads * v_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayerInfo,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Saves the new token's K/V, then runs the two-stage split-KV decode kernel."""
        metadata = self.forward_metadata
        if not isinstance(metadata, DecodeMetadata):
            raise RuntimeError("triton attention: forward_decode before init_forward_metadata")
        if save_kv_cache and k is not None:
            # An MLA pool stores k's rows alone (v is a view of them).
            self.save_kv(layer, forward_batch, k, None if self.mla else v)
        v_dim = layer.v_head_dim if layer.v_head_dim > 0 else layer.head_dim
        if layer.num_heads > metadata.part_out.shape[1] or v_dim > metadata.part_out.shape[3]:
            raise ValueError(
                f"triton attention: layer {layer.layer_id} has {layer.num_heads} heads of "
                f"v_dim {v_dim}; the workspace was sized for {metadata.part_out.shape[1]} "
                f"heads of v_dim {metadata.part_out.shape[3]}"
            )
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        out = q.new_empty((q3.shape[0], layer.num_heads, v_dim))
        k_scale, v_scale = self._kv_scales(layer)
        if self.mla:
            self._check_mla_layer(layer)
            mla_decode_fwd(
                q3, self.token_to_kv_pool.get_key_buffer(layer.layer_id), out, self.req_to_token,
                metadata.req_pool_indices, metadata.seq_lens, metadata.part_out, metadata.part_lse,
                metadata.num_kv_splits, layer.scaling, v_dim, layer.logit_cap, kv_scale=k_scale, pdl=self.pdl,
            )
            return out.view(-1, layer.num_heads * v_dim)
        k_buffer, v_buffer = self.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        decode_attention_fwd(
            q3, k_buffer, v_buffer, out, self.req_to_token,
            metadata.req_pool_indices, metadata.seq_lens, metadata.part_out, metadata.part_lse,
            metadata.num_kv_splits, layer.scaling, layer.logit_cap, _kernel_window(layer),
            k_scale=k_scale, v_scale=v_scale, pdl=self.pdl,
        )
        return out.view(-1, layer.num_heads * v_dim)

    def _mla_extend(
        self, q: torch.Tensor, k: torch.Tensor | None, layer: AttentionLayerInfo,
        forward_batch: ForwardBatch, metadata: ExtendMetadata, save_kv_cache: bool,
    ) -> torch.Tensor:
        """Extend over the "mla" layout: saves k's latent+rope rows, runs ``mla_extend_fwd``."""
        self._check_mla_layer(layer)
        kv_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        if k is not None and save_kv_cache:
            self.save_kv(layer, forward_batch, k, None)
        if k is None or self.kv_fp8:
            # Already stored by the layer, or stored as fp8 and attended as stored.
            k_new = kv_buffer[forward_batch.out_cache_loc]
        else:
            k_new = k.reshape(-1, 1, layer.head_dim).to(q.dtype)
        v_dim = layer.v_head_dim
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        out = q.new_empty((q3.shape[0], layer.num_heads, v_dim))
        assert forward_batch.extend_prefix_lens is not None
        assert forward_batch.extend_seq_lens is not None
        assert forward_batch.extend_start_loc is not None
        mla_extend_fwd(
            q3, k_new, out, kv_buffer, self.req_to_token, forward_batch.req_pool_indices,
            forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens,
            forward_batch.extend_start_loc, metadata.max_extend_len, layer.scaling, v_dim,
            layer.logit_cap, kv_scale=self._kv_scales(layer)[0],
            tree_mask=forward_batch.tree_mask, tree_mask_indptr=forward_batch.tree_mask_indptr,
        )
        return out.view(-1, layer.num_heads * v_dim)

    def _check_mla_layer(self, layer: AttentionLayerInfo) -> None:
        """The MLA kernels read V as the rows' leading ``v_head_dim`` dims of one KV head, and
        implement no sliding window (no MLA model has one)."""
        if layer.num_kv_heads != 1 or not 0 < layer.v_head_dim < layer.head_dim:
            raise ValueError(
                f"triton attention: layer {layer.layer_id} on an 'mla' pool has num_kv_heads="
                f"{layer.num_kv_heads}, head_dim={layer.head_dim}, v_head_dim={layer.v_head_dim}; "
                f"accepted: one KV head, 0 < v_head_dim < head_dim (kv_lora_rank + rope dim)"
            )
        if layer.sliding_window_size > 0:
            raise ValueError(
                f"triton attention: layer {layer.layer_id} has sliding_window_size="
                f"{layer.sliding_window_size} on an 'mla' pool; accepted: -1 (no window)"
            )

    def _kv_scales(self, layer: AttentionLayerInfo) -> tuple[float, float]:
        """The layer's fp8 KV scales; 1.0 for a pool in the activation dtype (scales unused)."""
        if not self.kv_fp8:
            return 1.0, 1.0
        return float(layer.k_scale), float(layer.v_scale)

    # -- CUDA graphs (decode) -----------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocates the workspaces every captured graph uses (the slots and lengths it reads are
        the graph runner's, handed over at capture)."""
        part_out, part_lse = self._workspaces(max_bs, self.max_kv_splits)
        self._graph = _GraphState(part_out=part_out, part_lse=part_lse)

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """Points the decode metadata at the graph runner's static slot and length buffers before
        capturing ``bs`` rows: the graph reads them in place."""
        graph = self._graph
        if graph is None:
            raise RuntimeError("triton attention: init_cuda_graph_state was not called")
        if bs > graph.part_out.shape[0]:
            raise ValueError(
                f"triton attention: graph batch size {bs} exceeds max_bs={graph.part_out.shape[0]}"
            )
        # Batch size alone decides the split count, so capture and every replay agree.
        splits = choose_num_kv_splits(bs, self.kv_programs, self.num_sms, self.max_kv_splits)
        metadata = DecodeMetadata(req_pool_indices[:bs], seq_lens[:bs], splits, graph.part_out[:bs],
                                  graph.part_lse[:bs])
        graph.captured[bs] = metadata
        self.forward_metadata = metadata

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: list[int],
    ) -> None:
        """The metadata captured for ``bs`` rows. Slots and lengths handed in buffers other than the
        captured ones are copied into those (device-side, no sync); the graph runner hands the
        same static buffers, so a replay copies nothing."""
        graph = self._graph
        metadata = graph.captured.get(bs) if graph is not None else None
        if metadata is None:
            raise RuntimeError(f"triton attention: no decode graph of {bs} rows was captured")
        for static, given in ((metadata.req_pool_indices, req_pool_indices), (metadata.seq_lens, seq_lens)):
            if given.data_ptr() != static.data_ptr():
                static.copy_(given[:bs], non_blocking=True)
        self.forward_metadata = metadata

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Padded rows get length 1: one real (ignored) position, never an empty softmax."""
        return 1

    # -- CUDA graphs (speculative verify) -------------------------------------
    #: verify steps (every row ``tokens_per_row`` new tokens over its paged prefix) can be captured.
    supports_verify_cuda_graph = True

    def init_verify_cuda_graph_state(self, max_bs: int, tokens_per_row: int) -> None:
        """Nothing to allocate: the extend kernel reads request slots, prefix lengths, run
        lengths and start offsets from the batch's tensors, which the graph runner keeps in
        static buffers; only the grid's row length is planned on the host, and it is fixed."""
        self._verify_tokens = tokens_per_row

    def _verify_metadata(self, forward_batch: ForwardBatch) -> None:
        tokens = getattr(self, "_verify_tokens", None)
        if tokens is None:
            raise RuntimeError("triton attention: init_verify_cuda_graph_state was not called")
        self.forward_metadata = ExtendMetadata(max_extend_len=tokens)
        forward_batch.attn_metadata = self.forward_metadata

    def init_forward_metadata_capture_verify(self, forward_batch: ForwardBatch) -> None:
        """Plans a verify batch before capture: the extend kernel over ``tokens_per_row`` rows."""
        self._verify_metadata(forward_batch)

    def init_forward_metadata_replay_verify(self, forward_batch: ForwardBatch) -> None:
        """Before a replay: the kernel's inputs are already in the static buffers."""
        self._verify_metadata(forward_batch)


def _kernel_window(layer: AttentionLayerInfo) -> int:
    """The engine's window W keeps keys with ``q_pos - k_pos < W`` (as Hugging Face does);
    the kernels keep ``q_pos - k_pos <= w``, so they get ``W - 1``."""
    w = layer.sliding_window_size
    return w - 1 if w > 0 else -1


def create(ctx: AttentionContext) -> TritonAttnBackend:
    """Factory named by the plugin's registration (``engine_attention_triton.backend:create``)."""
    return TritonAttnBackend(ctx)


__all__ = ["DecodeMetadata", "ExtendMetadata", "TritonAttnBackend", "create"]
