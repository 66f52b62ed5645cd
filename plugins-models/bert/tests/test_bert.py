"""The BERT encoder against Hugging Face transformers' BertModel (the oracle), on a tiny random checkpoint."""

from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.managers.scheduler import check_no_leak
from engine.testing.checkpoints import make_tiny_checkpoint
from engine.testing.harness import embed_prompts, make_scheduler

_SHAPE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
              max_position_embeddings=128, type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12)


def _prompts(seed: int, lens: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 2048) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module")
def bert_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("bert")), "BertModel", **_SHAPE)


@pytest.fixture(scope="module")
def hf_bert(bert_ckpt: str) -> Any:
    from transformers import BertModel

    return BertModel.from_pretrained(bert_ckpt, attn_implementation="eager").eval()


def _hf_states(hf: Any, ids: list[int]) -> Any:
    with torch.no_grad():
        return hf(torch.tensor([ids]), token_type_ids=torch.zeros(1, len(ids), dtype=torch.long))


def _ours(bert_ckpt: str) -> Any:
    from engine_models_bert.bert import BertModel
    from safetensors.torch import load_file
    from transformers import AutoConfig

    model = BertModel(AutoConfig.from_pretrained(bert_ckpt))
    model.load_weights(load_file(os.path.join(bert_ckpt, "model.safetensors")).items())
    return model.eval()


def test_packed_batch_equals_transformers_per_row(bert_ckpt: str, hf_bert: Any) -> None:
    prompts = _prompts(0, [7, 1, 19, 3])
    model = _ours(bert_ckpt)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    batch = SimpleNamespace(extend_seq_lens_cpu=[len(p) for p in prompts], extra={})
    hidden = model.forward_hidden(ids, positions, batch)  # type: ignore[arg-type]
    start = 0
    for p in prompts:
        ref = _hf_states(hf_bert, p)
        torch.testing.assert_close(hidden[start : start + len(p)], ref.last_hidden_state[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.pooled_output(hidden[start : start + 1]), ref.pooler_output, atol=1e-5,
                                   rtol=1e-5)
        start += len(p)


def test_masked_lm_checkpoint_loads_its_encoder(bert_ckpt: str, hf_bert: Any) -> None:
    from engine_models_bert.bert import BertForMaskedLM
    from transformers import AutoConfig

    state = {f"bert.{k}": v for k, v in hf_bert.state_dict().items() if not k.startswith("pooler.")}
    state["cls.predictions.bias"] = torch.zeros(3)
    model = BertForMaskedLM(AutoConfig.from_pretrained(bert_ckpt))
    model.load_weights(state.items())
    assert model.has_pooler is False
    ids = _prompts(1, [9])[0]
    hidden = model.forward_hidden(torch.tensor(ids), torch.arange(len(ids)),
                                  SimpleNamespace(extend_seq_lens_cpu=[len(ids)], extra={}))  # type: ignore[arg-type]
    torch.testing.assert_close(hidden, _hf_states(hf_bert, ids).last_hidden_state[0], atol=1e-5, rtol=1e-5)


def test_scheduler_embeds_like_sentence_transformers_mean_pooling(bert_ckpt: str, hf_bert: Any, tmp_path: Any) -> None:
    """Through the scheduler (batched prefill, no KV kept): mean pooling and L2 normalisation,
    read from sentence-transformers' files, equal transformers' states pooled by hand."""
    ckpt = tmp_path / "st"
    ckpt.mkdir()
    for name in os.listdir(bert_ckpt):
        os.symlink(os.path.join(bert_ckpt, name), ckpt / name)
    (ckpt / "1_Pooling").mkdir()
    (ckpt / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                "pooling_mode_mean_tokens": True}))
    (ckpt / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    sched = make_scheduler(str(ckpt), task="embed", chunked_prefill_size=8, max_prefill_tokens=40)
    assert sched.runner.token_to_kv_pool.bytes_per_token() == 0  # an encoder keeps no K/V
    prompts = _prompts(2, [5, 30, 12, 30, 2])  # 30 > the chunk size: encoders run whole prompts
    out = embed_prompts(sched, prompts)
    for p, got in zip(prompts, out):
        ref = torch.nn.functional.normalize(_hf_states(hf_bert, p).last_hidden_state[0].mean(0), dim=0)
        torch.testing.assert_close(torch.tensor(got["embedding"]), ref, atol=1e-5, rtol=1e-5)
        assert got["prompt_tokens"] == len(p) and got["cached_tokens"] == 0
    check_no_leak(sched)


def test_too_long_and_out_of_vocabulary_inputs_fail_alone(bert_ckpt: str) -> None:
    sched = make_scheduler(bert_ckpt, task="embed")
    good, long, bad = [5, 6, 7], list(range(5, 5 + 129)), [5, 4096]
    out = embed_prompts(sched, [good, long, bad])
    assert out[0]["error"] is None and len(out[0]["embedding"]) == 32
    assert "context length is 128" in out[1]["error"]["message"]
    assert "outside the vocabulary" in out[2]["error"]["message"]
    check_no_leak(sched)
