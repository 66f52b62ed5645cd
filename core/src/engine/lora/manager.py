"""``LoraManager``: the loaded adapters (host memory), the device slot pool and each forward's
``LoraBatchInfo``. One per scheduler rank, owned by the model runner.

- Host: every loaded adapter's matrices, already in this rank's shard, keyed by a load id
  (``uid``): a name unloaded and loaded again is a new adapter (its KV in the prefix cache is
  not the old one's).
- Device: ``--max-loras-per-batch`` slots in every LoRA layer, plus one last slot of rank 0
  for the base model. An adapter a batch needs is copied into a slot not used by that batch,
  the least recently used first.
- Per forward: the batch's rows grouped into segments of consecutive rows on one slot. Decode
  batches get one segment per row in static buffers, so a captured CUDA graph's replay reads
  the current batch's slots from the same memory.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.lora.adapter import LoraAdapterError, LoraWeights, load_adapter
from engine.lora.backend import LoraBackend, LoraBatchInfo
from engine.lora.layers import LoraLayer, LoraState, attach_lora

logger = logging.getLogger(__name__)


@dataclass
class HostAdapter:
    uid: int
    name: str
    path: str
    rank: int
    scaling: float
    #: per LoRA layer name: per slice, this rank's (A, B) or None (slice not targeted).
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]


class LoraManager:
    def __init__(self, model: Any, backend: LoraBackend, targets: set[str], max_rank: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device, layer_range: tuple[int, int],
                 release: Callable[[], None] | None = None) -> None:
        self.state = LoraState(backend)
        self.targets = set(targets)
        self.max_rank = max_rank
        self.num_slots = num_slots
        self.base_slot = num_slots  # the extra, always-empty slot of base-model rows
        self.dtype, self.device = dtype, device
        #: decoder layers on this rank's pipeline stage: [start, end).
        self.layer_range = layer_range
        self.layers: dict[str, LoraLayer] = attach_lora(model, self.targets, self.state, num_slots + 1,
                                                         max_rank, dtype, device, release)
        if not self.layers:
            raise LoraAdapterError(f"--lora-target-modules {' '.join(sorted(targets))}: the model has no such "
                                   "projection that takes LoRA weights")
        # PEFT module path of each slice -> (LoRA layer name, slice index).
        self.slice_of: dict[str, tuple[str, int]] = {}
        for name, layer in self.layers.items():
            parent = name.rsplit(".", 1)[0]
            for i, s in enumerate(layer.slices):
                self.slice_of[f"{parent}.{s.peft_name}"] = (name, i)
        self.adapters: dict[int, HostAdapter] = {}
        self._next_uid = 1
        #: slot -> uid held (None: empty), and uids by recency of use (oldest first).
        self.slot_uid: list[int | None] = [None] * num_slots
        self.recent: OrderedDict[int, None] = OrderedDict()
        self.ranks = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
        self.scalings = torch.zeros(num_slots + 1, dtype=torch.float32, device=device)
        self._static: dict[str, torch.Tensor] = {}

    # -- host adapters ---------------------------------------------------------------
    def load(self, name: str, path: str) -> HostAdapter:
        """Reads, checks and shards an adapter; returns it under a new uid."""
        weights = load_adapter(name, path, self.dtype)
        adapter = self._shard(weights)
        self.adapters[adapter.uid] = adapter
        return adapter

    def _shard(self, w: LoraWeights) -> HostAdapter:
        cfg = w.config
        if cfg.rank > self.max_rank:
            raise LoraAdapterError(f"lora_path {w.path!r} (adapter {w.name!r}): r {cfg.rank} exceeds --max-lora-rank "
                                   f"{self.max_rank}; accepted: r <= {self.max_rank} (raise --max-lora-rank)")
        outside = sorted(cfg.target_modules - self.targets)
        if outside:
            raise LoraAdapterError(f"lora_path {w.path!r} (adapter {w.name!r}): target module {outside[0]} is not enabled; "
                                   f"accepted: {', '.join(sorted(self.targets))} (--lora-target-modules)")
        parts: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        for module, (a, b) in w.weights.items():
            where = self.slice_of.get(module)
            if where is None:
                self._check_absent(w, module)
                continue  # a layer of another pipeline stage
            layer_name, i = where
            layer = self.layers[layer_name]
            want_a, want_b = (cfg.rank, layer.in_full), (layer.out_full[i], cfg.rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise LoraAdapterError(f"lora_path {w.path!r} (adapter {w.name!r}): {module} has lora_A {tuple(a.shape)} and "
                                       f"lora_B {tuple(b.shape)}; the base model needs {want_a} and {want_b}")
            parts.setdefault(layer_name, [None] * len(layer.slices))[i] = layer.shard(i, a, b)
        uid = self._next_uid
        self._next_uid += 1
        return HostAdapter(uid, w.name, w.path, cfg.rank, cfg.scaling, parts)

    def _check_absent(self, w: LoraWeights, module: str) -> None:
        """A module no LoRA layer of this rank holds: fine on a layer of another pipeline stage,
        else refused (an adapter of another model, or a projection this model serves without
        LoRA, such as a mixture-of-experts model's experts)."""
        import re

        match = re.search(r"\.layers\.(\d+)\.", module)
        start, end = self.layer_range
        if match is not None and not start <= int(match.group(1)) < end:
            return
        served = sorted({s.peft_name for layer in self.layers.values() for s in layer.slices})
        raise LoraAdapterError(f"lora_path {w.path!r} (adapter {w.name!r}): module {module} takes no LoRA weights in this "
                               f"model; accepted: {', '.join(served)} of its decoder layers")

    def unload(self, uid: int) -> None:
        """Drops a host adapter and frees its slot."""
        self.adapters.pop(uid, None)
        self.recent.pop(uid, None)
        for slot, held in enumerate(self.slot_uid):
            if held == uid:
                self.slot_uid[slot] = None
                self.ranks[slot] = 0

    # -- device slots ------------------------------------------------------------------
    def _slots_for(self, uids: list[int]) -> dict[int, int]:
        """Slot of each uid, copying adapters in (least recently used slot first, never one
        the batch needs)."""
        needed = set(uids)
        if len(needed) > self.num_slots:
            raise RuntimeError(f"a batch uses {len(needed)} adapters; --max-loras-per-batch is {self.num_slots}")
        where = {uid: slot for slot, uid in enumerate(self.slot_uid) if uid in needed}
        for uid in uids:
            if uid in where:
                continue
            slot = self._free_slot(needed)
            self._copy_in(uid, slot)
            where[uid] = slot
        for uid in uids:
            self.recent.pop(uid, None)
            self.recent[uid] = None
        return where

    def _free_slot(self, needed: set[int]) -> int:
        for slot, uid in enumerate(self.slot_uid):
            if uid is None:
                return slot
        for uid in self.recent:  # oldest first
            if uid not in needed and uid in self.slot_uid:
                return self.slot_uid.index(uid)
        raise RuntimeError("no LoRA slot is free")  # the scheduler admits at most num_slots adapters

    def _copy_in(self, uid: int, slot: int) -> None:
        adapter = self.adapters[uid]
        for name, layer in self.layers.items():
            layer.load_slot(slot, adapter.parts.get(name, [None] * len(layer.slices)))
        self.slot_uid[slot] = uid
        self.ranks[slot] = adapter.rank
        self.scalings[slot] = adapter.scaling

    # -- per forward ----------------------------------------------------------------------
    def prepare(self, lora_uids: list[int | None] | None, rows_tokens: list[int], graph: bool = False) -> None:
        """Sets the batch info every LoRA layer reads for this forward: ``lora_uids`` per row
        (None: base model; the list None: every row is), ``rows_tokens`` the new tokens of each
        row. ``graph``: a decode step replayed from a CUDA graph, whose info is the static buffers."""
        uids = [u for u in (lora_uids or []) if u is not None]
        if not uids and not graph:
            self.state.batch_info = None
            return
        where = self._slots_for(list(dict.fromkeys(uids)))
        slots = [self.base_slot if u is None else where[u] for u in (lora_uids or [None] * len(rows_tokens))]
        if graph:
            self.state.batch_info = self._decode_info(slots)
            return
        seg_slots: list[int] = []
        indptr = [0]
        for slot, n in zip(slots, rows_tokens, strict=True):
            if seg_slots and seg_slots[-1] == slot:
                indptr[-1] += n
            else:
                seg_slots.append(slot)
                indptr.append(indptr[-1] + n)
        lens = [b - a for a, b in zip(indptr[:-1], indptr[1:], strict=True)]
        self.state.batch_info = LoraBatchInfo(
            num_segments=len(seg_slots),
            seg_indptr=torch.tensor(indptr, dtype=torch.int32).to(self.device, non_blocking=True),
            weight_indices=torch.tensor(seg_slots, dtype=torch.int32).to(self.device, non_blocking=True),
            lora_ranks=self.ranks, scalings=self.scalings, max_seg_len=max(lens, default=0))

    def static_rows(self, rows: int) -> None:
        """Sizes the decode buffers for batches of up to ``rows`` (before any graph is captured:
        a captured graph keeps reading the buffers it was captured with)."""
        self._static["indptr"] = torch.arange(rows + 1, dtype=torch.int32, device=self.device)
        self._static["indices"] = torch.full((rows,), self.base_slot, dtype=torch.int32, device=self.device)

    def _decode_info(self, slots: list[int]) -> LoraBatchInfo:
        bs = len(slots)
        if "indices" not in self._static or self._static["indices"].numel() < bs:
            self.static_rows(bs)
        indptr, indices = self._static["indptr"], self._static["indices"]
        # Rows past this batch (a graph's padding) read the base slot, never a stale adapter.
        indices[bs:].fill_(self.base_slot)
        indices[:bs].copy_(torch.tensor(slots, dtype=torch.int32), non_blocking=True)
        return LoraBatchInfo(num_segments=bs, seg_indptr=indptr[:bs + 1], weight_indices=indices[:bs],
                             lora_ranks=self.ranks, scalings=self.scalings, max_seg_len=1, one_token_segments=True)

    def static_info(self, bs: int) -> LoraBatchInfo:
        """The info a decode graph of ``bs`` rows runs on: views of the static buffers, as the
        last ``prepare(graph=True)`` filled them (all rows on the base slot before any)."""
        if "indices" not in self._static or self._static["indices"].numel() < bs:
            self.static_rows(bs)
        return LoraBatchInfo(num_segments=bs, seg_indptr=self._static["indptr"][:bs + 1],
                             weight_indices=self._static["indices"][:bs], lora_ranks=self.ranks,
                             scalings=self.scalings, max_seg_len=1, one_token_segments=True)
