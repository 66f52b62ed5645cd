"""``GGUFLinearMethod``: one linear layer whose weight stays in GGUF blocks.

The GGML type of a tensor is known only when it loads, and the shards of a fused layer
(q/k/v, gate/up) may differ (llama.cpp's Q4_K_M stores some ``attn_v``/``ffn_down`` in Q6_K). So
``create_weights`` registers two things whose shapes do not depend on the type:

- ``weight_type``: ``int32 [shards]``, the GGML type of each shard, loaded like a per-shard scale
  (the checkpoint tensor ``<proj>.weight_type``);
- ``weight``: a placeholder whose loader takes each shard's tensor as it comes: blocks
  ``uint8 [rows, row_bytes]`` of a kept type, or a float tensor (F32/F16/BF16), or blocks of any
  other type, which are dequantized there and then (``gguf.quants.dequantize``) and logged.

Each shard is cut to this tensor-parallel rank by the layer's own loader (rows, and for row-parallel
layers whole blocks of the input), and held on the device. ``process_weights_after_loading``
stacks neighbouring shards of one type into a *segment* (one block tensor per type run; float
shards into a float segment); the forward multiplies each segment into its columns of one output
tensor. A layer whose shards all share a type is one segment: one kernel launch.
"""

from __future__ import annotations

import logging
import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from engine.errors import ModelLoadError
from engine.layers.quantization import LinearMethodBase
from torch import nn

from engine_quant_gguf import cpu_kernels, formats

if TYPE_CHECKING:
    from engine_quant_gguf.config import GGUFConfig

logger = logging.getLogger(__name__)

_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


def _index(shard_id: Any) -> int:
    return 0 if shard_id is None else _SHARD_INDEX.get(shard_id, shard_id)


def _where(layer: nn.Module, idx: int) -> str:
    prefix = getattr(layer, "prefix", "") or type(layer).__name__
    return prefix if len(layer.gguf_shard_rows) == 1 else f"{prefix} (shard {idx})"


