"""The CPU kernels (``cpu_matmul.c``): built once with the host's C compiler, loaded with ctypes.

The library is compiled on first use into ``$ENGINE_CACHE_DIR/gguf-cpu/`` (about a second),
named by a hash of the source and the flags, so a later start loads it directly. The flags add
AVX2/FMA/F16C where torch reports an AVX2 (or better) CPU; elsewhere the scalar path is built.
Without a compiler ``available()`` is False and the method keeps its torch path (dequantize +
``F.linear``), logging why once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache

import torch

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "cpu_matmul.c")
#: types with a CPU kernel (GGMLQuantizationType values).
CPU_TYPES = frozenset({2, 3, 8})  # Q4_0, Q4_1, Q8_0
#: at most this many input rows go through the block kernel; larger inputs (prefill) dequantize
#: the weight once per call and multiply with torch's GEMM. One thread, the default model's 120
#: linears of a step, AVX2: 19 ms (kernel) against 84 ms (dequantize + GEMM) at 1 row, 103 against
#: 164 at 20, 174 against 213 at 32; the two cross near 60 rows.
MAX_FUSED_ROWS = 48


def _flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    vector = ["-mavx2", "-mfma", "-mf16c"] if capability.startswith("AVX") else []
    return ["-O3", "-shared", "-fPIC", "-pthread", *vector]


def _cache_dir() -> str:
    from engine.model_executor.gguf_loader import cache_root

    return os.path.join(cache_root(), "gguf-cpu")


def _build() -> str:
    """Path of the compiled library, compiling it when the cache lacks it."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (set CC or install gcc)")
    with open(_SOURCE, "rb") as f:
        source = f.read()
    flags = _flags()
    key = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"gguf_cpu_{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, _SOURCE, "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise OSError(f"{compiler} failed: {proc.stderr.strip()[:500]}")
        os.replace(tmp, path)  # atomic: a concurrent start loads a whole library or builds its own
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(_build())
    except OSError as exc:
        logger.warning("gguf: CPU block kernels unavailable (%s); dequantizing every call instead", exc)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gguf_matmul_threads.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ctypes.c_int, ptr, i64, ctypes.c_int]
    lib.gguf_dequantize.argtypes = [ptr, i64, i64, i64, i64, ctypes.c_int, ptr]
    logger.info("gguf: CPU block kernels loaded (%s path)", "AVX2" if lib.gguf_vector_path() else "scalar")
    return lib


def available() -> bool:
    return _library() is not None


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, out: torch.Tensor, col0: int) -> None:
    """``out[:, col0:col0 + rows] = x @ dequantize(blocks).T``: x float32 ``[M, K]``, blocks
    ``uint8 [rows, row_bytes]``, out float32 ``[M, N]`` with unit column stride."""
    lib = _library()
    assert lib is not None and x.dtype == torch.float32 and out.dtype == torch.float32
    x = x.contiguous()
    rows = blocks.shape[0]
    # y's base is column 0 of the run, which the kernel indexes from 0 to rows.
    y = out.data_ptr() + col0 * out.element_size()
    threads = torch.get_num_threads() if x.shape[0] * rows * x.shape[1] >= 1 << 18 else 1
    rc = lib.gguf_matmul_threads(x.data_ptr(), x.shape[0], x.shape[1], blocks.data_ptr(), 0, rows,
                                 blocks.stride(0), qtype, y, out.stride(0), threads)
    if rc != 0:
        raise ValueError(f"gguf CPU kernel: type {qtype} with {x.shape[1]} inputs is not supported")


def dequantize(blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """``float32 [rows, in_features]``: the same values as ``formats.dequantize``."""
    lib = _library()
    assert lib is not None
    out = torch.empty(blocks.shape[0], in_features, dtype=torch.float32)
    rc = lib.gguf_dequantize(blocks.data_ptr(), 0, blocks.shape[0], in_features, blocks.stride(0), qtype,
                             out.data_ptr())
    if rc != 0:
        raise ValueError(f"gguf CPU kernel: type {qtype} is not supported")
    return out
