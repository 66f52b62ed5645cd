"""``CompressedTensorsWNA16Method``: pack-quantized int weights on the wna16 kernels."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from engine.errors import ModelLoadError
from engine_quant_wna16.method import WNA16LinearMethod, resolve_group_size

from engine_quant_compressed_tensors.format import unpack_compressed

if TYPE_CHECKING:
    from engine_quant_wna16.layout import IntWeight
    from torch import nn

    from engine_quant_compressed_tensors.config import IntScheme


class CompressedTensorsWNA16Method(WNA16LinearMethod):
    """Loads ``weight_packed``/``weight_scale``/``weight_zero_point``/``weight_shape`` (and
    ``weight_g_idx``) as stored (see ``engine_quant_compressed_tensors.format``)."""

    format_name = "compressed-tensors"

    def __init__(self, scheme: IntScheme) -> None:
        self.scheme = scheme

    def describe(self) -> str:
        s = self.scheme
        return f"num_bits={s.num_bits}, group_size={s.group_size}, symmetric={s.symmetric}"

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: Any) -> None:
        s = self.scheme
        per_word = 32 // s.num_bits
        k, n = input_size_per_partition, sum(output_partition_sizes)
        if k % per_word:
            raise ModelLoadError(f"compressed-tensors layer {layer.prefix}: input size {k} is not a multiple of {per_word}")
        if not s.symmetric and any(size % per_word for size in output_partition_sizes):
            raise ModelLoadError(f"compressed-tensors layer {layer.prefix}: output sizes {output_partition_sizes} are "
                                 f"not multiples of {per_word}, which the packed zero points need")
        if s.has_g_idx and input_size_per_partition != input_size:
            raise ModelLoadError(f"compressed-tensors actorder 'group' with tensor parallelism splits groups across "
                                 f"ranks in {layer.prefix}; accepted: --tp 1")
        group = resolve_group_size(s.group_size, s.num_bits, layer, k, "compressed-tensors")
        layer.wna16_group, layer.wna16_out_features = group, n
        split = {"input_dim": 1} if s.group_size != -1 else {}
        self.add_checkpoint_param(layer, "weight_packed", (n, k // per_word), torch.int32, weight_loader,
                                  output_dim=0, input_dim=1, packed_dim=1, packed_factor=per_word)
        # float32 holds any checkpoint scale dtype exactly; narrowed after loading where lossless.
        self.add_checkpoint_param(layer, "weight_scale", (n, k // group), torch.float32, weight_loader,
                                  output_dim=0, **split)
        if not s.symmetric:
            self.add_checkpoint_param(layer, "weight_zero_point", (n // per_word, k // group), torch.int32,
                                      weight_loader, output_dim=0, packed_dim=0, packed_factor=per_word, **split)
        shards = len(output_partition_sizes)
        # Set to what the layer expects, so --load-format dummy (no int data written) passes the check.
        expected = torch.tensor([[size * layer.tp_size, input_size] for size in output_partition_sizes])
        self.add_per_shard_param(layer, "weight_shape", (2,), torch.int64, shards, expected)
        if s.has_g_idx:
            plain = (torch.arange(k) // group).to(torch.int32)
            self.add_per_shard_param(layer, "weight_g_idx", (k,), torch.int32, shards, plain, input_dim=0)

    def read_checkpoint(self, layer: nn.Module) -> IntWeight:
        s = self.scheme
        shapes = layer.weight_shape.data.cpu()
        if bool((shapes[:, 1] != layer.input_size).any()) or (
                layer.tp_size == 1 and shapes[:, 0].sum().item() != layer.wna16_out_features):
            raise ModelLoadError(f"compressed-tensors layer {layer.prefix}: weight_shape {shapes.tolist()} does not match "
                                 f"the layer ({layer.wna16_out_features} outputs over its shards, {layer.input_size} inputs)")
        g_idx = None
        if s.has_g_idx:
            g_idx = layer.weight_g_idx.data[0]
            if not all(bool(torch.equal(g_idx, other)) for other in layer.weight_g_idx.data[1:]):
                raise ModelLoadError(f"compressed-tensors layer {layer.prefix}: the fused projections' weight_g_idx "
                                     "differ; one fused weight needs one input-channel order")
        zero_point = layer.weight_zero_point.data if not s.symmetric else None
        return unpack_compressed(layer.weight_packed.data, layer.weight_scale.data, zero_point, g_idx,
                                 s.num_bits, layer.wna16_group)
