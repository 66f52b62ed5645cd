"""Tensor and pipeline parallelism on the CPU (gloo, one process per rank) against transformers.

The checkpoint is chosen to exercise the awkward cases at once: 1 KV head (replicated on both
tensor-parallel ranks), an odd vocabulary (2051 rows: padded to a multiple of the TP size) and
tied embeddings (split from the LM head across pipeline stages).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine import Engine
from engine.errors import EngineError
from engine.testing.checkpoints import hf_greedy, load_hf_model, make_tiny_checkpoint

MAX_NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tp-llama")), "LlamaForCausalLM",
                                vocab_size=2051, num_key_value_heads=1, tie_word_embeddings=True,
                                num_hidden_layers=3)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in (3, 17, 9)]


@pytest.fixture(scope="module")
def expected(ckpt: str, prompts: list[list[int]]) -> list[list[int]]:
    model = load_hf_model(ckpt)
    return [hf_greedy(model, p, MAX_NEW) for p in prompts]


def _generate(ckpt: str, prompts: list[list[int]], **kw: Any) -> list[dict[str, Any]]:
    with Engine(model_path=ckpt, max_total_tokens=512, log_level="warning", **kw) as eng:
        # Twice: the second round hits the prefix cache on every rank alike.
        first = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
        again = eng.generate(input_ids=prompts[:1], sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0},
                             return_logprob=True)
        info = eng.get_server_info()
    assert again[0]["output_ids"] == first[0]["output_ids"]
    assert len(again[0]["meta_info"]["output_token_logprobs"]) == MAX_NEW
    assert info["max_total_num_tokens"] == 512
    return first


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_greedy_equals_transformers(ckpt: str, prompts: list[list[int]], expected: list[list[int]],
                                    tp: int, pp: int) -> None:
    outs = _generate(ckpt, prompts, tp_size=tp, pp_size=pp)
    assert [o["output_ids"] for o in outs] == expected


def test_tp_size_that_does_not_divide_heads_is_refused(ckpt: str) -> None:
    with pytest.raises(EngineError, match=r"--tp-size: invalid value 3 for this model \(4 attention heads.*accepted: 1, 2, 4"):
        Engine(model_path=ckpt, tp_size=3, max_total_tokens=512, log_level="warning")


def test_pp_size_above_layers_is_refused(ckpt: str) -> None:
    with pytest.raises(EngineError, match=r"--pp-size: invalid value 4; accepted: at most the model's 3 layers"):
        Engine(model_path=ckpt, pp_size=4, max_total_tokens=512, log_level="warning")


def test_other_nodes_run_only_through_engine_serve(ckpt: str) -> None:
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--node-rank: invalid value 1 here; .*engine serve --node-rank N"):
        Engine(model_path=ckpt, tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:29999",
               max_total_tokens=512, log_level="warning")
