"""``GGUFTensorIndex``: the same tensors as ``gguf.GGUFReader`` (names, types, shapes, bytes) and the
same metadata scalars, without parsing the metadata arrays; files it does not read go to the reader."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest

from engine.model_executor.gguf_index import (
    GGUFTensorIndex,
    UnsupportedGGUF,
    architecture,
    open_tensor_index,
)
from engine.testing.checkpoints import load_hf_model, make_tiny_checkpoint
from engine.testing.gguf_files import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("index")
    model = load_hf_model(make_tiny_checkpoint(str(tmp / "hf"), "LlamaForCausalLM", hidden_size=64,
                                               intermediate_size=128, num_attention_heads=4, num_key_value_heads=2))
    path = str(tmp / "tiny.gguf")
    # Mixed types: Q8_0 and Q4_0 blocks beside F16 and F32 tensors.
    write_tiny_gguf(path, model, "Q8_0", overrides={"up_proj": "F16", "down_proj": "Q4_0"})
    return path


def test_tensors_and_scalars_equal_the_readers(tiny_gguf: str) -> None:
    index, reader = GGUFTensorIndex(tiny_gguf), gguf.GGUFReader(tiny_gguf)
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    types = set()
    for ours, theirs in zip(index.tensors, reader.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape.tolist() == theirs.shape.tolist()
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data)
        types.add(ours.tensor_type.name)
    assert {"Q4_0", "Q8_0", "F16", "F32"} <= types
    scalars = {k: f.contents() for k, f in reader.fields.items() if len(f.types) == 1 and not k.startswith("GGUF.")}
    assert scalars and {k: index.metadata[k] for k in scalars} == pytest.approx(scalars)
    assert not any(isinstance(v, list) for v in index.metadata.values())  # arrays are skipped, not parsed
    assert architecture(index) == architecture(reader) == "llama"


def test_files_it_does_not_read_go_to_the_reader(tiny_gguf: str, tmp_path: pathlib.Path) -> None:
    assert isinstance(open_tensor_index(tiny_gguf), GGUFTensorIndex)
    other = tmp_path / "v1.gguf"
    raw = bytearray(pathlib.Path(tiny_gguf).read_bytes())
    raw[4:8] = (1).to_bytes(4, "little")  # GGUF version 1, which neither reads
    other.write_bytes(bytes(raw))
    with pytest.raises(UnsupportedGGUF):
        GGUFTensorIndex(str(other))
    with pytest.raises(ValueError):
        open_tensor_index(str(other))  # the reader's own error
