"""engine.distributed and the parallel layers without process groups (one rank's view)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import distributed
from engine.errors import ConfigError
from engine.layers.pipeline import pp_layer_range
from engine.layers.vocab_parallel_embedding import VocabParallelEmbedding, padded_vocab_size


@pytest.fixture
def tp_rank_1_of_2() -> object:
    distributed.set_tensor_model_parallel(1, 2)
    yield
    distributed.set_tensor_model_parallel(0, 1)


def test_single_rank_collectives_are_identities() -> None:
    x = torch.ones(3)
    assert distributed.tensor_model_parallel_all_reduce(x) is x
    assert distributed.broadcast_objects(["a"]) == ["a"]
    assert distributed.all_reduce_min(7) == 7


def test_vocab_rows_are_padded_and_each_rank_loads_its_own(tp_rank_1_of_2: object) -> None:
    assert padded_vocab_size(2051, 2) == 2052
    emb = VocabParallelEmbedding(5, 3)
    full = torch.arange(15, dtype=torch.float32).view(5, 3)
    emb.weight_loader(emb.weight, full)
    # Rank 1 of 2 holds rows 3..5 of the vocabulary padded to 6: rows 3, 4 and a zero row.
    assert torch.equal(emb.weight.data, torch.cat([full[3:], torch.zeros(1, 3)]))


def test_tp_size_must_divide_heads_and_mlp() -> None:
    cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=4)
    distributed.check_model_parallel(cfg, 4, 1)  # 2 KV heads < 4 ranks: replicated
    with pytest.raises(ConfigError, match=r"--tp-size: invalid value 3 .*accepted: 1, 2, 4, 8"):
        distributed.check_model_parallel(cfg, 3, 1)
    with pytest.raises(ConfigError, match=r"--pp-size: invalid value 5; accepted: at most the model's 4 layers"):
        distributed.check_model_parallel(cfg, 1, 5)


def test_pipeline_stages_cover_every_layer_once() -> None:
    ranges = [pp_layer_range(10, r, 3) for r in range(3)]
    assert ranges == [(0, 3), (3, 6), (6, 10)]


def test_one_shot_all_reduce_needs_nccl() -> None:
    assert distributed.OneShotAllReduce.create(None, "gloo", 0) is None


def test_one_shot_all_reduce_needs_the_group_on_one_host(monkeypatch: pytest.MonkeyPatch) -> None:
    assert distributed.OneShotAllReduce.create(None, "nccl", 0, one_host=False) is None

    # Two nodes of two ranks each (--nnodes 2): rank r runs on host r // 2.
    def gather(out: list, obj: object, group: object = None) -> None:
        out[:] = ["node-a", "node-a", "node-b", "node-b"]

    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)

    def placement(rank: int, tp: int, pp: int) -> distributed.RankPlacement:
        return distributed.RankPlacement(rank=rank, tp_size=tp, pp_size=pp, local_rank=rank % 2,
                                         init_method="tcp://127.0.0.1:1", timeout_s=1.0)

    assert distributed.tp_group_on_one_host(placement(2, 2, 2))  # stage 1: ranks 2, 3 on node-b
    assert distributed.tp_group_on_one_host(placement(1, 2, 2))  # stage 0: ranks 0, 1 on node-a
    assert not distributed.tp_group_on_one_host(placement(1, 4, 1))  # one group over both nodes
