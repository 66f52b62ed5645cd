"""Block-wise FP8 experts of serialized checkpoints (DeepSeek-V3's ``weight_block_size``).

Each expert's projections arrive as float8_e4m3fn ``weight`` with one float32 multiplier per
``(bn, bk)`` tile (``weight_scale_inv``, or the config's ``block_scale_name``): ``w13_weight``
``[E, 2I, H]`` with ``w13_<scale name>`` ``[E, 2 * ceil(I/bn), ceil(H/bk)]`` (gate's row-blocks,
then up's) and ``w2_weight`` ``[E, H, I]`` with ``w2_<scale name>`` ``[E, ceil(H/bn), ceil(I/bk)]``.
Tensor parallelism splits every expert's intermediate features, so each rank's share must be a
whole number of blocks. ``apply`` runs the torch reference on every device: each expert a batch
routes to is dequantized (codes times their tile's scale, in float32, cast once to the
activation dtype) and runs as the unquantized reference does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.quantization import FusedMoEMethodBase
from engine_quant_fp8.quantize import FP8_DTYPE, dequantize_per_block


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8BlockMoEMethod(FusedMoEMethodBase):
    """Serialized block-wise FP8 experts, dequantized per routed expert at run time."""

    def __init__(self, block_size: tuple[int, int], scale_name: str = "weight_scale_inv") -> None:
        self.block_size = block_size
        self.scale_name = scale_name

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: Any) -> None:
        bn, bk = self.block_size
        inter = intermediate_size_per_partition
        if getattr(layer, "moe_tp_size", 1) > 1 and (inter % bn or inter % bk):
            raise ModelLoadError(f"fp8 weight_block_size [{bn}, {bk}]: each rank holds {inter} intermediate features "
                                 f"of every expert; block-wise experts need a multiple of the block per rank "
                                 "(lower --tp-size or raise --ep-size)")
        w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=FP8_DTYPE), requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=FP8_DTYPE), requires_grad=False)
        s13 = nn.Parameter(torch.empty(num_experts, 2 * _cdiv(inter, bn), _cdiv(hidden_size, bk), dtype=torch.float32),
                           requires_grad=False)
        s2 = nn.Parameter(torch.empty(num_experts, _cdiv(hidden_size, bn), _cdiv(inter, bk), dtype=torch.float32),
                          requires_grad=False)
        w13.weight_loader = w2.weight_loader = weight_loader
        s13.weight_loader = s2.weight_loader = self._scale_loader(layer)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)
        layer.register_parameter(f"w13_{self.scale_name}", s13)
        layer.register_parameter(f"w2_{self.scale_name}", s2)

    def _scale_loader(self, layer: nn.Module) -> Any:
        bn, bk = self.block_size

        def load(param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard_id: str) -> None:
            """Expert ``expert_id``'s full scale grid -> this rank's blocks of its features."""
            local = expert_id - layer.expert_start
            if not 0 <= local < layer.num_local_experts:
                return
            inter = layer.intermediate_size_per_partition
            if shard_id == "w2":
                cols = _cdiv(inter, bk)
                src = loaded.narrow(1, layer.moe_tp_rank * inter // bk, cols) if loaded.shape[1] != cols else loaded
                dst = param.data[local]
            elif shard_id in ("w1", "w3"):
                rows = _cdiv(inter, bn)
                src = loaded.narrow(0, layer.moe_tp_rank * inter // bn, rows) if loaded.shape[0] != rows else loaded
                dst = param.data[local].narrow(0, 0 if shard_id == "w1" else rows, rows)
            else:
                raise ValueError(f"Fp8BlockMoEMethod: unknown expert shard '{shard_id}'; accepted: w1, w3, w2")
            if dst.shape != src.shape:
                raise ModelLoadError(f"fp8 block scale of expert {expert_id} ({shard_id}): shape {tuple(src.shape)}, "
                                     f"expected {tuple(dst.shape)} for weight_block_size [{bn}, {bk}]")
            dst.copy_(src)

        return load

    def init_dummy_weights(self, layer: nn.Module, seed: int) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            param.data.copy_((torch.randn(param.shape, generator=gen) * 0.5).to(FP8_DTYPE))
        for name in (f"w13_{self.scale_name}", f"w2_{self.scale_name}"):
            getattr(layer, name).data.fill_(0.02)

    def _expert(self, layer: nn.Module, name: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        weight = getattr(layer, f"{name}_weight")[expert]
        scale = getattr(layer, f"{name}_{self.scale_name}")[expert]
        if name == "w13":
            # Gate and up each start on a row-block of their own.
            inter = weight.shape[0] // 2
            rows = scale.shape[0] // 2
            return torch.cat([dequantize_per_block(weight[:inter], scale[:rows], self.block_size, dtype),
                              dequantize_per_block(weight[inter:], scale[rows:], self.block_size, dtype)])
        return dequantize_per_block(weight, scale, self.block_size, dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        inter = layer.w2_weight.shape[-1]
        for expert in torch.unique(topk_ids).tolist():
            if expert < 0:
                continue  # held by another expert-parallel rank
            tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
            gate_up = x[tokens] @ self._expert(layer, "w13", expert, x.dtype).t()
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            down = act @ self._expert(layer, "w2", expert, x.dtype).t()
            out.index_add_(0, tokens, down * topk_weights[tokens, slots, None].to(x.dtype))
        return out
