"""Workspace-wide pytest set-up, loaded before any test module.

Without a CUDA device, Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
numpy on the CPU), so the kernels of the quant and attention plugins are tested for correctness
here and in CI too; their speed is measured on a GPU only. Triton reads the variable when a
kernel is decorated, so it is set here, before any kernel module is imported.
"""

from __future__ import annotations

import os


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if "TRITON_INTERPRET" not in os.environ and not _has_cuda():
    os.environ["TRITON_INTERPRET"] = "1"
