"""Attention in plain PyTorch: the reference every other backend is checked against.

Extend rows run one at a time (each row's cached prefix is gathered from the pool
through ``req_to_token``); decode rows run together, padded to the longest row. A tree batch
(``forward_batch.tree_mask``, speculative tree verification) replaces each row's causal mask
over its new tokens by its ancestor matrix.
An fp8 pool (``--kv-cache-dtype fp8_*``) is read as ``stored * scale`` in float32, then
attended in q's dtype: the reference for the other backends' fp8 paths.
The "mla" KV layout (multi-head latent attention) needs nothing of its own: the pool's value
buffer is a view of the key rows' leading dims, read like any MQA pool with ``v_head_dim <
head_dim``; only an fp8 pool's V is dequantized with ``k_scale`` (it is the stored key row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, AttentionContext, AttentionLayerInfo
from engine.mem_cache.memory_pool import dequantize_kv
from engine.model_executor.forward_batch import ForwardBatch


def create(ctx: AttentionContext) -> TorchNativeAttnBackend:
    return TorchNativeAttnBackend(ctx)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            layer: AttentionLayerInfo) -> torch.Tensor:
    """q ``[B, H, Lq, D]``, k/v ``[B, Hkv, Lk, D]``, mask ``[B, 1, Lq, Lk]`` (True = attend)."""
    group = layer.num_heads // layer.num_kv_heads
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if layer.logit_cap > 0:
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * layer.scaling
        scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scaling)


def _v_scale(layer: AttentionLayerInfo) -> float:
    """The scale V was stored with: the key's in the "mla" layout (V is part of the key row)."""
    return layer.k_scale if getattr(layer, "kv_layout", "mha") == "mla" else layer.v_scale


def _causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    mask = k_pos[None, :] <= q_pos[:, None]
    if window > 0:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def _tree_row_mask(fb: ForwardBatch, start: int, prefix: int, ext: int, offset: int, window: int) -> torch.Tensor:
    """``[ext, prefix + ext]`` for one row of a tree batch: the whole prefix, then the row's
    ancestor matrix; a sliding window compares real positions (prefix + depth), not indices."""
    assert fb.tree_mask is not None
    tree = fb.tree_mask[offset: offset + ext * ext].view(ext, ext)
    q_pos = fb.positions[start: start + ext]
    k_pos = torch.cat([torch.arange(prefix, device=q_pos.device), q_pos])
    mask = torch.cat([torch.ones(ext, prefix, dtype=torch.bool, device=tree.device), tree], dim=1)
    if window > 0:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


class TorchNativeAttnBackend(AttentionBackend):
    supports_mixed = True
    supports_tree_mask = True

    def __init__(self, ctx: AttentionContext) -> None:
        self.ctx = ctx

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode.is_decode():
            # Padded gather indices for the whole decode batch, computed once for all layers.
            lens = forward_batch.seq_lens
            max_len = max(forward_batch.seq_lens_cpu) if forward_batch.batch_size else 0
            pool = forward_batch.req_to_token_pool
            assert pool is not None
            idx = pool.req_to_token[forward_batch.req_pool_indices, :max_len].long()
            pos = torch.arange(max_len, device=idx.device)
            valid = pos[None, :] < lens[:, None]
            # The additive form SDPA would build from the boolean mask in every layer, built once.
            additive = torch.zeros(valid.shape, dtype=self.ctx.dtype, device=idx.device).masked_fill_(~valid, float("-inf"))
            forward_batch.attn_metadata = (idx, valid, pos, additive[:, None, None, :])

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                       layer: AttentionLayerInfo, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        pool, r2t = forward_batch.token_to_kv_pool, forward_batch.req_to_token_pool
        assert pool is not None and r2t is not None
        assert forward_batch.extend_seq_lens_cpu is not None and forward_batch.extend_prefix_lens_cpu is not None
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        head_v = layer.v_head_dim if layer.v_head_dim > 0 else layer.head_dim
        out = q.new_empty(q.shape[0], layer.num_heads * head_v)
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        start = 0
        tree_offset = 0  # where this row's matrix starts in forward_batch.tree_mask
        for row in range(forward_batch.batch_size):
            ext = forward_batch.extend_seq_lens_cpu[row]
            prefix = forward_batch.extend_prefix_lens_cpu[row]
            seq = prefix + ext
            slots = r2t.req_to_token[forward_batch.req_pool_indices[row], :seq].long()
            kr = dequantize_kv(k_buf[slots], q.dtype, layer.k_scale).transpose(0, 1).unsqueeze(0)
            vr = dequantize_kv(v_buf[slots], q.dtype, _v_scale(layer)).transpose(0, 1).unsqueeze(0)
            qr = q3[start : start + ext].transpose(0, 1).unsqueeze(0)
            if forward_batch.tree_mask is None:
                q_pos = torch.arange(prefix, seq, device=q.device)
                k_pos = torch.arange(seq, device=q.device)
                mask = _causal_mask(q_pos, k_pos, layer.sliding_window_size)[None, None]
            else:
                mask = _tree_row_mask(forward_batch, start, prefix, ext, tree_offset,
                                      layer.sliding_window_size)[None, None]
                tree_offset += ext * ext
            o = _attend(qr, kr, vr, mask, layer)
            out[start : start + ext] = o.squeeze(0).transpose(0, 1).reshape(ext, -1)
            start += ext
        return out

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                       layer: AttentionLayerInfo, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        pool = forward_batch.token_to_kv_pool
        assert pool is not None
        idx, valid, pos, additive = forward_batch.attn_metadata
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        # index_select of the flat indices: the same rows as k_buf[idx], at half the cost on the CPU.
        flat = idx.reshape(-1)
        kb = dequantize_kv(k_buf.index_select(0, flat).view(*idx.shape, *k_buf.shape[1:]), q.dtype,
                           layer.k_scale).permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        vb = dequantize_kv(v_buf.index_select(0, flat).view(*idx.shape, *v_buf.shape[1:]), q.dtype,
                           _v_scale(layer)).permute(0, 2, 1, 3)
        mask = valid
        if layer.sliding_window_size > 0:
            last = (forward_batch.seq_lens - 1)[:, None]
            mask = mask & (pos[None, :] > last - layer.sliding_window_size)
        if layer.logit_cap > 0:
            qb = q.view(-1, layer.num_heads, 1, layer.head_dim)
            return _attend(qb, kb, vb, mask[:, None, None, :], layer).reshape(q.shape[0], -1)
        # The query heads sharing a KV head become that head's rows of queries (one token each, so
        # no causal order among them): no copy of K/V per query head.
        group = layer.num_heads // layer.num_kv_heads
        qb = q.view(-1, layer.num_kv_heads, group, layer.head_dim)
        bias = additive if layer.sliding_window_size <= 0 else None
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[:, None, None, :] if bias is None else bias,
                                           scale=layer.scaling)
        return o.reshape(q.shape[0], -1)
