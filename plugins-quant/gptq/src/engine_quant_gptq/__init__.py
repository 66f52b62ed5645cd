"""The ``gptq`` quantization plugin: AutoGPTQ / GPTQModel checkpoints (4 or 8 bits, act-order).

Registration only; the config, method and kernels import when ``gptq`` is selected.
"""

from __future__ import annotations

from engine.hookspecs import QuantMethodSpec, hookimpl


@hookimpl
def register_quantization_methods(register):  # type: ignore[no-untyped-def]
    register(QuantMethodSpec(
        name="gptq",
        factory="engine_quant_gptq.config:GptqConfig.from_config",
        description="GPTQ 4/8-bit weights (AutoGPTQ/GPTQModel layout, act-order g_idx); Triton dequantize-GEMM on CUDA, torch on CPU",
        device_types=("cuda", "cpu"),
        fast_device_types=("cuda",),  # the CPU runs the torch reference
        checkpoint_methods=("gptq",),
    ))
