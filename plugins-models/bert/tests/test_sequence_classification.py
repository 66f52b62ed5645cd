"""``BertForSequenceClassification`` (cross-encoders, ``--task score``): logits equal
transformers' on a tiny random checkpoint (float32, CPU), for single texts and text pairs with
segment ids, through the scheduler's pooling path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

# float32 on the CPU through other kernels than transformers': summation order only.
ATOL = 1e-4

# (token ids, segment ids or None): [CLS]=2 ... [SEP]=3, pairs as a BERT tokenizer encodes them.
INPUTS: list[tuple[list[int], list[int] | None]] = [
    ([2, 50, 51, 52, 3], None),
    ([2, 60, 61, 3, 70, 71, 72, 73, 3], [0, 0, 0, 0, 1, 1, 1, 1, 1]),
    ([2, 80, 3, 90, 3], [0, 0, 0, 1, 1]),
    ([2, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 3], None),
]


@pytest.mark.parametrize("num_labels", [1, 3])
def test_logits_match_transformers(tmp_path: Any, num_labels: int) -> None:
    from engine.testing.checkpoints import load_hf_model, make_tiny_checkpoint
    from engine.testing.harness import embed_prompts, make_scheduler

    path = make_tiny_checkpoint(str(tmp_path), "BertForSequenceClassification", num_labels=num_labels, hidden_size=32,
                                intermediate_size=64, num_attention_heads=4, max_position_embeddings=64)
    scheduler = make_scheduler(path)
    assert scheduler.runner.task == "score" and scheduler.runner.embedding_size == num_labels
    results = embed_prompts(scheduler, [ids for ids, _ in INPUTS], token_type_ids=[types for _, types in INPUTS])
    assert [r["error"] for r in results] == [None] * len(INPUTS)
    got = [torch.tensor(r["embedding"]) for r in results]
    hf = load_hf_model(path, reference="BertForSequenceClassification")
    for i, (ids, types) in enumerate(INPUTS):
        with torch.no_grad():
            segments = torch.tensor([types]) if types is not None else None
            ref = hf(torch.tensor([ids]), token_type_ids=segments).logits[0]
        ours = got[i]
        err = (ours - ref).abs().max().item()
        assert err <= ATOL, f"input {i}: max abs logit error {err} > {ATOL} ({ours} vs {ref})"
    # The segment ids matter: the same tokens as one segment score differently.
    with torch.no_grad():
        one_segment = hf(torch.tensor([INPUTS[1][0]])).logits[0]
    assert (one_segment - got[1]).abs().max().item() > 10 * ATOL


def test_a_checkpoint_without_pooler_is_refused(tmp_path: Any) -> None:
    from engine_models_bert.classification import BertForSequenceClassification

    from engine.errors import ModelLoadError
    from engine.testing.checkpoints import tiny_config

    config = tiny_config("BertForSequenceClassification", num_labels=2, hidden_size=32, intermediate_size=64,
                         num_attention_heads=4, max_position_embeddings=64, num_hidden_layers=1)
    model = BertForSequenceClassification(config)
    weights = [(f"bert.{name}", p.detach()) for name, p in model.named_parameters()
               if not name.startswith(("pooler.", "classifier."))]
    weights += [(name, p.detach()) for name, p in model.named_parameters() if name.startswith("classifier.")]
    with pytest.raises(ModelLoadError, match="no pooler weights"):
        model.load_weights(weights)


@pytest.mark.parametrize("pooling", [None, "cls", "mean"])
def test_embed_pools_as_sentence_transformers(tmp_path: Any, pooling: str | None) -> None:
    """``--task embed`` on a classification checkpoint pools the encoder's token states (no pooler,
    no classifier) as sentence-transformers does: its ``1_Pooling`` mode when the checkpoint has
    modules.json, else mean pooling, as sentence-transformers builds for a plain checkpoint. The
    last token (``[SEP]``), a decoder's default, is never the vector of a BERT."""
    import json
    import os

    from engine.testing.checkpoints import load_hf_model, make_tiny_checkpoint
    from engine.testing.harness import embed_prompts, make_scheduler

    path = make_tiny_checkpoint(str(tmp_path), "BertForSequenceClassification", num_labels=2, hidden_size=32,
                                intermediate_size=64, num_attention_heads=4, max_position_embeddings=64)
    if pooling is not None:
        os.makedirs(os.path.join(path, "1_Pooling"))
        with open(os.path.join(path, "modules.json"), "w") as f:
            json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                       {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                       {"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"}], f)
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": 32, f"pooling_mode_{'cls_token' if pooling == 'cls' else 'mean_tokens'}": True}, f)
    scheduler = make_scheduler(path, task="embed")
    assert scheduler.runner.task == "embed" and scheduler.runner.pooling_config.method == (pooling or "mean")
    results = embed_prompts(scheduler, [ids for ids, _ in INPUTS])
    assert [r["error"] for r in results] == [None] * len(INPUTS)
    encoder = load_hf_model(path, reference="BertForSequenceClassification").bert
    for i, (ids, _) in enumerate(INPUTS):
        with torch.no_grad():
            states = encoder(torch.tensor([ids])).last_hidden_state[0]
        ref = states[0] if pooling == "cls" else states.mean(0)
        ref = ref / ref.norm()
        ours = torch.tensor(results[i]["embedding"])
        err = (ours - ref).abs().max().item()
        assert err <= ATOL, f"input {i}: max abs error {err} > {ATOL}"
        last = states[-1] / states[-1].norm()
        assert (ours - last).abs().max().item() > 10 * ATOL