class GGUFLinearMethod(LinearMethodBase):
    """GGUF blocks in memory (on CUDA regrouped by ``formats.pack``); Triton kernels on CUDA,
    dequantize + ``F.linear`` elsewhere."""

    #: the model loader hands this layer raw GGUF blocks (see ``GGUFConfig.loads_gguf_blocks``).
    accepts_gguf_blocks = True

    def __init__(self, config: GGUFConfig) -> None:
        self.config = config

    # -- parameters ---------------------------------------------------------------------
    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: Any) -> None:
        layer.gguf_shard_rows = list(output_partition_sizes)
        layer.gguf_in_features = input_size_per_partition
        layer.gguf_dtype = params_dtype
        layer.gguf_shards = {}    # shard index -> (GGML type or None for float, tensor on the device)
        layer.gguf_pending = {}   # shard index -> (tensor, shard_id) that came before its type
        layer.gguf_types = {}     # shard index -> GGML type, as loaded
        layer.gguf_segments = []  # after loading: (GGML type or None, first column, columns, param name)
        n = len(output_partition_sizes)
        weight_type = nn.Parameter(torch.full((n,), -1, dtype=torch.int32), requires_grad=False)
        weight_type.weight_loader = self._type_loader(layer, weight_loader)
        layer.register_parameter("weight_type", weight_type)
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        weight.output_dim, weight.input_dim = 0, 1
        weight.weight_loader = self._weight_loader(layer, weight_loader)
        layer.register_parameter("weight", weight)

    def _type_loader(self, layer: nn.Module, layer_loader: Any) -> Any:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            loaded = loaded.reshape(1).to(torch.int32)
            if shard_id is None:
                layer_loader(param, loaded)
            else:
                layer_loader(param, loaded, shard_id)
            idx = _index(shard_id)
            layer.gguf_types[idx] = int(loaded.item())
            if idx in layer.gguf_pending:
                tensor, sid = layer.gguf_pending.pop(idx)
                self._place(layer, idx, sid, tensor)
        return load

    def _weight_loader(self, layer: nn.Module, layer_loader: Any) -> Any:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            idx = _index(shard_id)
            if idx in layer.gguf_types:
                self._place(layer, idx, shard_id, loaded)
            else:  # its weight_type comes later (a checkpoint's tensors in name order)
                layer.gguf_pending[idx] = (loaded, shard_id)
        layer.gguf_layer_loader = layer_loader
        return load

    def _place(self, layer: nn.Module, idx: int, shard_id: Any, loaded: torch.Tensor) -> None:
        """Turns a shard's checkpoint tensor into this rank's rows, kept or dequantized."""
        qtype = layer.gguf_types[idx]
        where = _where(layer, idx)
        if qtype in formats.KEPT:
            if loaded.dtype != torch.uint8 or loaded.dim() != 2:
                raise ModelLoadError(f"{where}: GGUF {formats.type_name(qtype)} weight must be uint8 blocks "
                                     f"[rows, row_bytes]; got {loaded.dtype} {tuple(loaded.shape)}")
            try:
                width = formats.row_bytes(qtype, layer.gguf_in_features)
            except ValueError as exc:
                raise ModelLoadError(f"{where}: cannot keep this rank's {layer.gguf_in_features} inputs "
                                     f"in {formats.type_name(qtype)}: {exc}") from None
            dtype = torch.uint8
        else:
            loaded = self._dequantize_other(loaded, qtype, where)
            width, dtype, qtype = layer.gguf_in_features, loaded.dtype, None
        rows = layer.gguf_shard_rows
        # The layer's own loader places the shard (tensor-parallel cut included) in a full-size
        # scratch parameter of this type's width; this shard's rows are then taken out of it.
        scratch = nn.Parameter(torch.empty(sum(rows), width, dtype=dtype, device=layer.weight.device),
                               requires_grad=False)
        scratch.output_dim, scratch.input_dim = 0, 1
        try:
            if shard_id is None:
                layer.gguf_layer_loader(scratch, loaded)
            else:
                layer.gguf_layer_loader(scratch, loaded, shard_id)
        except ValueError as exc:
            raise ModelLoadError(f"{where}: {exc}") from None
        start = sum(rows[:idx])
        layer.gguf_shards[idx] = (qtype, scratch.data[start:start + rows[idx]].clone())

    def _dequantize_other(self, loaded: torch.Tensor, qtype: int, where: str) -> torch.Tensor:
        """A float shard as is; blocks of a type without a kernel dequantized (logged)."""
        if loaded.dtype != torch.uint8:
            return loaded
        try:
            import gguf
            import numpy as np

            dense = gguf.quants.dequantize(loaded.cpu().numpy(), gguf.GGMLQuantizationType(qtype))
        except (NotImplementedError, ValueError, KeyError) as exc:
            raise ModelLoadError(
                f"{where}: GGUF type {formats.type_name(qtype)} can neither be kept (the gguf plugin keeps "
                f"{', '.join(formats.KEPT_NAMES.values())}) nor dequantized by the gguf package ({exc})") from None
        self.config.fallback[f"{formats.type_name(qtype)} dequantized"] += 1
        logger.info("%s: GGUF type %s has no kernel here; dequantized at load", where, formats.type_name(qtype))
        return torch.from_numpy(np.ascontiguousarray(dense))

    def init_dummy_weights(self, layer: nn.Module, seed: int) -> None:
        """``--load-format dummy``: random well-formed blocks of ``gguf.dummy_type`` in every shard."""
        qtype = self.config.dummy_type
        if qtype is None:
            raise ModelLoadError("--load-format dummy with --quant gguf needs the block type: "
                                 "--plugin-option gguf.dummy_type=TYPE (accepted: "
                                 f"{', '.join(formats.KEPT_NAMES.values())})")
        device = layer.weight.device
        gen = torch.Generator(device=device).manual_seed(seed + zlib.crc32(str(layer.prefix).encode()))
        for idx, rows in enumerate(layer.gguf_shard_rows):
            try:
                blocks = formats.random_blocks(rows, layer.gguf_in_features, qtype, gen, device)
            except ValueError as exc:
                raise ModelLoadError(f"--plugin-option gguf.dummy_type={formats.type_name(qtype)}: "
                                     f"{_where(layer, idx)}: {exc}") from None
            layer.gguf_types[idx] = qtype
            layer.gguf_shards[idx] = (qtype, blocks)
            layer.weight_type.data[idx] = qtype

    # -- after loading ------------------------------------------------------------------
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        rows = layer.gguf_shard_rows
        for idx in range(len(rows)):
            if idx not in layer.gguf_shards:
                what = "its blocks" if idx in layer.gguf_types else "its weight_type"
                raise ModelLoadError(f"{_where(layer, idx)}: no {what} loaded; the gguf method loads GGUF "
                                     "checkpoints (a weight and its GGML weight_type per projection)")
        segments: list[tuple[int | None, list[torch.Tensor], int]] = []  # (type, tensors, first column)
        col = 0
        for idx in range(len(rows)):
            qtype, tensor = layer.gguf_shards[idx]
            if segments and segments[-1][0] == qtype:
                segments[-1][1].append(tensor)
            else:
                segments.append((qtype, [tensor], col))
            col += rows[idx]
        del layer.weight
        layer.gguf_segments = []
        elem = torch.empty(0, dtype=layer.gguf_dtype).element_size()
        for i, (qtype, tensors, first) in enumerate(segments):
            data = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
            name = "weight" if len(segments) == 1 else f"weight_{i}"
            if qtype is None:
                data = data.to(layer.gguf_dtype)
                self.config.float_bytes += data.numel() * data.element_size()
            else:
                if data.is_cuda:  # the CUDA kernels' layout: the same bytes regrouped (formats.pack)
                    data = formats.pack(data, qtype)
                self.config.kept_bytes[qtype] += data.numel()
            self.config.dequantized_bytes += data.shape[0] * layer.gguf_in_features * elem
            layer.register_parameter(name, nn.Parameter(data, requires_grad=False))
            layer.gguf_segments.append((qtype, first, data.shape[0], name))
        if len(segments) > 1:
            self.config.fallback["fused layers of mixed types"] += 1
        layer.gguf_shards, layer.gguf_pending = {}, {}

    # -- forward ------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        segments = layer.gguf_segments
        if len(segments) == 1 and segments[0][0] is None:
            return F.linear(x, layer.weight, bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        n = sum(s[2] for s in segments)
        out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
        for qtype, first, cols, name in segments:
            w = getattr(layer, name)
            if qtype is None:
                out[:, first:first + cols] = F.linear(x2, w)
            elif w.is_cuda:  # packed at load (formats.pack)
                from engine_quant_gguf.kernels import gguf_matmul

                gguf_matmul(x2, w, qtype, cols, out=out, col0=first)
            elif qtype in cpu_kernels.CPU_TYPES and x.dtype == torch.float32:
                self._cpu_matmul(layer, name, x2, w, qtype, out, first)
            else:  # the reference path: unpack, dequantize, multiply
                out[:, first:first + cols] = F.linear(x2, formats.dequantize(w, qtype).to(x.dtype))
        if bias is not None:
            out += bias
        return out.reshape(*lead, n)

    @staticmethod
    def _cpu_matmul(layer: nn.Module, name: str, x2: torch.Tensor, w: torch.Tensor, qtype: int,
                    out: torch.Tensor, first: int) -> None:
        """One segment on the CPU, into its columns of ``out``."""
        cols = slice(first, first + w.shape[0])
        if not cpu_kernels.available():
            # No C compiler: the blocks are dequantized once and kept as float32, as without the
            # plugin (dequantizing on every call would make a CPU default slower than that).
            dense = layer.__dict__.setdefault("gguf_cpu_dense", {})
            if name not in dense:
                dense[name] = formats.dequantize(w, qtype)
            out[:, cols] = F.linear(x2, dense[name])
        elif x2.shape[0] <= cpu_kernels.MAX_FUSED_ROWS:  # decode: each block read once
            cpu_kernels.matmul(x2, w, qtype, out, first)
        else:
            out[:, cols] = F.linear(x2, cpu_kernels.dequantize(w, qtype, x2.shape[1]))
