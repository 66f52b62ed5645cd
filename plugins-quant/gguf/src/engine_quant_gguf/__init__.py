"""The ``gguf`` quantization plugin: GGUF linear weights kept in their blocks in memory.

Registration only; the config, the method and the kernels import when ``gguf`` is selected.
"""

from __future__ import annotations

from engine.hookspecs import PluginOption, QuantMethodSpec, hookimpl


@hookimpl
def register_quantization_methods(register):  # type: ignore[no-untyped-def]
    register(QuantMethodSpec(
        name="gguf",
        factory="engine_quant_gguf.config:GGUFConfig.from_config",
        description="GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q6_K weights kept in their blocks; "
                    "Triton dequantize-GEMM on CUDA, a C block kernel on CPU (Q4_0/Q4_1/Q8_0)",
        device_types=("cuda", "cpu"),
        checkpoint_methods=("gguf",),
    ))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    register(PluginOption(
        plugin="gguf", key="dummy_type", default="",
        help="with --load-format dummy: the GGML type of the random blocks every quantized linear "
             "layer gets (Q4_0, Q4_1, Q8_0, Q4_K or Q6_K); required there"))
