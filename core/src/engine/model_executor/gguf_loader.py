"""GGUF checkpoints: find the file behind ``--model-path``, convert it once, reuse the cache.

A GGUF is turned into a normal Hugging Face checkpoint directory (config.json, tokenizer files,
dequantized safetensors; see ``gguf_convert``) under ``$ENGINE_CACHE_DIR/gguf/`` (default
``~/.cache/engine/gguf/``), keyed by the file's SHA-256, so the scheduler, the tokenizer manager
and the detokenizer all load it through the one Hugging Face path. Later starts find the cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable

from engine.default_model import cache_root  # re-exported: the gguf plugin imports it from here
from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

# llama.cpp's split files (model-00001-of-00003.gguf) need merging first.
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def find_gguf(model_path: str) -> str | None:
    """The GGUF file ``model_path`` names (the file, or the one GGUF in a directory without a
    config.json); None for anything else (a Hugging Face directory, or a path that is wrong in
    a way the Hugging Face loader reports).

    Raises:
        ModelLoadError: several GGUF files, or a split GGUF.
    """
    if os.path.isfile(model_path):
        found = model_path if model_path.endswith(".gguf") else None
    elif os.path.isdir(model_path) and not os.path.isfile(os.path.join(model_path, "config.json")):
        names = sorted(n for n in os.listdir(model_path) if n.endswith(".gguf"))
        if len(names) > 1:
            raise ModelLoadError(f"--model-path: {model_path} holds {len(names)} GGUF files ({', '.join(names)}); "
                                 "accepted: a directory with one GGUF, or the path of the file to load")
        found = os.path.join(model_path, names[0]) if names else None
    else:
        found = None
    if found is not None and _SPLIT.search(found):
        raise ModelLoadError(f"--model-path: {found} is one part of a split GGUF; accepted: a single-file GGUF "
                             "(merge the parts with llama.cpp's `llama-gguf-split --merge FIRST-PART OUT.gguf`)")
    return found


def file_digest(path: str) -> str:
    """SHA-256 of the file, remembered by (path, size, mtime) so later starts skip re-reading GBs."""
    stat = os.stat(path)
    key = os.path.realpath(path)
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    memo_path = os.path.join(cache_root(), "gguf", "digests.json")
    try:
        with open(memo_path) as f:
            memo = json.load(f)
    except (OSError, ValueError):
        memo = {}
    entry = memo.get(key)
    if isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items()) and "sha256" in entry:
        return str(entry["sha256"])
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    memo[key] = {**stamp, "sha256": h.hexdigest()}
    os.makedirs(os.path.dirname(memo_path), exist_ok=True)
    # Written whole then renamed: a concurrent reader sees the old memo or the new, never half.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(memo_path), suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(memo, f, indent=1)
    os.replace(tmp, memo_path)
    return h.hexdigest()


def converted_dir(gguf_path: str) -> str:
    """Where the conversion of ``gguf_path`` lives (whether or not it exists yet)."""
    from engine.model_executor.gguf_convert import CONVERTER_VERSION

    stem = os.path.basename(gguf_path)[: -len(".gguf")]
    return os.path.join(cache_root(), "gguf", f"{stem}-{file_digest(gguf_path)[:16]}-v{CONVERTER_VERSION}")


def prepare_gguf_checkpoint(gguf_path: str, check_architecture: Callable[[str], None],
                            weights: bool = True) -> str:
    """The Hugging Face directory converted from ``gguf_path``, converting it on first use.

    Args:
        check_architecture: raises when no model plugin provides the Hugging Face architecture
            the GGUF holds (called before the slow part of a conversion).
        weights: False (``--quant gguf``, which reads every tensor from the GGUF itself) needs
            config and tokenizer only: a full conversion is reused where one exists, else a
            ``-config`` directory without weights is written (seconds, and no dequantized copy
            of the model on disk).
    """
    full = converted_dir(gguf_path)
    target = full if weights else full + "-config"
    cached = _cached_conversion(gguf_path, (full, target))
    if cached is not None:
        return cached
    os.makedirs(os.path.dirname(target), exist_ok=True)
    # One process converts; another that wants the same directory meanwhile waits and reuses it
    # (servers and engines started together on a fresh cache would each convert otherwise).
    with open(target + ".lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("GGUF %s: another process is converting it; waiting", os.path.basename(gguf_path))
            fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _cached_conversion(gguf_path, (full, target))
        return cached if cached is not None else _convert(gguf_path, target, check_architecture, weights)


def _cached_conversion(gguf_path: str, candidates: tuple[str, ...]) -> str | None:
    from engine.model_executor.gguf_convert import SOURCE_FILE

    for ready in candidates:
        if os.path.isfile(os.path.join(ready, SOURCE_FILE)):
            logger.info("GGUF %s: using its conversion cached in %s", os.path.basename(gguf_path), ready)
            return ready
    return None


def _convert(gguf_path: str, target: str, check_architecture: Callable[[str], None], weights: bool) -> str:
    from engine.model_executor.gguf_convert import SOURCE_FILE, convert_gguf

    tmp = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(target))
    started = time.perf_counter()
    logger.info("converting GGUF %s to a %s in %s (once; later starts reuse it)", gguf_path,
                "safetensors checkpoint" if weights else "config and tokenizer (weights stay in the GGUF)", target)
    try:
        convert_gguf(gguf_path, tmp, check_architecture, weights)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished the same conversion first
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isfile(os.path.join(target, SOURCE_FILE)):
                raise ModelLoadError(f"GGUF cache {target} is incomplete and in the way; delete it and retry") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("GGUF converted in %.1f s", time.perf_counter() - started)
    return target


def not_a_gguf_error(method: str, model_path: str) -> ModelLoadError:
    """The error for a method that reads GGUF blocks (``--quant gguf``) given another checkpoint."""
    return ModelLoadError(f"--quant {method}: {model_path} is not a GGUF checkpoint; accepted: a GGUF file "
                          "(--model-path FILE.gguf, or the default model), or --load-format dummy")


def gguf_source(model_dir: str) -> str | None:
    """The GGUF file a converted directory was made from (None: not a conversion, or the file
    has gone), for the ``gguf`` quant method, which reads the blocks from the file itself."""
    from engine.model_executor.gguf_convert import SOURCE_FILE

    try:
        with open(os.path.join(model_dir, SOURCE_FILE)) as f:
            path = json.load(f).get("gguf")
    except (OSError, ValueError):
        return None
    return path if isinstance(path, str) and os.path.isfile(path) else None


# Whether a GGUF checkpoint on a CUDA device runs with its linear weights kept in GGUF blocks
# (the ``gguf`` quant method) when no --quant is given. The one place to flip that default
# (selection reads it through ``default_gguf_quant``).
KEEP_GGUF_QUANTIZED_ON_CUDA = False
# The same on the CPU, for float32 activations (the CPU's --dtype auto): decode there is bound by
# the bytes of weights read per token, and the gguf plugin's CPU kernels read the blocks (Q4_1:
# 0.625 bytes a weight instead of float32's 4) and compute on the same float32 weight values.
KEEP_GGUF_QUANTIZED_ON_CPU = True


def default_gguf_quant(model_path: str | None, device_type: str, dtype: str = "auto") -> str | None:
    """``"gguf"`` where a run with no --quant should keep this GGUF quantized, else None.

    Args:
        model_path: ``--model-path`` as given (None: the embedded default model, a GGUF; the
            engine's converted directory of a GGUF counts as the GGUF).
        device_type: the selected platform's device type.
        dtype: ``--dtype`` as given; on the CPU only float32 (``auto`` there) keeps the blocks.
    """
    if device_type == "cuda":
        keep = KEEP_GGUF_QUANTIZED_ON_CUDA
    else:
        keep = KEEP_GGUF_QUANTIZED_ON_CPU and device_type == "cpu" and dtype in ("auto", "float32")
    if not keep:
        return None
    if model_path is None or find_gguf(model_path) is not None or gguf_source(model_path) is not None:
        return "gguf"  # the default model, a GGUF file, or the engine's conversion of one
    return None
