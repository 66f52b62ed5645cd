"""The ``awq`` quantization plugin: AutoAWQ GEMM-layout 4-bit checkpoints.

Registration only; the config, method and kernels import when ``awq`` is selected.
"""

from __future__ import annotations

from engine.hookspecs import QuantMethodSpec, hookimpl


@hookimpl
def register_quantization_methods(register):  # type: ignore[no-untyped-def]
    register(QuantMethodSpec(
        name="awq",
        factory="engine_quant_awq.config:AwqConfig.from_config",
        description="AWQ 4-bit weights (AutoAWQ GEMM layout), groups of 32-128; Triton dequantize-GEMM on CUDA, torch on CPU",
        device_types=("cuda", "cpu"),
        fast_device_types=("cuda",),  # the CPU runs the torch reference
        checkpoint_methods=("awq",),
    ))
