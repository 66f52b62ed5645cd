"""The scheduler-side runtime: item embeddings cached by hash, a prefill's input embeddings,
and M-RoPE positions for extend and decode rows.

A prefill chunk may cut an item's placeholder run anywhere (chunked prefill, or a cached prefix
that ends inside it): the chunk takes the rows of the item's embedding at the positions it
computes. The item's whole embedding is computed once and kept in ``EmbeddingCache``: pinned
while a request still has chunks to run over it, then evictable, least recently used first,
within the cache's byte budget (the model runner subtracts that budget from the KV pool's).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.layers.forward_batch import ForwardBatch
    from engine.multimodal.items import MultimodalItem

logger = logging.getLogger(__name__)


@dataclass
class RowMultimodal:
    """One extend row's items and the prompt positions ``[start, end)`` it computes."""

    rid: str
    items: list[MultimodalItem]
    start: int
    end: int


class EmbeddingCache:
    """Item embeddings by item hash, within ``budget_bytes`` (pinned entries may exceed it)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._pins: dict[str, set[int]] = {}
        self.bytes = 0
        # Items embedded by the model / served from the cache (server info, tests).
        self.computed = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: int) -> torch.Tensor | None:
        tensor = self._entries.get(key)
        if tensor is not None:
            self._entries.move_to_end(key)
        return tensor

    def put(self, key: int, tensor: torch.Tensor) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= _nbytes(old)
        self._entries[key] = tensor
        self.bytes += _nbytes(tensor)
        self._evict()

    def pin(self, rid: str, key: int) -> None:
        self._pins.setdefault(rid, set()).add(key)

    def release(self, rid: str) -> None:
        """The request's prefill is done, aborted or retracted: its entries become evictable."""
        if self._pins.pop(rid, None) is not None:
            self._evict()

    def pinned(self) -> set[int]:
        return set().union(*self._pins.values()) if self._pins else set()

    def clear(self) -> None:
        keep = self.pinned()
        for key in [k for k in self._entries if k not in keep]:
            self.bytes -= _nbytes(self._entries.pop(key))

    def _evict(self) -> None:
        if self.bytes <= self.budget_bytes:
            return
        keep = self.pinned()
        for key in list(self._entries):
            if self.bytes <= self.budget_bytes:
                break
            if key not in keep:
                self.bytes -= _nbytes(self._entries.pop(key))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def build_input_embeds(model: Any, fb: ForwardBatch, cache: EmbeddingCache) -> torch.Tensor:
    """The batch's input embeddings: text embeddings with every item row this batch computes
    replaced by the item's embedding (items not cached are embedded in one model call)."""
    rows: list[RowMultimodal | None] = fb.mm_rows or []
    embeds = model.get_input_embeddings()(fb.input_ids)
    needed: dict[int, MultimodalItem] = {}
    # This batch's embeddings by hash, held here: putting new ones may evict others from the cache.
    found: dict[int, torch.Tensor] = {}
    for row in rows:
        for item in row.items if row is not None else ():
            if item.offset < row.end and item.end > row.start and item.hash not in found:
                cached = cache.get(item.hash)
                if cached is None:
                    needed.setdefault(item.hash, item)
                else:
                    found[item.hash] = cached
                    cache.hits += 1
    if needed:
        todo = list(needed.values())
        outs = model.embed_multimodal(todo)
        if len(outs) != len(todo):
            raise RuntimeError(f"embed_multimodal returned {len(outs)} tensors for {len(todo)} items")
        for item, out in zip(todo, outs):
            if out.shape[0] != item.length:
                raise RuntimeError(f"embed_multimodal: a {item.modality} with {item.length} placeholder tokens got "
                                   f"an embedding of {out.shape[0]} rows")
            found[item.hash] = out
        cache.computed += len(todo)
    assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
    token_start = 0
    for i, row in enumerate(rows):
        if row is not None:
            for item in row.items:
                lo, hi = max(item.offset, row.start), min(item.end, row.end)
                if lo >= hi:
                    continue
                emb = found[item.hash]
                if hi < item.end:  # the item goes on in a later chunk
                    cache.pin(row.rid, item.hash)
                dst = token_start + lo - row.start
                embeds[dst:dst + hi - lo] = emb[lo - item.offset:hi - item.offset].to(embeds.dtype)
        token_start += fb.extend_seq_lens_cpu[i] if i < len(fb.extend_seq_lens_cpu) else 1
    for key in needed:  # after the pins: an item a later chunk needs is not evicted on arrival
        cache.put(key, found[key])
    return embeds


def row_mrope_positions(prompt_positions: torch.Tensor, delta: int, start: int, end: int) -> torch.Tensor:
    """``[3, end - start]`` positions of a row computing sequence positions ``[start, end)``:
    the prompt's own, then ``i + delta`` past the prompt (output tokens re-run after a retraction,
    or a decode row)."""
    prompt_len = prompt_positions.shape[1]
    parts = []
    if start < prompt_len:
        parts.append(prompt_positions[:, start:min(end, prompt_len)])
    if end > prompt_len:
        tail = torch.arange(max(start, prompt_len), end, dtype=torch.int64) + delta
        parts.append(tail.unsqueeze(0).expand(3, -1))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def attach_extend(fb: ForwardBatch, reqs: list[Any], prefix_lens: list[int], seq_lens: list[int]) -> None:
    """Sets a prefill batch's ``mm_rows`` and, on M-RoPE models, ``mrope_positions`` (rows are
    the batch's extend rows, then its decode rows)."""
    if any(getattr(r, "mm_items", None) for r in reqs):
        fb.mm_rows = [RowMultimodal(r.rid, r.mm_items, p, s) if r.mm_items else None
                      for r, p, s in zip(reqs, prefix_lens, seq_lens)]
    if reqs and reqs[0].mrope_positions is not None:
        parts = [row_mrope_positions(r.mrope_positions, r.mrope_delta, p, s)
                 for r, p, s in zip(reqs, prefix_lens, seq_lens)]
        fb.mrope_positions = torch.cat(parts, dim=1).to(fb.positions.device, non_blocking=True)


def attach_decode(fb: ForwardBatch, reqs: list[Any]) -> None:
    """A decode batch's M-RoPE positions: ``position + delta`` in all three sections."""
    if reqs and reqs[0].mrope_positions is not None:
        delta = torch.tensor([r.mrope_delta for r in reqs], dtype=torch.int64).to(fb.positions.device)
        fb.mrope_positions = (fb.positions + delta).unsqueeze(0).expand(3, -1).contiguous()
