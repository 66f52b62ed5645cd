"""The ``fp8`` quantization plugin: float8_e4m3fn weights with per-output-channel scales.

Registration only; the config, method and kernels import when ``fp8`` is selected.
"""

from __future__ import annotations

from engine.hookspecs import PluginOption, QuantMethodSpec, hookimpl

#: Default of the plugin option ``fp8.fuse_activation_quant`` (``Fp8Config.fuse_activation_quant``).
FUSE_ACTIVATION_QUANT = True
#: Default of the plugin option ``fp8.fast_accum``, and ``torch._scaled_mm``'s ``use_fast_accum`` for
#: callers of ``gemm`` that pass none: accumulate in the fp8 tensor cores' own accumulator instead of
#: promoting partial sums to float32 along K. H200, 2026-11-29 (benchmarks/bench_kernels.py --large):
#: the four Llama-3-8B linears take 2,527 us a layer at M = 8,192 against 2,847 us promoting
#: (1,190-1,354 -> 1,362-1,494 TFLOP/s), 356 against 398 us at M = 1,024; relative L2 error against
#: float32 maths on the same codes 2.1e-3 (K = 4,096) and 3.3e-3 (K = 14,336) against 1.7e-3
#: promoting (the fp8 GEMM tests allow 8e-3 against the dequantized-weight reference, whose
#: activations are not quantized).
FAST_ACCUM = True


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
        plugin="fp8", key="fuse_activation_quant", default=FUSE_ACTIVATION_QUANT,
        help="quantize a per-channel fp8 linear's activations in the RMSNorm / SiLU-and-mul that "
             "produces them (one launch fewer per linear above 32 tokens); false: a separate launch"))
    register(PluginOption(
        plugin="fp8", key="fast_accum", default=FAST_ACCUM,
        help="the fp8 x fp8 GEMMs above 128 tokens (torch._scaled_mm) accumulate in the tensor cores' own "
             "accumulator (use_fast_accum); false: partial sums promoted to float32 along K (slower)"))
