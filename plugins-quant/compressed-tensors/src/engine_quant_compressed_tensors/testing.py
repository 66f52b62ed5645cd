"""Test fixtures for compressed-tensors checkpoints: quantization_config dicts as llm-compressor
writes them, and the compressed-tensors library (imported lazily; a test-only dependency) as an
independent packer."""

from __future__ import annotations

from typing import Any

import torch
from engine_quant_compressed_tensors.format import pack_compressed
from engine_quant_wna16.layout import IntWeight


def int_config(bits: int, group_size: int, symmetric: bool, actorder: str | None = None,
               ignore: tuple[str, ...] = ("lm_head",)) -> dict[str, Any]:
    """A W4A16/W8A16 ``quantization_config`` as llm-compressor writes it."""
    weights: dict[str, Any] = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False,
                               "strategy": "channel" if group_size == -1 else "group",
                               "group_size": None if group_size == -1 else group_size}
    if actorder:
        weights["actorder"] = actorder
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": list(ignore), "kv_cache_scheme": None, "global_compression_ratio": None}


def fp8_config(strategy: str, dynamic: bool | None, block: tuple[int, int] | None = None) -> dict[str, Any]:
    """An FP8 ``float-quantized`` config (``dynamic`` None: no input quantization)."""
    weights: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
    if block:
        weights["block_structure"] = list(block)
    inputs = None if dynamic is None else {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": dynamic,
                                            "strategy": "token" if dynamic else "tensor"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None, "format": "float-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def library_scheme(w: IntWeight) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    channel = w.group_size == w.codes.shape[0]
    args = QuantizationArgs(num_bits=w.bits, type="int", symmetric=w.zeros is None,
                            strategy="channel" if channel else "group", group_size=None if channel else w.group_size)
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def library_pack(w: IntWeight) -> dict[str, torch.Tensor]:
    """compressed-tensors' own compressor on ``w``'s dequantized weight, scales and zero points:
    the independent packer. (The weight lies on the grid, so its rounding finds ``w``'s codes.)"""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    state = {"weight": w.dequantize(), "weight_scale": w.scales.t().float().contiguous()}
    if w.zeros is not None:
        # The library's zero points are signed (codes offset by -2**(bits-1)).
        state["weight_zero_point"] = (w.zeros.t() - (1 << (w.bits - 1))).to(torch.int8).contiguous()
    return dict(PackedQuantizationCompressor.compress(state, library_scheme(w)))


def library_unpack(tensors: dict[str, torch.Tensor], w: IntWeight) -> torch.Tensor:
    """The library's decompression: the dequantized weight ``[N, K]``."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor.decompress(dict(tensors), library_scheme(w))["weight"]


__all__ = ["fp8_config", "int_config", "library_pack", "library_unpack", "pack_compressed"]
