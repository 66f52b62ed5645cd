"""Turns one GGUF file into a Hugging Face checkpoint directory the model plugins load.

What transformers' GGUF support already does is used as is: the config and the tokenizer (with
its chat template, BOS/EOS and special tokens) come from ``AutoConfig``/``AutoTokenizer`` with
``gguf_file=``, the GGUF-to-Hugging-Face tensor names from ``get_gguf_hf_weights_map`` and the
undoing of llama.cpp's Q/K row permutation from its per-architecture tensor processors;
dequantization is the ``gguf`` package's. What it lacks, and is written here: streaming the tensors
one at a time into safetensors shards (transformers holds every dequantized tensor in memory at
once), with one progress bar over the whole conversion, and a dtype rule (below).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

# Bumped whenever the directory this module writes changes, so stale caches are not reused.
CONVERTER_VERSION = 1
# Shards of at most this many bytes: a 7B model's float32 weights do not sit in memory at once.
_SHARD_BYTES = 2 << 30
# Written next to the weights: where they came from (and proof the conversion finished).
SOURCE_FILE = "gguf_source.json"


def _split(gguf_path: str) -> tuple[str, str]:
    return os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)


_SHARING = threading.RLock()


@contextlib.contextmanager
def one_gguf_parse(gguf_path: str) -> Iterator[Any]:
    """Yields a ``GGUFReader`` of ``gguf_path`` that every ``gguf.GGUFReader(gguf_path)`` inside the
    block returns too.

    transformers' config, tokenizer and weight loaders each open the file anew, and parsing the
    metadata of a real model's vocabulary (49k tokens, one field part each) takes seconds every
    time: a conversion read it four times. The reader only reads (a read-only memory map), so one
    serves them all. Other paths, and other arguments, open their own reader as usual.
    """
    import gguf

    with _SHARING:  # one block at a time patches the module attribute
        original = gguf.GGUFReader
        shared = original(gguf_path)
        key = os.path.realpath(gguf_path)

        class _SharedReader(original):  # type: ignore[misc, valid-type]
            def __new__(cls, path: Any, *args: Any, **kwargs: Any) -> Any:
                if not args and not kwargs and os.path.realpath(path) == key:
                    return shared  # not a _SharedReader instance, so __init__ does not run again
                return original(path, *args, **kwargs)

        gguf.GGUFReader = _SharedReader
        try:
            with one_name_table():  # transformers' weight loader builds the GGUF name map too
                yield shared
        finally:
            gguf.GGUFReader = original


@contextlib.contextmanager
def one_name_table() -> Iterator[None]:
    """Inside the block, ``gguf.get_tensor_name_map(arch, n_blocks)`` builds each table once.

    transformers' ``get_gguf_hf_weights_map`` walks the model's submodules and asks for the whole
    GGUF name table at every one of them (about 400 on a 30-layer model: 6 s of CPU, against 0.02 s
    built once). The table is a pure function of its arguments, and only read.
    """
    import gguf

    with _SHARING:
        original = gguf.get_tensor_name_map
        if getattr(original, "cache_info", None) is not None:  # an enclosing block's
            yield
            return
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
        try:
            yield
        finally:
            gguf.get_tensor_name_map = original


def load_gguf_config(gguf_path: str) -> Any:
    """The transformers config read from the GGUF metadata, with ``architectures`` filled in.

    Raises:
        ModelLoadError: transformers cannot read this GGUF architecture.
    """
    with one_gguf_parse(gguf_path) as reader:
        return _load_config(gguf_path, reader)


def _load_config(gguf_path: str, reader: Any) -> Any:
    """``load_gguf_config`` inside a ``one_gguf_parse`` block, whose reader is ``reader``."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    directory, name = _split(gguf_path)
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=name)
    except Exception as exc:  # transformers raises ValueError/KeyError/NotImplementedError alike
        raise ModelLoadError(f"--model-path: cannot read the GGUF metadata of {gguf_path}: {exc}") from None
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if arch is None:
        raise ModelLoadError(f"--model-path: GGUF {gguf_path} holds a '{config.model_type}' model, "
                             "which is not a causal language model transformers knows")
    config.architectures = [arch]
    _fix_head_dim(config, reader)
    # Dequantized weights are float32: ``--dtype auto`` then runs float32 on the CPU and the
    # platform's dtype (bfloat16) on accelerators, as for any float32 checkpoint.
    config.dtype = "float32"
    return config


