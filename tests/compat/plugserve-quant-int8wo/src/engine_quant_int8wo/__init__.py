"""Registration of the `int8wo` quantization method."""

from __future__ import annotations

from engine.hookspecs import QuantMethodSpec, hookimpl


@hookimpl
def register_quantization_methods(register):  # type: ignore[no-untyped-def]
    register(QuantMethodSpec(
        name="int8wo",
        factory="engine_quant_int8wo.method:Int8WeightOnlyConfig.from_config",
        description="int8 weights, one float scale per output channel; activations stay float",
        device_types=("cpu", "cuda"),
    ))
