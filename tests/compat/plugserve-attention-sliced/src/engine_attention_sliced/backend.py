"""The `sliced` backend: each row's keys and values are gathered from the paged pool through
``req_to_token`` and attended in float32, one row at a time."""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, AttentionContext


def create(ctx: AttentionContext) -> SlicedAttention:
    return SlicedAttention(ctx)


class SlicedAttention(AttentionBackend):
    def __init__(self, ctx: AttentionContext) -> None:
        self.ctx = ctx

    def init_forward_metadata(self, forward_batch):  # type: ignore[no-untyped-def]
        # Per row: (cached prefix, new tokens). Decode rows have one new token.
        seq = forward_batch.seq_lens_cpu
        if forward_batch.forward_mode.is_decode():
            new = [1] * forward_batch.batch_size
        else:
            new = list(forward_batch.extend_seq_lens_cpu)
        forward_batch.attn_metadata = [(s - n, n) for s, n in zip(seq, new)]

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        return self._attend(q, layer, forward_batch)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        if save_kv_cache:
            self.save_kv(layer, forward_batch, k, v)
        return self._attend(q, layer, forward_batch)

    def _attend(self, q, layer, forward_batch):  # type: ignore[no-untyped-def]
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        table = forward_batch.req_to_token_pool.req_to_token
        heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        out = torch.empty(q.shape[0], heads * dim, dtype=q.dtype, device=q.device)
        start = 0
        for row, (prefix, new) in enumerate(forward_batch.attn_metadata):
            seq = prefix + new
            slots = table[forward_batch.req_pool_indices[row], :seq].long()
            keys = k_buf[slots].float().repeat_interleave(heads // kv_heads, dim=1)  # [seq, H, D]
            values = v_buf[slots].float().repeat_interleave(heads // kv_heads, dim=1)
            queries = q[start : start + new].view(new, heads, dim).float()
            scores = torch.einsum("qhd,khd->hqk", queries, keys) * layer.scaling
            if layer.logit_cap > 0:
                scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
            q_pos = torch.arange(prefix, seq, device=q.device)[:, None]
            k_pos = torch.arange(seq, device=q.device)[None, :]
            visible = k_pos <= q_pos
            if layer.sliding_window_size > 0:
                visible &= q_pos - k_pos < layer.sliding_window_size
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start : start + new] = torch.einsum("hqk,khd->qhd", probs, values).reshape(new, -1).to(q.dtype)
            start += new
        return out
