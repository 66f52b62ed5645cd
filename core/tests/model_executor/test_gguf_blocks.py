"""``iterate_gguf_blocks``: the raw GGUF blocks the ``gguf`` quant method keeps, named and row-ordered
as the dequantized conversion names and orders them."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import torch

from engine.model_executor.gguf_convert import iterate_gguf_blocks, load_gguf_config
from engine.testing.checkpoints import load_hf_model, make_tiny_checkpoint
from engine.testing.gguf_files import write_tiny_gguf

SHAPES = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_blocks_come_with_their_type_and_llama_row_order_undone(tmp_path: pathlib.Path, qtype: str) -> None:
    model = load_hf_model(make_tiny_checkpoint(str(tmp_path / "hf"), "LlamaForCausalLM", **SHAPES))
    path = str(tmp_path / "tiny.gguf")
    expected = write_tiny_gguf(path, model, qtype, overrides={"up_proj": "F16"})
    wanted = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.1.mlp.up_proj.weight"}
    stream = list(iterate_gguf_blocks(path, load_gguf_config(path), wanted, progress=False))
    names = [n for n, _ in stream]
    types = {n.removesuffix("_type"): int(t.item()) for n, t in stream if n.endswith(".weight_type")}
    assert set(types) == wanted
    for name, tensor in stream:
        if name.endswith(".weight_type"):
            continue
        if name in wanted:
            assert names.index(name + "_type") == names.index(name) - 1  # the type comes first
        if name == "model.layers.1.mlp.up_proj.weight":  # a float tensor stays float, typed F16
            assert types[name] == int(gguf.GGMLQuantizationType.F16) and tensor.dtype == torch.float16
        elif name in wanted:  # blocks; dequantized by gguf they are the converted weight, rows in place
            qt = gguf.GGMLQuantizationType(types[name])
            assert qt.name == qtype and tensor.dtype == torch.uint8
            np.testing.assert_array_equal(gguf.quants.dequantize(tensor.numpy(), qt), expected[name], err_msg=name)
        else:  # everything else as the dequantized conversion gives it
            np.testing.assert_array_equal(tensor.float().numpy(), expected[name], err_msg=name)
    assert len(names) == len(expected) + len(wanted)


def test_the_tensor_names_are_kept_beside_the_conversion(tmp_path: pathlib.Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load writes the GGUF-to-Hugging-Face name map into the checkpoint directory; a
    later one reads it instead of rebuilding it from a skeleton model, and streams the same."""
    import json

    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    from engine.model_executor import gguf_convert

    model = load_hf_model(make_tiny_checkpoint(str(tmp_path / "hf"), "LlamaForCausalLM", **SHAPES))
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, model, "Q8_0")
    config, wanted = load_gguf_config(path), {"model.layers.0.self_attn.q_proj.weight"}
    kept = tmp_path / "converted"
    kept.mkdir()
    first = list(iterate_gguf_blocks(path, config, wanted, progress=False, names_dir=str(kept)))
    saved = json.loads((kept / gguf_convert.NAMES_FILE).read_text())
    assert saved["names"]["blk.0.attn_q.weight"] == "model.layers.0.self_attn.q_proj.weight"

    def rebuilt(*args: object, **kwargs: object) -> None:
        raise AssertionError("the name map was built again")

    monkeypatch.setattr(hf_gguf, "get_gguf_hf_weights_map", rebuilt)
    again = list(iterate_gguf_blocks(path, config, wanted, progress=False, names_dir=str(kept)))
    assert [n for n, _ in again] == [n for n, _ in first]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, again, strict=True))
    saved["versions"]["transformers"] = "0.0"  # another transformers: built again, not trusted
    (kept / gguf_convert.NAMES_FILE).write_text(json.dumps(saved))
    with pytest.raises(AssertionError, match="built again"):
        list(iterate_gguf_blocks(path, config, wanted, progress=False, names_dir=str(kept)))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_dequantize_rows_in_chunks_equals_gguf_dequantize(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.model_executor.gguf_convert as convert

    monkeypatch.setattr(convert, "_DEQUANT_CHUNK_ROWS", 16)  # 3 chunks, the last one short
    gtype = gguf.GGMLQuantizationType[qtype]
    rows = np.random.default_rng(0).standard_normal((37, 64)).astype(np.float32)
    data = gguf.quantize(rows, gtype)
    chunked = convert.dequantize_rows(data, gtype)
    assert chunked.dtype == np.float32 and chunked.shape == (37, 64)
    assert np.array_equal(chunked, gguf.dequantize(data, gtype))
