"""The tensors of a GGUF file, found without parsing its metadata values.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata value: for a real
model's vocabulary (49k token strings, scores and types) that takes seconds, on every start that
reads weights from the GGUF. Loading weights needs only the tensor table and the architecture
name, so this index walks the metadata with ``struct`` (skipping arrays by their lengths), reads
the tensor table, and maps each tensor as ``GGUFReader`` does (same ``name``, ``tensor_type``,
``shape`` and ``data`` view). Files it does not expect (another byte order, an unknown version)
are left to ``GGUFReader``: ``open_tensor_index`` falls back to it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

_MAGIC = 0x46554747  # b"GGUF", read as a little-endian uint32
_VERSIONS = (2, 3)
# GGUF value types: fixed sizes of the scalar ones; 8 is a string, 9 an array.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class UnsupportedGGUF(ValueError):
    """A file this index does not read (``GGUFReader`` may)."""


@dataclass
class IndexedTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: Any  # numpy array of the GGUF dims (innermost first), as GGUFReader gives
    data: Any  # numpy view of the file, shaped as GGUFReader shapes it


class GGUFTensorIndex:
    """``tensors`` (in file order) and the string/number ``metadata`` scalars of one GGUF file."""

    def __init__(self, path: str) -> None:
        import numpy as np

        self.path = path
        self.data = np.memmap(path, mode="r")
        self._buf = memoryview(self.data)
        self.metadata: dict[str, Any] = {}
        magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", self._buf, 0)
        if magic != _MAGIC or version not in _VERSIONS:
            raise UnsupportedGGUF(f"{path}: magic {magic:#x}, version {version}")
        offset = 24
        for _ in range(n_kv):
            key, offset = self._string(offset)
            (value_type,), offset = struct.unpack_from("<I", self._buf, offset), offset + 4
            value, offset = self._value(value_type, offset)
            if value is not None:
                self.metadata[key] = value
        table = []
        for _ in range(n_tensors):
            name, offset = self._string(offset)
            (n_dims,) = struct.unpack_from("<I", self._buf, offset)
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, offset + 4)
            ggml_type, rel = struct.unpack_from("<IQ", self._buf, offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            table.append((name, dims, ggml_type, rel))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise UnsupportedGGUF(f"{path}: general.alignment {alignment} is not a power of two")
        start = -(-offset // alignment) * alignment
        from gguf import GGMLQuantizationType as T

        self._plain = {T.F16: np.float16, T.F32: np.float32, T.F64: np.float64, T.I8: np.int8,
                       T.I16: np.int16, T.I32: np.int32, T.I64: np.int64}  # stored as numbers, not blocks
        self.tensors = [self._tensor(start, *entry) for entry in table]

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._buf, offset)
        end = offset + 8 + length
        return bytes(self._buf[offset + 8:end]).decode("utf-8", errors="replace"), end

    def _value(self, value_type: int, offset: int) -> tuple[Any, int]:
        """The value at ``offset`` (None for arrays, which are skipped) and the offset after it."""
        if value_type == _STRING:
            return self._string(offset)
        if value_type in _SCALAR_SIZES:
            size = _SCALAR_SIZES[value_type]
            fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}[value_type]
            return struct.unpack_from(fmt, self._buf, offset)[0], offset + size
        if value_type != _ARRAY:
            raise UnsupportedGGUF(f"{self.path}: metadata value type {value_type}")
        item_type, count = struct.unpack_from("<IQ", self._buf, offset)
        offset += 12
        if item_type in _SCALAR_SIZES:
            return None, offset + count * _SCALAR_SIZES[item_type]
        for _ in range(count):  # strings (the vocabulary) or nested arrays: walk their lengths
            _, offset = self._value(item_type, offset)
        return None, offset

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], ggml_type: int, rel: int) -> IndexedTensor:
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        qtype = GGMLQuantizationType(ggml_type)
        n_elems = int(np.prod(dims)) if dims else 1
        np_dims = tuple(reversed(dims))
        first = start + rel
        if qtype in self._plain:
            dtype = np.dtype(self._plain[qtype])
            view = np.ndarray((n_elems,), dtype=dtype, buffer=self.data, offset=first)
        else:
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            view = np.ndarray((n_elems * type_size // block_size,), dtype=np.uint8, buffer=self.data, offset=first)
            np_dims = quant_shape_to_byte_shape(np_dims, qtype)
        return IndexedTensor(name, qtype, np.array(dims, dtype=np.uint64), view.reshape(np_dims))


def open_tensor_index(path: str) -> Any:
    """A ``GGUFTensorIndex`` of ``path``, or a ``gguf.GGUFReader`` where the index cannot read it.
    Either has ``tensors``; ``architecture(reader)`` reads the architecture name of both."""
    try:
        return GGUFTensorIndex(path)
    except UnsupportedGGUF:
        from gguf import GGUFReader

        return GGUFReader(path)


def architecture(reader: Any) -> str:
    """``general.architecture`` of a ``GGUFTensorIndex`` or a ``gguf.GGUFReader``."""
    if isinstance(reader, GGUFTensorIndex):
        return str(reader.metadata["general.architecture"])
    return str(reader.get_field("general.architecture").contents())
