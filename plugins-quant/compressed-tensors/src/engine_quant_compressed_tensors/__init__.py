"""The ``compressed-tensors`` quantization plugin: llm-compressor's checkpoint format.

Registration only; the config, methods and kernels import when the method is selected.
"""

from __future__ import annotations

from engine.hookspecs import QuantMethodSpec, hookimpl


@hookimpl
def register_quantization_methods(register):  # type: ignore[no-untyped-def]
    register(QuantMethodSpec(
        name="compressed-tensors",
        factory="engine_quant_compressed_tensors.config:CompressedTensorsConfig.from_config",
        description="compressed-tensors checkpoints: pack-quantized int4/int8 weight-only (W4A16, W8A16) "
                    "and float-quantized FP8 (served by the fp8 plugin)",
        device_types=("cuda", "cpu"),
        fast_device_types=("cuda",),  # the CPU runs the torch reference
        checkpoint_methods=("compressed-tensors",),
    ))
