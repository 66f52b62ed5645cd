"""``WNA16LinearMethod``: what the awq, gptq and compressed-tensors methods share.

A format subclass registers the checkpoint's tensors in ``create_weights`` (with
``add_checkpoint_param`` / ``add_per_shard_param``) and reads them back as an ``IntWeight`` in
``read_checkpoint``. This base repacks that into the kernel layout after loading, drops the
checkpoint tensors, and multiplies in ``apply`` — one layout, one forward path for every format.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from engine.errors import ModelLoadError
from engine.layers.quantization import LinearMethodBase
from torch import nn

from engine_quant_wna16.layout import IntWeight, KernelWeight, check_shape, to_kernel_layout, wna16_linear

_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


def shard_index(shard_id: Any) -> int:
    """Position of a fused layer's shard: ``None`` (unfused) 0, ``"q"/"k"/"v"`` 0/1/2, ints as is."""
    if shard_id is None:
        return 0
    return _QKV_SHARDS[shard_id] if isinstance(shard_id, str) else int(shard_id)


def resolve_group_size(group_size: int, bits: int, layer: nn.Module, in_features: int, fmt: str) -> int:
    """The group size on this rank (``-1``: one group over the local input), after checking it
    divides the (local) input: a row-parallel split must keep groups whole."""
    group = in_features if group_size == -1 else group_size
    check_shape(bits, group, in_features, f"{fmt} layer {getattr(layer, 'prefix', '?')}")
    return group


class WNA16LinearMethod(LinearMethodBase):
    """Base of the 4/8-bit weight-only methods (see the module doc)."""

    #: format name for error messages (``awq``, ``gptq``, ``compressed-tensors``).
    format_name: str = ""

    @abstractmethod
    def read_checkpoint(self, layer: nn.Module) -> IntWeight:
        """The loaded checkpoint tensors of ``layer`` as an ``IntWeight`` (codes ``[K, N]``)."""

    # -- parameters ------------------------------------------------------------------
    def add_checkpoint_param(self, layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                             weight_loader: Any, init: torch.Tensor | None = None, **attrs: Any) -> nn.Parameter:
        """Registers one checkpoint tensor, loaded by the layer's own loader (``attrs``:
        ``output_dim``, ``input_dim``, ``packed_dim``, ``packed_factor``). A checkpoint tensor of
        the wrong shape fails with a ``ModelLoadError`` naming the layer and tensor.
        ``init``: values before loading (``--load-format dummy`` leaves integer tensors as they are)."""
        data = torch.empty(shape, dtype=dtype) if init is None else init.to(dtype).expand(shape).clone()
        param = nn.Parameter(data, requires_grad=False)
        for key, value in attrs.items():
            setattr(param, key, value)
        param.weight_loader = self._checked(layer, name, weight_loader)
        layer.register_parameter(name, param)
        layer.wna16_checkpoint_params = [*getattr(layer, "wna16_checkpoint_params", []), name]
        return param

    def add_per_shard_param(self, layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                            num_shards: int, init: torch.Tensor, input_dim: int | None = None) -> nn.Parameter:
        """Registers a tensor the checkpoint stores once per projection without an output dim
        (GPTQ's ``g_idx``, compressed-tensors' ``weight_shape``) as ``[num_shards, *shape]``, so
        a fused layer keeps each shard's copy; ``input_dim`` is split across ranks like the weight."""

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            if input_dim is not None and loaded.shape[input_dim] != shape[input_dim]:
                size = shape[input_dim]
                loaded = loaded.narrow(input_dim, layer.tp_rank * size, size)
            param.data[shard_index(shard_id)].copy_(loaded.reshape(shape))

        param = self.add_checkpoint_param(layer, name, (num_shards, *shape), dtype, load, init=init)
        return param

    def _checked(self, layer: nn.Module, name: str, loader: Any) -> Any:
        fmt, prefix = self.format_name, getattr(layer, "prefix", "?")

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            try:
                if shard_id is None:
                    loader(param, loaded)
                else:
                    loader(param, loaded, shard_id)
            except (ValueError, RuntimeError) as exc:
                shard = "" if shard_id is None else f" (shard {shard_id!r})"
                raise ModelLoadError(f"{fmt} checkpoint tensor {prefix}.{name}{shard} of shape "
                                     f"{tuple(loaded.shape)} does not fit parameter {tuple(param.shape)} "
                                     f"({self.describe()}): {exc}") from None

        return load

    def describe(self) -> str:
        """Settings named in shape errors (``bits=4, group_size=128``)."""
        return ""

    # -- after loading ---------------------------------------------------------------
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        kw = to_kernel_layout(self.read_checkpoint(layer), f"{self.format_name} layer {getattr(layer, 'prefix', '?')}")
        for name in layer.wna16_checkpoint_params:
            delattr(layer, name)
        layer.wna16_checkpoint_params = []
        layer.wna16_qweight = nn.Parameter(kw.qweight, requires_grad=False)
        layer.wna16_scales = nn.Parameter(kw.scales, requires_grad=False)
        layer.wna16_zeros = None if kw.zeros is None else nn.Parameter(kw.zeros, requires_grad=False)
        layer.wna16_perm = None if kw.perm is None else nn.Parameter(kw.perm, requires_grad=False)
        layer.wna16_bits, layer.wna16_group_size = kw.bits, kw.group_size

    @staticmethod
    def kernel_weight(layer: nn.Module) -> KernelWeight:
        """The layer's packed weight (after ``process_weights_after_loading``)."""
        return KernelWeight(layer.wna16_qweight, layer.wna16_scales, layer.wna16_zeros, layer.wna16_perm,
                            layer.wna16_bits, layer.wna16_group_size)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return wna16_linear(x, self.kernel_weight(layer), bias)
