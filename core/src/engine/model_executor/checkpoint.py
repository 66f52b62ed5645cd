"""Which checkpoint directory to load, and its config: nothing here imports torch.

The main process resolves the checkpoint (the default model, a GGUF converted once, or the given
directory) before it starts the engine's processes, so keeping torch out of this path keeps that
serial part of start-up short.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)


def resolve_checkpoint(model_path: str | None, disabled: Iterable[str] = (), weights: bool = True) -> str:
    """The Hugging Face directory the engine loads for ``--model-path``.

    None means the embedded default model (SmolLM2-135M-Instruct's GGUF); a GGUF file, or a
    directory holding one GGUF and no config.json, is converted once into the cache
    (``gguf_loader``); anything else is returned as given for ``load_hf_config`` to check.
    ``weights=False``: the caller reads the weights from the GGUF itself (``--quant gguf``), so a
    GGUF's conversion may hold config and tokenizer only.
    """
    import engine.plugins as plugins
    from engine.model_executor.gguf_loader import find_gguf, prepare_gguf_checkpoint

    if model_path is None:
        from engine.default_model import default_model_gguf

        gguf_path: str | None = default_model_gguf()
    else:
        gguf_path = find_gguf(model_path)
    if gguf_path is None:
        return model_path  # type: ignore[return-value]  # not None here: None took the branch above
    blocked = tuple(disabled)
    return prepare_gguf_checkpoint(gguf_path, lambda arch: plugins.get_model_spec(arch, blocked), weights)


def load_hf_config(model_path: str, trust_remote_code: bool = False) -> Any:
    """Reads config.json with transformers; every problem becomes a ModelLoadError."""
    _import_transformers()
    _import_config_validators()
    _import_models_package()
    from transformers import AutoConfig

    if not os.path.isdir(model_path):
        raise ModelLoadError(f"--model-path: not a directory: {model_path}")
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ModelLoadError(f"--model-path: {model_path} has no config.json (expected a Hugging Face model directory)")
    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"--model-path: cannot read {model_path}/config.json: {exc}") from None
    if not getattr(config, "architectures", None):
        raise ModelLoadError(f"{model_path}/config.json names no 'architectures'; cannot pick a model plugin")
    _lift_text_config(config)
    return config


_VALIDATORS = "transformers.utils.type_validators"


class _DeferredActivations(Mapping[str, Any]):
    """transformers' table of activation functions (``transformers.activations.ACT2FN``), imported
    when first read."""

    def _table(self) -> Mapping[str, Any]:
        from transformers.activations import ACT2FN

        return ACT2FN

    def __getitem__(self, name: str) -> Any:
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def _import_config_validators() -> None:
    """Imports ``transformers.utils.type_validators`` without ``transformers.activations``.

    Config classes (Llama's among them) import that module, which imports ``transformers.activations``
    for one validator's table of activation names, and through it transformers' model-loading
    machinery: torch.distributed.tensor (with sympy) and accelerate, ~1.1 CPU-s in every process
    that reads a config (the engine's main process, and each scheduler not forked from it), none
    of which reading a config needs. The module is imported while transformers' torch check says
    no, which leaves the table empty, and then given what that branch gives it: the check itself
    and torch (its torch.device and tensor validators use them) and the table, deferred: the
    first validator to read it imports transformers.activations. Only while no other thread runs
    (the check is transformers' global for that instant); on any surprise the plain import
    happens later, as before.
    """
    if _VALIDATORS in sys.modules or "transformers.activations" in sys.modules or threading.active_count() > 1:
        return
    try:
        import torch

        # The rest of what the module imports, imported first with the torch check intact.
        import transformers.tokenization_utils_base  # noqa: F401
        import transformers.video_utils  # noqa: F401
        from transformers.utils import import_utils
    except ImportError:
        return
    torch_check = import_utils.is_torch_available
    import_utils.is_torch_available = lambda: False
    try:
        validators = importlib.import_module(_VALIDATORS)
    except Exception as exc:  # noqa: BLE001 - the plain import happens later, at its usual cost
        logger.warning("importing %s without transformers.activations failed (%s); it is imported whole later",
                       _VALIDATORS, exc)
        sys.modules.pop(_VALIDATORS, None)
        return
    finally:
        import_utils.is_torch_available = torch_check
    validators.is_torch_available = torch_check
    validators.torch = torch
    validators.ACT2FN = _DeferredActivations()


# The table of transformers' model modules that `import transformers` got from the cache, or built.
_models_table: dict[frozenset[str], dict[str, set[str]]] | None = None


def _import_transformers() -> None:
    """Imports transformers with the table of its model modules kept in the engine's cache.

    ``import transformers`` builds a lazy table of every model module by reading the ~1,700
    sources under ``transformers/models`` (``define_import_structure(models, prefix="models")``):
    ~0.45 CPU-s in every process that reads a config. The table is kept under
    ``<cache>/transformers/`` with a key of those sources' names, sizes and modification times
    and of transformers' own ``__init__`` and ``import_utils`` (~30 ms to take): the next process
    reads it back, and where there is none (or it cannot be read) transformers builds it as
    before and it is written.
    """
    if "transformers" in sys.modules:
        return
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return
    package = list(spec.submodule_search_locations)[0]
    try:
        key = _sources_key(package)
    except OSError as exc:
        logger.warning("transformers' model sources could not be listed (%s): its table of model modules is "
                       "built, not taken from the cache", exc)
        return
    from engine.default_model import cache_root

    finder = _CachedModelsTable(os.path.join(package, "models"),
                                os.path.join(cache_root(), "transformers", f"models-table-{key}.json"))
    sys.meta_path.insert(0, finder)
    try:
        import transformers  # noqa: F401
    except ImportError:
        return
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        finder.restore()


def _sources_key(package: str) -> str:
    import hashlib

    digest = hashlib.sha256(package.encode())
    for path in (os.path.join(package, "__init__.py"), os.path.join(package, "utils", "import_utils.py")):
        st = os.stat(path)
        digest.update(f"{path}:{st.st_size}:{st.st_mtime_ns};".encode())
    pending = [os.path.join(package, "models")]
    while pending:
        directory = pending.pop()
        with os.scandir(directory) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.name == "__pycache__":
                    continue
                if entry.is_dir():
                    pending.append(entry.path)
                    digest.update(f"{entry.path}/;".encode())
                else:
                    st = entry.stat()
                    digest.update(f"{entry.path}:{st.st_size}:{st.st_mtime_ns};".encode())
    return digest.hexdigest()[:32]


class _CachedModelsTable:
    """A one-shot import hook: once ``transformers.utils.import_utils`` is loaded (transformers'
    ``__init__`` loads it before it builds its table), its ``define_import_structure`` answers
    for the models directory from the cache file, and writes that file where it is missing."""

    def __init__(self, models_dir: str, cache_file: str) -> None:
        self.models_dir = models_dir
        self.cache_file = cache_file
        self._module: Any = None
        self._define: Any = None

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "transformers.utils.import_utils":
            return None
        from importlib.machinery import PathFinder, SourceFileLoader

        spec = PathFinder.find_spec(name, path)
        if spec is None or type(spec.loader) is not SourceFileLoader:
            return None
        loader = spec.loader

        def exec_module(module: Any) -> None:
            SourceFileLoader.exec_module(loader, module)
            self._module, self._define = module, module.define_import_structure
            module.define_import_structure = self._table

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def restore(self) -> None:
        """transformers' own function back (its ``__init__`` has called the hook by now)."""
        if self._module is not None:
            self._module.define_import_structure = self._define

    def _table(self, module_path: Any, prefix: str | None = None) -> Any:
        global _models_table
        if prefix != "models" or os.fspath(module_path) != self.models_dir:
            return self._define(module_path, prefix)
        import json

        try:
            with open(self.cache_file, encoding="utf-8") as f:
                table = {frozenset(backends): {name: set(objects) for name, objects in modules.items()}
                         for backends, modules in json.load(f)}
        except (OSError, ValueError, TypeError, AttributeError):
            table = self._define(module_path, prefix)
            rows = [[sorted(backends), {name: sorted(objects) for name, objects in modules.items()}]
                    for backends, modules in table.items()]
            try:
                os.makedirs(os.path.dirname(self.cache_file), exist_ok=True)
                partial = f"{self.cache_file}.{os.getpid()}.tmp"
                with open(partial, "w", encoding="utf-8") as f:
                    json.dump(rows, f)
                os.replace(partial, self.cache_file)
            except OSError as exc:
                logger.warning("transformers' table of model modules not cached at %s (%s): the next process "
                               "builds it again", self.cache_file, exc)
        _models_table = table
        return table


def _import_models_package() -> None:
    """Imports ``transformers.models`` without reading transformers' model sources a second time.

    ``import transformers`` builds its lazy table of every model module by reading the ~1,700
    files under ``transformers/models`` (``define_import_structure(models, prefix="models")``).
    Importing ``transformers.models`` (AutoConfig does) builds the same table without the prefix
    and reads them all again: transformers' per-directory cache keeps 128 of ~560 directories.
    That is ~0.4 CPU-s in every process reading a config. Here the package gets the first table
    (from the cache, ``_import_transformers``, or memoised by transformers: no reading) with
    "models." taken off its entries, where every entry names a directory there; otherwise it
    builds its own as before.
    """
    if "transformers.models" in sys.modules:
        return
    try:
        import transformers
        from transformers.utils import import_utils
    except ImportError:
        return
    define = import_utils.define_import_structure
    models_dir = os.path.join(os.path.dirname(transformers.__file__), "models")
    init = os.path.join(models_dir, "__init__.py")

    def models_table(module_path: Any, prefix: str | None = None) -> Any:
        if prefix is not None or os.fspath(module_path) != init:
            return define(module_path, prefix)
        from pathlib import Path

        # The table `import transformers` got: from the cache (_import_transformers), else
        # memoised under the argument transformers' __init__ gave.
        prefixed = _models_table or define(Path(transformers.__file__).parent / "models", prefix="models")
        table = {backends: {name[len("models."):]: set(objects) for name, objects in modules.items()
                            if name.startswith("models.")} for backends, modules in prefixed.items()}
        packages = {name.split(".", 1)[0] for modules in table.values() for name in modules}
        if not packages <= set(os.listdir(models_dir)):
            return define(module_path, prefix)
        return table

    import_utils.define_import_structure = models_table
    try:
        importlib.import_module("transformers.models")
    finally:
        import_utils.define_import_structure = define


# What the engine reads from a config (pool sizing, parallelism checks, sampling) about the decoder.
_DECODER_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "max_position_embeddings", "intermediate_size", "rms_norm_eps", "sliding_window",
                 "eos_token_id")


def _lift_text_config(config: Any) -> None:
    """A vision-language config nests its decoder's shapes in ``text_config``: they are copied to
    the top level where it has none, so the engine sizes pools and checks parallelism by them."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else None
    if text is None or text is config:
        return
    for key in _DECODER_KEYS:
        if getattr(config, key, None) is None and getattr(text, key, None) is not None:
            setattr(config, key, getattr(text, key))
