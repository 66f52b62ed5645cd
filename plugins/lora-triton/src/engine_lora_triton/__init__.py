"""The ``triton`` LoRA backend: this project's segmented shrink/expand (SGMV) Triton kernels.

Importing this module registers the backend only; triton is imported when the backend is
selected (``--lora-backend triton``, or ``auto`` on CUDA and ROCm, whose device type is
``cuda``).
"""

from __future__ import annotations

import os

from engine.hookspecs import LoraBackendSpec, PluginOption, hookimpl


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, numpy on the CPU):
    the backend then also runs on the cpu platform, slowly, so tests check it without a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@hookimpl
def register_lora_backends(register):  # type: ignore[no-untyped-def]
    register(LoraBackendSpec(
        name="triton", factory="engine_lora_triton.backend:create",
        device_types=("cuda", "cpu") if interpreting() else ("cuda",),
        description="Triton SGMV kernels: one program per segment token tile and output tile; "
                    "token-parallel matrix-vector form for one-token segments (decode)"))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    register(PluginOption(plugin="lora-triton", key="pdl", default=True,
                          help="sm_90+: launch decode batches' shrink and expand with programmatic dependent launch "
                               "(each starts while the kernel before it drains, reading the batch info and its "
                               "first weights)"))
    register(PluginOption(plugin="lora-triton", key="slot_shrink", default=False,
                          help="decode batches of 16+ requests: shrink with one program per (adapter slot, row tile, "
                               "K chunk) into float32 partial sums (default: one program per token, a finished y)"))
    register(PluginOption(plugin="lora-triton", key="split_prefill", default=True,
                          help="batches of few token tiles (short prefills): split the shrink over K chunks, float32 "
                               "partial sums that the expand adds up (false: whole-K programs)"))
    register(PluginOption(plugin="lora-triton", key="dense_expand", default=False,
                          help="decode batches of 16+ requests: expand with one program per column tile over every "
                               "token and adapter slot (default: one program per slot and column tile)"))
    register(PluginOption(plugin="lora-triton", key="fold_max_rows", default=256,
                          help="batches of fold_min_rows up to this many tokens on unquantized layers fold the "
                               "shrink into the base GEMM (the slots' A rows stacked under the weight) and run one "
                               "expand kernel; 0: never (shrink and expand kernels)"))
    register(PluginOption(plugin="lora-triton", key="fold_min_rows", default=16,
                          help="the fewest tokens a batch folds the shrink into the base GEMM for (smaller batches: "
                               "shrink and expand kernels); at most fold_max_rows unless that is 0"))
