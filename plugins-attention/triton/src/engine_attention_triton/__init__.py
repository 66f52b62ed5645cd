"""The ``triton`` attention plugin: this project's own Triton kernels over the paged KV pool.

Importing this module registers the backend only; triton and CUDA are imported
when the backend is selected (``--attention triton``).
"""

from __future__ import annotations

import os

from engine.hookspecs import AttentionBackendSpec, PluginOption, hookimpl


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, numpy on the CPU):
    the backend then also runs on the cpu platform, slowly, so tests check it without a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@hookimpl
def register_attention_backends(register):  # type: ignore[no-untyped-def]
    register(AttentionBackendSpec(
        name="triton",
        factory="engine_attention_triton.backend:create",
        description="Triton kernels: split-KV paged decode (GQA-grouped), extend over a cached prefix",
        device_types=("cuda", "cpu") if interpreting() else ("cuda",),
        supports_cuda_graph=True,
        kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"),
        # "mla": DeepSeek's latent KV rows, read by the kernels of mla_attention.
        kv_layouts=("mha", "mla"),
    ))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    register(PluginOption(plugin="triton", key="max_kv_splits", default=16,
                          help="Most sequence splits of a decode row (also sizes the CUDA-graph workspace)"))
    register(PluginOption(plugin="triton", key="pdl", default=True,
                          help="sm_90+: launch the decode kernels with programmatic dependent launch (the first "
                               "block of keys is gathered while the previous kernel drains)"))
