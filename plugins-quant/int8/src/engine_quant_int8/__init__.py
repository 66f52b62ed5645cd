"""The ``w8a8_int8`` quantization plugin: int8 weights and int8 activations, int32 accumulation.

Registration only; the config, method and kernels import when ``w8a8_int8`` is selected.
"""

from __future__ import annotations

from engine.hookspecs import QuantMethodSpec, hookimpl


@hookimpl
def register_quantization_methods(register):  # type: ignore[no-untyped-def]
    register(QuantMethodSpec(
        name="w8a8_int8",
        factory="engine_quant_int8.config:W8A8Int8Config.from_config",
        description="int8 weights (per channel) x int8 activations (per token); torch._int_mm on CUDA, exact emulation on CPU",
        device_types=("cuda", "cpu"),
        checkpoint_methods=("w8a8_int8",),
    ))
