"""The ``w8a8_int8`` quantization plugin: int8 weights; int8 activations with int32 accumulation
at large batch, activations left in 16 bits (weight-only) at small batch.

Registration only; the config, method and kernels import when ``w8a8_int8`` is selected.
"""

from __future__ import annotations

from engine.hookspecs import QuantMethodSpec, hookimpl


@hookimpl
def register_quantization_methods(register):  # type: ignore[no-untyped-def]
    register(QuantMethodSpec(
        name="w8a8_int8",
        factory="engine_quant_int8.config:W8A8Int8Config.from_config",
        description=("int8 weights (per channel); Triton weight-only GEMV/GEMM for a few tokens, int8 x int8 "
                     "(per-token or static activation scales) above; torch references on CPU"),
        device_types=("cuda", "cpu"),
        fast_device_types=("cuda",),  # the CPU runs the torch reference
        checkpoint_methods=("w8a8_int8",),
    ))
