"""The ``cuda`` platform plugin: NVIDIA GPUs through PyTorch's CUDA build.

Importing this module registers the platform only; CUDA is probed (and
initialised) when the platform's methods are called.
"""

from __future__ import annotations

from typing import Any

from engine.hookspecs import PlatformSpec, PluginOption, hookimpl

#: The plugin's options (``plugin_options: {cuda: {...}}`` / ``--plugin-option cuda.KEY=VALUE``).
DEFAULT_OPTIONS: dict[str, Any] = {
    # The Triton skinny GEMM (``gemv.py``) for unquantized linear layers at few rows; off: cuBLAS.
    "gemv": True,
    # The most rows (tokens of a step) it takes; the kernel computes up to 16.
    "gemv_max_rows": 8,
    # Decode steps' attention prologue (q/k norm, rotary, KV store) in one launch; off: one each.
    "qkv_prologue": True,
    # Programmatic dependent launch for the skinny GEMM (sm_90+; ignored on older GPUs).
    "pdl": True,
    # RMSNorm folded into the skinny GEMM after it at 1 row, the fma kind's (no launch of its own); off: separate.
    "norm_fusion": True,
    # With PDL, the K steps of weights each skinny-GEMM program requests before its wait (1..4).
    "pdl_preload": 3,
    # MiB of the next layer's qkv weight staged in L2 during each decode graph's layer (sm_90+; 0: off;
    # auto: 6 in graphs of up to 8 tokens on a single GPU, off under tensor or pipeline parallelism).
    "l2_prefetch_mb": "auto",
    # The sampler's greedy argmax as one Triton launch (``argmax.py``); off: torch.argmax. Off by default:
    # less device time, more host time a call, and no measurable end-to-end gain (docs/cuda_kernels.md).
    "argmax": False,
}
_OPTION_HELP = {
    "gemv": "Triton skinny GEMM for unquantized linear layers at few rows (off: F.linear / cuBLAS)",
    "gemv_max_rows": "most rows (tokens of a step) the skinny GEMM takes, 1..16; more go to F.linear",
    "qkv_prologue": "decode steps: q/k norm, rotary and the KV store of each attention layer in one "
                    "Triton launch (off: a launch each)",
    "pdl": "sm_90+: launch the skinny GEMM with programmatic dependent launch, so it requests its "
           "first weights while the norm before it runs (ignored on older GPUs; off: plain launches)",
    "norm_fusion": "fold each RMSNorm (+ residual add) into the skinny GEMM that reads it first (qkv, "
                   "gate/up, the MoE router) at 1 row (the rows of the skinny GEMM's fma kind), saving its launch "
                   "(off: separate launches)",
    "pdl_preload": "with cuda.pdl: K steps of weights (1..4) each skinny-GEMM program without a folded "
                   "norm requests before it waits for the kernel before it; more streams more weights "
                   "during latency-bound kernels (attention) at the cost of registers",
    "l2_prefetch_mb": "sm_90+, decode CUDA graphs: MiB (0..64) of the next layer's qkv weight "
                      "asked into L2 from a side stream while each layer's attention runs; 0: off; auto "
                      "(default): 6 in graphs of up to 8 tokens on a single GPU, off under tensor or "
                      "pipeline parallelism; a number applies to every decode graph",
    "argmax": "greedy sampling's argmax over the vocabulary as one Triton launch (about 3.5 against 9.4 us of "
              "device time at batch 1 on an H100, but about 60 against 17 us of host time a call); off: torch.argmax",
}


@hookimpl
def register_platforms(register):  # type: ignore[no-untyped-def]
    register(PlatformSpec(
        name="cuda", factory="engine_platform_cuda.platform:CudaPlatform", device_type="cuda",
        description="NVIDIA GPUs via PyTorch CUDA (NCCL, CUDA graphs, flashinfer/triton attention)",
        tested_on_hardware="NVIDIA H100 80GB, H200 (GPU test suite, benchmarks)",
    ))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    for key, default in DEFAULT_OPTIONS.items():
        # l2_prefetch_mb takes "auto" or a number of MiB (the platform's factory checks the range).
        accepts = (int,) if key == "l2_prefetch_mb" else ()
        register(PluginOption(plugin="cuda", key=key, default=default, help=_OPTION_HELP[key], accepts=accepts))
