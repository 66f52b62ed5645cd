"""Linear layers of the model SDK, tensor-parallel from the start.

``ColumnParallelLinear`` splits the output dimension across ranks,
``RowParallelLinear`` the input dimension (then all-reduces);
``MergedColumnParallelLinear`` (gate+up) and ``QKVParallelLinear`` hold several
logical weights stacked along the output dimension and load each checkpoint
shard into its place. The weight itself is created and applied by a
``LinearMethodBase`` (unquantized, or a quant plugin's).

A platform may offer a skinny GEMM for the unquantized method: ``Platform.layer_kernels()
['linear']``, called as ``linear(x, weight, bias)`` with a 2-D ``x`` of 1..``linear.max_rows``
rows (default ``DEFAULT_SKINNY_MAX_ROWS``) in bf16/fp16 (``skinny_linear_applies``); decode steps
of few tokens read every weight once, and a kernel made for that streams them faster than a
GEMM library tuned for large products. Every other input goes to ``F.linear``.

Such a kernel may also fold in the ``RMSNorm`` before the layer (norm fusion): it offers
``norm_fusion`` (true), ``takes_norm(x, weight, bias)`` (whether it takes the norm of the 2-D
``x``: device, rows, dtypes) and ``norm_linear(pending, weight, bias)`` (the product of the
norm of a ``PendingNorm``, whose ``normed`` and ``res_sum`` it fills). The norm hands its inputs
on only where ``takes_pending_norm`` says the layer takes them (``RMSNorm.fuse_into``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from engine.layers.layernorm import PendingNorm
from engine.layers.quantization import LinearMethodBase, QuantizationConfig, is_layer_ignored

#: rows up to which a platform's ``linear`` kernel is used when it does not say (``max_rows``).
DEFAULT_SKINNY_MAX_ROWS = 8
_SKINNY_DTYPES = (torch.bfloat16, torch.float16)


def skinny_linear_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          max_rows: int) -> bool:
    """Whether the platform's skinny GEMM takes ``x`` (already flattened to 2-D) times ``weight``:
    1..``max_rows`` rows, bf16 or fp16 throughout, unit stride along K (device aside: the caller
    checks that ``x`` is on the GPU the kernel was built for)."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= max_rows and x.dtype in _SKINNY_DTYPES
            and weight.dim() == 2 and weight.dtype == x.dtype and weight.shape[1] == x.shape[1]
            and x.stride(-1) == 1 and weight.stride(-1) == 1
            and (bias is None or bias.dtype == x.dtype))


