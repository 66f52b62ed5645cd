"""``engine bench one-batch`` with the DeepSeek plugin's decode fusions switched off: the "before"
of the figures in docs/benchmarks.md ("DeepSeek (MLA)"), run in the same way as the "after".

Off by default: the shared experts in the routed experts' launches (``DeepseekMoE.fuse_shared_experts``),
the input projections as one linear (``DeepseekMLA.fuse_projections``; the input norm folded into it
goes with it), the per-head W_UK / W_UV kernel (``DeepseekMLA.head_matvec_kernel``) and its PDL
(``kernel_pdl``), the W_UK product in the prologue's launch (``fuse_prologue``), the router's PDL and
its folded norm (``DeepseekGate.kernel_pdl`` / ``fold_norm``); ``--keep NAME`` leaves one on.
Everything else is passed to ``engine bench one-batch`` unchanged (one process: the switches are
class attributes the model reads when it loads and runs).

usage: python plugins-models/deepseek/benchmarks/bench_unfused.py [--keep shared] -- ONE_BATCH_ARGS...
"""

from __future__ import annotations

import argparse
import sys

SWITCHES = {"shared": ("engine_models_deepseek.models", "DeepseekMoE", "fuse_shared_experts"),
            "projections": ("engine_models_deepseek.mla", "DeepseekMLA", "fuse_projections"),
            "head_matvec": ("engine_models_deepseek.mla", "DeepseekMLA", "head_matvec_kernel"),
            "head_pdl": ("engine_models_deepseek.mla", "DeepseekMLA", "kernel_pdl"),
            "prologue": ("engine_models_deepseek.mla", "DeepseekMLA", "fuse_prologue"),
            "gate_pdl": ("engine_models_deepseek.models", "DeepseekGate", "kernel_pdl"),
            "gate_norm": ("engine_models_deepseek.models", "DeepseekGate", "fold_norm")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", nargs="*", default=[], choices=sorted(SWITCHES), help="fusions left on")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then engine bench one-batch's arguments")
    a = ap.parse_args()
    import importlib

    for name, (module, cls, attr) in SWITCHES.items():
        if name not in a.keep:
            setattr(getattr(importlib.import_module(module), cls), attr, False)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    print(f"# DeepSeek fusions off: {', '.join(n for n in SWITCHES if n not in a.keep) or 'none'}", flush=True)
    from engine.cli import main as engine_main

    sys.argv = ["engine", "bench", "one-batch", *rest]
    engine_main()


if __name__ == "__main__":
    main()
