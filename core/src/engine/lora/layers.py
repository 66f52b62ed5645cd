"""LoRA on a model's projections: what each linear layer holds and adds.

The model runner walks the model once (``attach_lora``): every tensor-parallel linear layer whose
name is a LoRA target (``qkv_proj`` for q/k/v, ``gate_up_proj`` for gate/up, ``o_proj``,
``down_proj``, or an unfused ``q_proj``...) gets a ``LoraLayer`` in ``layer.lora``, which the
layer calls on its input and output before any all-reduce or gather (``engine.layers.linear``).
A model class may narrow the targets with ``lora_modules`` (names of its linear layers; the
mixture-of-experts models list their attention projections only). Module names of the model stay
as they were, so checkpoints load unchanged.

Each ``LoraLayer`` holds the device pool's slots for this projection: A ``[slots, n_slices * R,
K]`` and B ``[slots, N, R]`` in this rank's shard, and adds ``shrink``/``expand`` of the batch's
adapters through the LoRA backend. Column-parallel layers keep A whole and shard B by output
like the layer; row-parallel layers shard A by input like the layer and keep B whole, so each
rank's part is summed by the layer's own all-reduce.

Folded shrink: where the backend offers ``fold_expand`` (with ``fold_max_rows`` > 0) and the layer
is unquantized, without a bias added before the reduction, and its slots' A rows are at most
``FOLD_MAX_EXTRA`` of its output rows, A lives under the weight: one buffer ``W' = [W; A]`` whose
first rows are the layer's weight (a view, so checkpoint loads still write into it) and the rest
the slots' A. A batch of ``fold_min_rows`` (the backend's, default 1) to ``fold_max_rows`` tokens
then runs one GEMM ``x @ W'^T`` (the base output and every slot's shrink; the last slot, the base
model's, always rank 0, is left out of it) and the backend's ``fold_expand``; other batches run
the plain GEMM over ``W`` and shrink/expand as before. Row-parallel layers fold too: each rank's
partial shrink expands to a partial output that the all-reduce sums, as without the fold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.lora.backend import LoraBackend, LoraBatchInfo, lora_apply

#: the most extra GEMM rows (slots' A rows) a fold may add, as a share of the layer's output rows.
FOLD_MAX_EXTRA = 0.5

#: fused projection -> the PEFT modules it stacks, in output order.
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class LoraState:
    """What every LoRA layer of one model reads per forward: the backend and the batch's info
    (None when no row of the batch uses an adapter: the layers add nothing)."""

    def __init__(self, backend: LoraBackend) -> None:
        self.backend = backend
        self.batch_info: LoraBatchInfo | None = None


@dataclass
class SliceShard:
    """Where slice ``i`` of a layer (one PEFT module) lies: its rows of the full B, and the
    columns of A, for this rank."""

    peft_name: str
    #: this rank's rows of the full output of this slice: [start, start + size).
    out_start: int
    out_size: int


class LoraLayer(nn.Module):
    """The LoRA slots of one projection, in this rank's shard."""

    def __init__(self, state: LoraState, slices: list[SliceShard], row_parallel: bool, in_full: int,
                 in_start: int, in_size: int, out_full: list[int], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.state = state
        self.slices = slices
        self.row_parallel = row_parallel
        self.in_full, self.in_start, self.in_size = in_full, in_start, in_size
        #: full (unsharded) output size of each slice, for checking adapter shapes.
        self.out_full = out_full
        self.max_rank = max_rank
        offsets = [0]
        for s in slices:
            offsets.append(offsets[-1] + s.out_size)
        self.slice_offsets = offsets
        n = len(slices)
        self.register_buffer("a_buffer", torch.zeros(num_slots, n * max_rank, in_size, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b_buffer", torch.zeros(num_slots, offsets[-1], max_rank, dtype=dtype, device=device),
                             persistent=False)
        #: ``[W; A]`` when the shrink is folded into the base GEMM (``fold_into``), else None.
        self.fold_weight: torch.Tensor | None = None
        self.fold_min_rows, self.fold_max_rows = 1, 0

    def fold_into(self, module: Any, max_rows: int, min_rows: int = 1, gemm_slots: int | None = None) -> bool:
        """Moves the layer's weight and this layer's A slots into one buffer ``[W; A]`` (the
        weight becomes a view of its first rows); False, changing nothing, where the layer does
        not take it: quantized, a bias before the reduction, other dtypes, or more A rows than
        ``FOLD_MAX_EXTRA`` of its output rows. ``gemm_slots``: the GEMM multiplies the first so many
        slots' A (the rest must keep rank 0: the base model's slot); None: all."""
        from engine.layers.linear import UnquantizedLinearMethod, linear_with_kernel

        weight = getattr(module, "weight", None)
        a = self.a_buffer
        if (max_rows <= 0 or not isinstance(module.quant_method, UnquantizedLinearMethod) or weight is None
                or (module.bias is not None and not self.row_parallel) or weight.dim() != 2
                or weight.dtype != a.dtype or weight.device != a.device
                or tuple(weight.shape) != (self.slice_offsets[-1], a.shape[2])):
            return False
        n, extra = weight.shape[0], a.shape[0] * a.shape[1]
        used = a.shape[0] if gemm_slots is None else max(0, min(gemm_slots, a.shape[0]))
        if used * a.shape[1] > FOLD_MAX_EXTRA * n:
            return False
        folded = torch.cat([weight.data, a.reshape(extra, -1)])  # (same dtype and device: checked above)
        weight.data = folded[:n]
        self.a_buffer = folded[n:].view(a.shape)
        self.fold_weight, self.fold_min_rows, self.fold_max_rows = folded, max(1, min_rows), max_rows
        #: the rows the folded GEMM reads: W and the A of the slots that can hold an adapter.
        self.fold_gemm = folded[:n + used * a.shape[1]]
        self._linear = linear_with_kernel  # the layer's own GEMM path (its skinny kernel for few rows)
        return True

    def shard(self, slice_index: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of one slice's full (A [r, in], B [out, r])."""
        s = self.slices[slice_index]
        if self.row_parallel:
            a = a[:, self.in_start:self.in_start + self.in_size]
        else:
            b = b[s.out_start:s.out_start + s.out_size]
        return a, b

    def load_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Writes one adapter's sharded matrices (None: slice not targeted) into ``slot``."""
        a_buf, b_buf = self.a_buffer[slot], self.b_buffer[slot]
        a_buf.zero_()
        b_buf.zero_()
        r_max = self.max_rank
        for i, part in enumerate(parts):
            if part is None:
                continue
            a, b = part
            r = a.shape[0]
            a_buf[i * r_max:i * r_max + r].copy_(a, non_blocking=True)
            lo, hi = self.slice_offsets[i], self.slice_offsets[i + 1]
            b_buf[lo:hi, :r].copy_(b, non_blocking=True)

    def forward(self, module: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The linear layer's output with the batch's adapters: the folded GEMM and
        ``fold_expand`` for a batch of up to ``fold_max_rows`` tokens, else the layer's own
        method and ``apply``. ``bias`` is what the layer adds before any reduction."""
        info = self.state.batch_info
        fold = self.fold_weight
        if info is not None and fold is not None and bias is None:
            x2 = x.reshape(-1, x.shape[-1])
            # (a weight swapped for a new tensor since, e.g. by a weight update, ends the fold)
            rows_ok = self.fold_min_rows <= x2.shape[0] <= self.fold_max_rows
            if rows_ok and module.weight.data_ptr() == fold.data_ptr():
                h = self._linear(module.skinny_linear, x2, self.fold_gemm)
                out = self.state.backend.fold_expand(h, self.b_buffer, info, self.slice_offsets)  # type: ignore[attr-defined]
                return out.view(*x.shape[:-1], out.shape[-1])
        out = module.quant_method.apply(module, x, bias)
        self.apply(x, out)
        return out

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Adds the batch's adapters' ``scaling * (x @ A^T) @ B^T`` to ``out`` in place."""
        info = self.state.batch_info
        if info is None:
            return
        lora_apply(self.state.backend, x.reshape(-1, x.shape[-1]), self.a_buffer, self.b_buffer, info,
                   out.view(-1, out.shape[-1]), self.slice_offsets)


def lora_target_layers(model: nn.Module, targets: set[str]) -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
    """Linear layers of ``model`` that get LoRA: module name -> (layer, PEFT names of its
    slices), for the PEFT names in ``targets``. A layer whose slices are none of ``targets``
    gets nothing."""
    from engine.layers.linear import LinearBase, ReplicatedLinear

    allowed = getattr(model, "lora_modules", None)
    out: dict[str, tuple[nn.Module, tuple[str, ...]]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or isinstance(module, ReplicatedLinear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if allowed is not None and leaf not in allowed:
            continue
        peft_names = STACKED.get(leaf, (leaf,))
        if not set(peft_names) & targets:
            continue
        out[name] = (module, peft_names)
    return out


def build_lora_layer(module: Any, peft_names: tuple[str, ...], state: LoraState, num_slots: int,
                     max_rank: int, dtype: torch.dtype, device: torch.device) -> LoraLayer:
    """The ``LoraLayer`` of one linear layer, shaped by its kind and this rank's shard."""
    from engine.layers.linear import QKVParallelLinear, RowParallelLinear

    tp_rank, tp_size = module.tp_rank, module.tp_size
    if isinstance(module, RowParallelLinear):
        size = module.input_size_per_partition
        slices = [SliceShard(peft_names[0], 0, module.output_size)]
        return LoraLayer(state, slices, True, module.input_size, tp_rank * size, size, [module.output_size],
                         num_slots, max_rank, dtype, device)
    parts = list(module.output_partition_sizes)
    fulls = list(module.output_sizes)
    if len(parts) != len(peft_names):
        raise ValueError(f"{type(module).__name__} has {len(parts)} output slices, LoRA expects {len(peft_names)}")
    slices = []
    for i, (peft, size) in enumerate(zip(peft_names, parts, strict=True)):
        shard_rank = tp_rank
        if isinstance(module, QKVParallelLinear) and i > 0:
            shard_rank = tp_rank // module.kv_replicas  # ranks sharing a KV head read the same rows
            fulls[i] = module.num_kv_heads * module.head_size * max(1, tp_size // module.kv_replicas)
        slices.append(SliceShard(peft, shard_rank * size, size))
    return LoraLayer(state, slices, False, module.input_size, 0, module.input_size, fulls,
                     num_slots, max_rank, dtype, device)


def attach_lora(model: nn.Module, targets: set[str], state: LoraState, num_slots: int, max_rank: int,
                dtype: torch.dtype, device: torch.device,
                release: Callable[[], None] | None = None) -> dict[str, LoraLayer]:
    """Gives every target layer of ``model`` its ``LoraLayer`` (``layer.lora``); returns them by
    the PEFT module path of each slice's parent (``model.layers.0.self_attn``) + layer name.

    ``release`` (the platform's ``empty_cache``) runs after each fold: the weight that ``[W; A]``
    replaced goes back to the device at once. Kept in the allocator's cache, it would take the
    next layers' smaller ``[W; A]`` buffers (best fit), so that at the end most freed weights are
    partly in use and cannot be given back: about 2 GiB held beyond the weights on Llama-3-8B
    with 8 rank-16 slots, which the KV pool did not get."""
    layers: dict[str, LoraLayer] = {}
    fold_rows = int(getattr(state.backend, "fold_max_rows", 0)) if hasattr(state.backend, "fold_expand") else 0
    fold_min = int(getattr(state.backend, "fold_min_rows", 1))
    for name, (module, peft_names) in lora_target_layers(model, targets).items():
        lora = build_lora_layer(module, peft_names, state, num_slots, max_rank, dtype, device)
        # The last slot is the base model's (rank 0 for good): the folded GEMM leaves it out.
        if lora.fold_into(module, fold_rows, fold_min, gemm_slots=num_slots - 1) and release is not None:
            release()
        module.lora = lora
        layers[name] = lora
    return layers
