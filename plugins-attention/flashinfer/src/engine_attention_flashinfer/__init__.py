"""The ``flashinfer`` attention plugin: FlashInfer's paged prefill and decode kernels.

Importing this module registers the backend and its option only; neither
flashinfer nor CUDA is imported until the backend is selected (``--attention flashinfer``).
Install the library with the ``flashinfer`` extra: ``pip install plugserve-attention-flashinfer[flashinfer]``.
"""

from __future__ import annotations

from engine.hookspecs import AttentionBackendSpec, PluginOption, hookimpl
from engine_attention_flashinfer.options import DEFAULT_OPTIONS


@hookimpl
def register_attention_backends(register):  # type: ignore[no-untyped-def]
    register(AttentionBackendSpec(
        name="flashinfer",
        factory="engine_attention_flashinfer.backend:create",
        description="FlashInfer paged prefill/decode (GQA tensor cores, sliding window, soft cap, CUDA graphs)",
        device_types=("cuda",),
        supports_cuda_graph=True,
        # fp8 K/V with bf16/fp16 queries: the wrappers are planned with kv_data_type = the pool's.
        kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"),
    ))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    register(PluginOption(plugin="flashinfer", key="workspace_mb", default=DEFAULT_OPTIONS["workspace_mb"],
                          help="FlashInfer float workspace shared by all wrappers, in MiB"))