def linear_with_kernel(kernel: Any, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: through the platform's skinny GEMM ``kernel`` (None: never)
    where ``skinny_linear_applies`` to ``x`` flattened to 2-D and ``x`` is on the GPU, else
    ``F.linear``. Leading dimensions of ``x`` are kept."""
    if kernel is not None and x.is_cuda:
        x2 = x.reshape(-1, x.shape[-1])
        if skinny_linear_applies(x2, weight, bias, getattr(kernel, "max_rows", DEFAULT_SKINNY_MAX_ROWS)):
            return kernel(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def set_weight_attrs(param: nn.Parameter, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


class UnquantizedLinearMethod(LinearMethodBase):
    """A plain ``[out, in]`` weight in the model dtype."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: Any) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": weight_loader})
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # skinny_linear: set by LinearBase.use_kernels
        if isinstance(x, PendingNorm):
            # The RMSNorm before this layer handed on its inputs (LinearBase.takes_pending_norm):
            # the platform's kernel normalizes them itself.
            y = layer.skinny_linear.norm_linear(x, layer.weight, bias)
            return y.view(*x.shape[:-1], layer.weight.shape[0])
        return linear_with_kernel(getattr(layer, "skinny_linear", None), x, layer.weight, bias)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, quant_config: QuantizationConfig | None,
                 prefix: str, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.prefix = prefix
        self.params_dtype = params_dtype or torch.get_default_dtype()
        method = None
        if quant_config is not None and not is_layer_ignored(prefix, quant_config.ignored_layers()):
            method = quant_config.get_linear_method(self, prefix)
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        #: the platform's skinny GEMM (``layer_kernels()['linear']``), used by the unquantized
        #: method for inputs of few rows; None: always ``F.linear``.
        self.skinny_linear: Any = None
        #: LoRA adapters' slots for this projection (``engine.lora.layers.LoraLayer``), set by the
        #: model runner when LoRA is on: ``lora.forward(self, x, bias)`` computes the layer's product
        #: with the batch's adapters added, before any all-reduce or gather. None: no LoRA.
        self.lora: Any = None

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        """Takes the platform's ``linear`` kernel when it offers one (quantized methods ignore it)."""
        self.skinny_linear = kernels.get("linear")

    def can_fuse_norm(self) -> bool:
        """Whether the RMSNorm before this layer may hand it ``PendingNorm`` inputs (asked once, at
        start-up, by ``quantization.fusion.link_norm_consumers``): the method is the unquantized
        one and the platform's skinny GEMM offers norm fusion."""
        return (isinstance(self.quant_method, UnquantizedLinearMethod) and self.lora is None
                and bool(getattr(self.skinny_linear, "norm_fusion", False)))

    def takes_pending_norm(self, x: torch.Tensor) -> bool:
        """Whether the norm of the 2-D ``x`` goes to this layer unnormalized (asked by the linked
        ``RMSNorm`` on every call): the skinny GEMM's ``takes_norm`` for this weight and bias."""
        return self.can_fuse_norm() and self.skinny_linear.takes_norm(x, self.weight, self.bias)

    def _make_bias(self, size: int) -> None:
        bias = nn.Parameter(torch.empty(size, dtype=self.params_dtype), requires_grad=False)
        set_weight_attrs(bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        self.register_parameter("bias", bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        _copy_into(param, loaded)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.numel() == src.numel() == 1:
        src = src.reshape(dst.shape)  # a scalar scale saved as [] or [1]
    if dst.shape != src.shape:
        raise ValueError(f"weight shape mismatch: parameter {tuple(dst.shape)}, checkpoint {tuple(src.shape)}")
    dst.data.copy_(src)


def _output_slice(param: nn.Parameter, loaded: torch.Tensor, tp_rank: int, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination view, source shard) for a shard at output offset ``start`` of ``size``."""
    dim = getattr(param, "output_dim", None)
    if dim is None:  # per-tensor scalar (e.g. a scale): nothing to slice
        return param.data, loaded
    if getattr(param, "packed_dim", None) == dim:
        factor = param.packed_factor
        start, size = start // factor, size // factor
    dst = param.data.narrow(dim, start, size)
    src = loaded.narrow(dim, tp_rank * size, size) if loaded.shape[dim] != size else loaded
    return dst, src


class ReplicatedLinear(LinearBase):
    """A full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__(input_size, output_size, quant_config, prefix, params_dtype)
        self.quant_method.create_weights(self, input_size, [output_size], input_size, output_size,
                                         self.params_dtype, self.weight_loader)
        if bias:
            self._make_bias(output_size)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output dimension split across tensor-parallel ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", params_dtype: torch.dtype | None = None,
                 output_sizes: list[int] | None = None) -> None:
        super().__init__(input_size, output_size, quant_config, prefix, params_dtype)
        self.gather_output = gather_output
        self.output_sizes = output_sizes or [output_size]
        self.output_partition_sizes = [divide(s, self.tp_size) for s in self.output_sizes]
        self.output_size_per_partition = sum(self.output_partition_sizes)
        self.quant_method.create_weights(self, input_size, self.output_partition_sizes, input_size,
                                         output_size, self.params_dtype, self.weight_loader)
        if bias:
            self._make_bias(self.output_size_per_partition)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        dst, src = _output_slice(param, loaded, self.tp_rank, 0, self.output_size_per_partition)
        _copy_into(dst, src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:
            out = self.lora.forward(self, x, self.bias)  # the layer's product plus the batch's adapters
        else:
            out = self.quant_method.apply(self, x, self.bias)
        return tensor_model_parallel_all_gather(out) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel weights stacked (gate_proj + up_proj -> gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__(input_size, sum(output_sizes), bias, False, quant_config, prefix,
                         params_dtype, output_sizes=output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None or getattr(param, "output_dim", None) is None:
            return self._load_unsharded(param, loaded, shard_id)
        start = sum(self.output_partition_sizes[:shard_id])
        dst, src = _output_slice(param, loaded, self.tp_rank, start, self.output_partition_sizes[shard_id])
        _copy_into(dst, src)

    def _load_unsharded(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        # Per-shard scalars (e.g. one FP8 scale per logical weight) live in a vector.
        if shard_id is not None and param.data.numel() == len(self.output_sizes):
            param.data[shard_id].copy_(loaded.reshape(()))
        else:
            _copy_into(param, loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections stacked; KV heads replicate when fewer than ranks."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // total_num_kv_heads)
        sizes = [self.num_heads * head_size * tp_size, self.num_kv_heads * head_size * tp_size,
                 self.num_kv_heads * head_size * tp_size]
        super().__init__(hidden_size, sum(sizes), bias, False, quant_config, prefix, params_dtype,
                         output_sizes=sizes)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size

    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            return _copy_into(param, loaded)
        idx = self._SHARDS[shard_id]
        if getattr(param, "output_dim", None) is None:
            if param.data.numel() == 3:
                param.data[idx].copy_(loaded.reshape(()))
                return
            return _copy_into(param, loaded)
        start = sum(self.output_partition_sizes[:idx])
        size = self.output_partition_sizes[idx]
        # KV shards are read by head group: ranks sharing a KV head read the same slice.
        rank = self.tp_rank if idx == 0 else self.tp_rank // self.kv_replicas
        dst, src = _output_slice(param, loaded, rank, start, size)
        _copy_into(dst, src)


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; partial outputs are summed."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 input_is_parallel: bool = True, reduce_results: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__(input_size, output_size, quant_config, prefix, params_dtype)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.quant_method.create_weights(self, self.input_size_per_partition, [output_size],
                                         input_size, output_size, self.params_dtype, self.weight_loader)
        if bias:
            self._make_bias(output_size)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is not None and loaded.shape[dim] != param.data.shape[dim]:
            size = param.data.shape[dim]
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        _copy_into(param, loaded)

    def can_fuse_norm(self) -> bool:
        """Never: the input may be split over ranks first and the bias comes after the reduction."""
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        # The bias is added once, after the reduction.
        if self.lora is not None:
            # This rank's share (A sharded by input like the weight): summed by the all-reduce.
            out = self.lora.forward(self, x, None)
        else:
            out = self.quant_method.apply(self, x, None)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
