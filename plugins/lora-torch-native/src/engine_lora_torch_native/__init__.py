"""The ``torch_native`` LoRA backend: segmented shrink/expand with torch matmuls.

Registration only; the backend lives in ``engine_lora_torch_native.backend`` and is imported when
``--lora-backend torch_native`` (or ``auto`` without a faster backend for the device) selects it.
"""

from __future__ import annotations

from engine.hookspecs import LoraBackendSpec, PluginOption, hookimpl


@hookimpl
def register_lora_backends(register):  # type: ignore[no-untyped-def]
    register(LoraBackendSpec(
        name="torch_native", factory="engine_lora_torch_native.backend:TorchNativeLoraBackend",
        device_types=("cpu", "cuda", "rocm", "xpu", "npu"),
        description="Plain torch: one matmul per segment on the CPU, one masked matmul per adapter slot on accelerators"))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    register(PluginOption(plugin="lora_torch_native", key="fold_max_rows", default=0,
                          help="batches of up to this many tokens on unquantized layers fold the shrink into the "
                               "base GEMM (the slots' A rows stacked under the weight); 0: never"))
