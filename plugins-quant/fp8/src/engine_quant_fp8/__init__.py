"""The ``fp8`` quantization plugin: float8_e4m3fn weights with per-output-channel scales.

Registration only; the config, method and kernels import when ``fp8`` is selected.
"""

from __future__ import annotations

from engine.hookspecs import PluginOption, QuantMethodSpec, hookimpl


@hookimpl
def register_quantization_methods(register):  # type: ignore[no-untyped-def]
    register(QuantMethodSpec(
        name="fp8",
        factory="engine_quant_fp8.config:Fp8Config.from_config",
        description="FP8 e4m3 weights, per-channel or 128x128-block scales; Triton weight-only and fp8 GEMMs on CUDA sm89+, dequantized elsewhere",
        device_types=("cuda", "cpu"),
        checkpoint_methods=("fp8",),
    ))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    register(PluginOption(
        plugin="fp8", key="fuse_activation_quant", default=True,
        help="quantize a per-channel fp8 linear's activations in the RMSNorm / SiLU-and-mul that "
             "produces them (one launch fewer per linear above 32 tokens); false: a separate launch"))
    register(PluginOption(
        plugin="fp8", key="fast_accum", default=True,
        help="the fp8 x fp8 GEMMs above 128 tokens (torch._scaled_mm) accumulate in the tensor cores' own "
             "accumulator (use_fast_accum); false: partial sums promoted to float32 along K (slower)"))