def _fix_head_dim(config: Any, reader: Any) -> None:
    """transformers maps no head size for qwen2/qwen3 GGUFs and keeps the config class's default
    (128), wrong for any model whose heads differ; llama.cpp writes it as attention.key_length."""
    arch = str(reader.get_field("general.architecture").contents())
    field = reader.get_field(f"{arch}.attention.key_length")
    if field is not None and hasattr(config, "head_dim"):
        config.head_dim = int(field.contents())


def convert_gguf(gguf_path: str, target: str, check_architecture: Callable[[str], None],
                 weights: bool = True) -> None:
    """Writes config.json, the tokenizer files and safetensors weights of ``gguf_path`` into ``target``.

    Args:
        gguf_path: a single-file GGUF checkpoint.
        target: an existing, empty directory.
        check_architecture: called with the Hugging Face architecture name before the slow part;
            raises when no model plugin provides it.
        weights: False writes config and tokenizer only, for a method that reads every tensor
            from the GGUF itself (``--quant gguf``).
    """
    from tqdm.auto import tqdm

    # One bar over the whole conversion: reading the metadata and building the tokenizer take
    # as long as the tensors on a small model. Steps: metadata, tokenizer, each tensor, the
    # final write; the tensor count is known once the metadata is read.
    # disable=None: a bar on a terminal, nothing in a log file.
    with tqdm(total=3, desc=f"converting {os.path.basename(gguf_path)}", unit="step", disable=None) as bar, \
            contextlib.ExitStack() as stack:
        bar.set_postfix_str("reading the metadata")
        reader = stack.enter_context(one_gguf_parse(gguf_path))
        from transformers import AutoTokenizer

        config = _load_config(gguf_path, reader)
        check_architecture(config.architectures[0])
        if weights:
            bar.total = 3 + len(reader.tensors)
        bar.update()
        bar.set_postfix_str("building the tokenizer")
        directory, name = _split(gguf_path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        except Exception as exc:
            raise ModelLoadError(f"--model-path: cannot build a tokenizer from the GGUF metadata of {gguf_path}: {exc}") from None
        tokenizer.save_pretrained(target)
        config.save_pretrained(target)
        bar.update()
        if weights:
            bar.set_postfix_str("dequantizing the tensors")
        count = _write_weights(gguf_path, config, target, reader, bar) if weights else 0
        bar.set_postfix_str("writing")
        with open(os.path.join(target, SOURCE_FILE), "w") as f:
            json.dump({"gguf": os.path.abspath(gguf_path), "converter_version": CONVERTER_VERSION,
                       "tensors": count, "weights": weights}, f, indent=1)
        bar.update()
        bar.set_postfix_str("done")


def iterate_gguf_weights(gguf_path: str, config: Any, progress: bool = True,
                         reader: Any = None, bar: Any = None) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, dequantized torch tensor) for every tensor the model uses.

    ``reader`` is the file's ``GGUFReader`` where the caller has one already; else it is opened here.
    ``bar``: a progress bar of the caller's, advanced once per tensor, instead of one of its own.

    Tensors llama.cpp stores in float16/bfloat16 keep that dtype (exactly); quantized ones and
    float32 ones come out float32. Tensors the model has no parameter for (e.g. ``rope_freqs``,
    which transformers recomputes from the config) are skipped.
    """
    return iterate_gguf_blocks(gguf_path, config, frozenset(), progress, reader, bar)


# transformers' tensor processors whose change to a tensor is a permutation of whole rows (or
# nothing), so it applies to a quantized tensor's byte rows as to its dequantized rows.
_ROW_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor")


# Beside a converted checkpoint: the GGUF-to-Hugging-Face tensor names, so a start that reads the
# tensors from the GGUF (``--quant gguf``) does not rebuild them (transformers builds them from a
# skeleton model, one name table per submodule: seconds of CPU on every start).
NAMES_FILE = "gguf_tensor_names.json"


def _versions() -> dict[str, str]:
    import importlib_metadata as md

    return {"transformers": md.version("transformers"), "gguf": md.version("gguf"),
            "converter_version": str(CONVERTER_VERSION)}


def _weights_map(config: Any, processor: Any, names_dir: str | None) -> dict[str, str]:
    """transformers' GGUF-to-Hugging-Face name map for ``config``, read from ``names_dir`` when an
    earlier start wrote it there with the same library versions, else built (and written)."""
    path = os.path.join(names_dir, NAMES_FILE) if names_dir else None
    if path is not None and os.path.isfile(path):
        try:
            with open(path) as f:
                saved = json.load(f)
            if saved.get("versions") == _versions():
                return dict(saved["names"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or stale: built again below
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):  # only the parameter names are needed, not memory
        skeleton = AutoModelForCausalLM.from_config(config)
    with one_name_table():
        names = get_gguf_hf_weights_map(skeleton, processor)
    if path is not None:
        try:  # written whole then renamed; a read-only cache keeps building it
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"versions": _versions(), "names": names}, f)
            os.replace(tmp, path)
        except OSError:
            pass
    return names


def iterate_gguf_blocks(gguf_path: str, config: Any, block_names: Collection[str], progress: bool = True,
                        reader: Any = None, bar: Any = None,
                        names_dir: str | None = None) -> Iterator[tuple[str, Any]]:
    """``iterate_gguf_weights``, except that the tensors named in ``block_names`` (Hugging Face
    names, e.g. ``model.layers.0.self_attn.q_proj.weight``) come as they are stored.

    For each of those the stream holds ``<name less .weight>.weight_type`` (``int32 [1]``, the GGML
    type) first, then the tensor: a quantized one as its blocks, ``uint8 [rows, row_bytes]``
    (llama.cpp's Q/K row order undone on whole rows), a float one (F32/F16/BF16) as floats. Where
    the architecture's tensor processor does more than permute rows, the tensor comes dequantized,
    with type F32.

    ``names_dir``: the converted checkpoint directory of this GGUF, where the tensor name map is
    kept between starts (``NAMES_FILE``).
    """
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from tqdm.auto import tqdm
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from engine.model_executor.gguf_index import architecture, open_tensor_index

    if reader is None:  # the tensor table only: parsing the vocabulary's metadata takes seconds
        reader = open_tensor_index(gguf_path)
    gguf_arch = architecture(reader)
    config_dict = config.to_dict()  # once: the processor reads it for every tensor
    processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(config=config_dict)
    name_map = _weights_map(config, processor, names_dir)
    rows_only = type(processor).__name__ in _ROW_PROCESSORS
    keep = {GGMLQuantizationType.F16: torch.float16, GGMLQuantizationType.BF16: torch.bfloat16}
    floats = {GGMLQuantizationType.F32, *keep}
    # disable=None: a bar on a terminal, nothing in a log file.
    verb = "reading" if block_names else "dequantizing"
    if bar is None:
        tensors: Any = tqdm(reader.tensors, desc=f"{verb} {os.path.basename(gguf_path)}", unit="tensor",
                            disable=None if progress else True)
    else:
        tensors = _advancing(reader.tensors, bar)
    for tensor in tensors:
        hf_name = name_map.get(tensor.name)
        as_blocks = hf_name in block_names
        raw = as_blocks and rows_only and tensor.tensor_type not in floats
        try:
            weights = tensor.data if raw else dequantize_rows(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"--model-path: GGUF tensor {tensor.name} of {gguf_path} is stored as "
                                 f"{tensor.tensor_type.name}, which the gguf package cannot dequantize; accepted: "
                                 "the float types and the quantized types gguf.quants dequantizes") from None
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=name_map,
                                   parsed_parameters={"tensors": {}, "config": config_dict})
        hf_name = name_map.get(result.name)
        if hf_name is None:
            logger.debug("GGUF tensor %s has no counterpart in %s; skipped", tensor.name, config.architectures[0])
            continue
        if as_blocks:
            qtype = tensor.tensor_type if raw or tensor.tensor_type in floats else GGMLQuantizationType.F32
            yield hf_name.removesuffix(".weight") + ".weight_type", torch.tensor([int(qtype)], dtype=torch.int32)
        if raw:
            yield hf_name, torch.from_numpy(np.array(result.weights, dtype=np.uint8))  # a copy, as below
            continue
        weights = np.asarray(result.weights)
        if weights.dtype != np.float32 or not weights.flags.writeable:
            weights = np.array(weights, dtype=np.float32)  # a copy: the file is mapped read-only
        out = torch.from_numpy(np.ascontiguousarray(weights))
        yield hf_name, out.to(keep.get(tensor.tensor_type, torch.float32))


# Rows of a quantized tensor dequantized per call of ``gguf.dequantize``: it builds every row's
# floats in a list before joining them, so a whole embedding (49152 x 576) took twice its 113 MB in
# fresh pages; 1024 rows keep those temporaries a few MB, reused from one chunk to the next.
_DEQUANT_CHUNK_ROWS = 1024


def dequantize_rows(data: Any, qtype: Any) -> Any:
    """``gguf.dequantize(data, qtype)`` (float32, same values), a chunk of rows at a time into one
    output array. ``data``: the GGUF's ``uint8 [rows, row_bytes]`` view (float types pass through)."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16) \
            or data.ndim != 2 or data.shape[0] <= _DEQUANT_CHUNK_ROWS:
        return dequantize(data, qtype)
    first = dequantize(data[:_DEQUANT_CHUNK_ROWS], qtype)
    out = np.empty((data.shape[0], first.shape[-1]), dtype=first.dtype)
    out[:_DEQUANT_CHUNK_ROWS] = first
    for start in range(_DEQUANT_CHUNK_ROWS, data.shape[0], _DEQUANT_CHUNK_ROWS):
        out[start:start + _DEQUANT_CHUNK_ROWS] = dequantize(data[start:start + _DEQUANT_CHUNK_ROWS], qtype)
    return out


def _advancing(items: Collection[Any], bar: Any) -> Iterator[Any]:
    """``items``, advancing ``bar`` by one after each."""
    for item in items:
        yield item
        bar.update()


def _write_weights(gguf_path: str, config: Any, target: str, reader: Any, bar: Any = None) -> int:
    """Streams the tensors into safetensors shards (with an index when there is more than one),
    advancing ``bar`` once per tensor."""
    from safetensors.torch import save_file

    shard: dict[str, Any] = {}
    size = 0
    written: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names) per shard

    def flush() -> None:
        path = os.path.join(target, f"shard-{len(written) + 1:05d}.safetensors")
        save_file(shard, path, metadata={"format": "pt"})
        written.append((path, list(shard)))

    count = 0
    for name, tensor in iterate_gguf_weights(gguf_path, config, reader=reader, bar=bar):
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > _SHARD_BYTES:
            flush()
            shard, size = {}, 0
        shard[name] = tensor
        size += nbytes
        count += 1
    if count == 0:
        raise ModelLoadError(f"--model-path: no tensor of {gguf_path} maps to a {config.architectures[0]} parameter")
    flush()
    if len(written) == 1:
        os.rename(written[0][0], os.path.join(target, "model.safetensors"))
        return count
    # Several shards: the index transformers expects, so the cache is a checkpoint it loads too.
    weight_map = {}
    for i, (path, names) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.rename(path, os.path.join(target, final))
        weight_map.update(dict.fromkeys(names, final))
    with open(os.path.join(target, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    return count
