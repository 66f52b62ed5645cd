"""Plain-torch attention over the paged KV layout: the oracle the Triton kernels are tested against.

Written for clarity, not speed: one row at a time, scores materialised in full, in
any dtype the caller asks for (float64 by default), on whatever device the inputs
live. It shares no code with the kernels, so a bug in their indexing or masking
cannot hide in both.

Conventions (the same as the kernels'): query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``; a query at position ``i`` sees key position
``j`` when ``j <= i`` and, with a sliding window ``W >= 0``, ``i - j <= W``; the logit
cap ``c > 0`` replaces a scaled score ``s`` by ``c * tanh(s / c)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _as_list(x: torch.Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)]


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_positions: torch.Tensor,
    scaling: float,
    logit_cap: float,
    sliding_window_size: int,
) -> torch.Tensor:
    """``q`` ``[n, H, D]`` over ``keys``/``values`` ``[L, KVH, D]`` at positions ``0..L-1``."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, keys) * scaling
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    key_positions = torch.arange(keys.shape[0], device=q.device)
    distance = q_positions[:, None] - key_positions[None, :]
    visible = distance >= 0
    if sliding_window_size >= 0:
        visible &= distance <= sliding_window_size
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), values)


def reference_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor | Sequence[int],
    prefix_lens: torch.Tensor | Sequence[int],
    extend_seq_lens: torch.Tensor | Sequence[int],
    scaling: float,
    logit_cap: float = 0.0,
    sliding_window_size: int = -1,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Extend attention: each row's new tokens over its pooled prefix and themselves.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``; ``k``/``v``: the new tokens' K/V
            ``[num_tokens, num_kv_heads, dim]``, rows back to back in batch order.
        k_buffer, v_buffer: the pool ``[rows, num_kv_heads, dim]`` holding row ``i``'s
            prefix at ``req_to_token[req_pool_indices[i], 0:prefix_lens[i]]``.
        compute_dtype: dtype of the arithmetic and of the result.

    Returns:
        ``[num_tokens, num_heads, v_dim]`` in ``compute_dtype``.
    """
    reqs, prefixes, lens = map(_as_list, (req_pool_indices, prefix_lens, extend_seq_lens))
    outs = []
    start = 0
    for req, prefix, n in zip(reqs, prefixes, lens):
        locs = req_to_token[req, :prefix].long()
        keys = torch.cat((k_buffer[locs], k[start : start + n])).to(compute_dtype)
        values = torch.cat((v_buffer[locs], v[start : start + n])).to(compute_dtype)
        q_positions = torch.arange(prefix, prefix + n, device=q.device)
        outs.append(
            _attend(q[start : start + n].to(compute_dtype), keys, values, q_positions,
                    scaling, logit_cap, sliding_window_size)
        )
        start += n
    if not outs:
        return q.new_empty((0, q.shape[1], v.shape[2]), dtype=compute_dtype)
    return torch.cat(outs)


def reference_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor | Sequence[int],
    seq_lens: torch.Tensor | Sequence[int],
    scaling: float,
    logit_cap: float = 0.0,
    sliding_window_size: int = -1,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Decode attention: one query per row (at position ``seq_len - 1``) over the pool.

    Args:
        q: ``[batch, num_heads, head_dim]``.
        k_buffer, v_buffer: the pool, holding every position of each row (the new
            token's K/V included) at ``req_to_token[req_pool_indices[i], 0:seq_lens[i]]``.

    Returns:
        ``[batch, num_heads, v_dim]`` in ``compute_dtype``.
    """
    reqs, lens = _as_list(req_pool_indices), _as_list(seq_lens)
    outs = []
    for i, (req, seq_len) in enumerate(zip(reqs, lens)):
        locs = req_to_token[req, :seq_len].long()
        q_positions = torch.tensor([seq_len - 1], device=q.device)
        outs.append(
            _attend(q[i : i + 1].to(compute_dtype), k_buffer[locs].to(compute_dtype),
                    v_buffer[locs].to(compute_dtype), q_positions, scaling, logit_cap,
                    sliding_window_size)
        )
    if not outs:
        return q.new_empty((0, q.shape[1], v_buffer.shape[2]), dtype=compute_dtype)
    return torch.cat(outs)


__all__ = ["reference_decode", "reference_extend"]
