"""TP=2 (and PP=2) on two GPUs (NCCL), bf16, CUDA graphs and overlap on, against transformers.

Skipped unless two CUDA GPUs are visible. Run with NCCL_NVLS_ENABLE=0 (no NVLink multicast).
Greedy outputs must equal transformers' up to a rounding near-tie (the conformance kit's rule).
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from engine.testing.conformance.model import check_greedy_until_near_tie

pytestmark = pytest.mark.gpu

MAX_NEW = 16


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


needs_two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # head_dim 64 (flashinfer's sizes), 4 heads and 2 KV heads: one KV head per rank at TP=2.
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tp-gpu")), "LlamaForCausalLM",
                                hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                intermediate_size=512, vocab_size=2051)


@pytest.fixture(scope="module")
def hf_model(ckpt: str) -> Any:
    from engine.testing.checkpoints import load_hf_model

    return load_hf_model(ckpt, "bfloat16", "cuda")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in (1, 6, 33, 120)]


@needs_two_gpus
@pytest.mark.parametrize("attention", ["triton", "flashinfer"])
@pytest.mark.parametrize("tp, pp, custom_all_reduce", [(2, 1, False), (2, 1, True), (1, 2, False)],
                         ids=["tp2", "tp2-one-shot-all-reduce", "pp2"])
def test_two_gpu_greedy_matches_transformers(ckpt: str, hf_model: Any, prompts: list[list[int]],
                                             attention: str, tp: int, pp: int, custom_all_reduce: bool) -> None:
    from engine import Engine
    from engine.testing.checkpoints import hf_greedy

    with Engine(model_path=ckpt, tp_size=tp, pp_size=pp, attention=attention, dtype="bfloat16",
                enable_custom_all_reduce=custom_all_reduce, max_total_tokens=8192, log_level="warning") as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
        # Batch 1 goes through a captured CUDA graph (TP all-reduces inside it).
        single = eng.generate(input_ids=prompts[1], sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0})
        info = eng.get_server_info()
    assert info["tp_size"] == tp and info["pp_size"] == pp
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = hf_greedy(hf_model, p, MAX_NEW)
        check_greedy_until_near_tie(hf_model, p, out["output_ids"], ref, MAX_NEW, 0.1,
                                    f"prompt {i} (tp {tp}, pp {pp}, {attention})")
    assert single["output_ids"] == outs[1]["output_ids"]


@needs_two_gpus
def test_more_ranks_than_gpus_is_refused(ckpt: str) -> None:
    from engine import Engine
    from engine.errors import EngineError

    if _gpus() >= 4:
        pytest.skip("4 or more GPUs: TP=4 fits")
    with pytest.raises(EngineError, match="has no GPU"):
        Engine(model_path=ckpt, tp_size=4, max_total_tokens=4096, log_level="warning")


@needs_two_gpus
@pytest.mark.parametrize("disable_cuda_graph", [False, True], ids=["graphs-asked", "graphs-off"])
def test_two_gpu_pp_micro_batches_in_flight(ckpt: str, hf_model: Any, disable_cuda_graph: bool) -> None:
    """PP=2 with enough requests for two micro-batches in flight: greedy equal to transformers.

    Decode under pipeline parallelism runs eagerly whatever the flag says; both settings must
    start and agree.
    """
    from engine import Engine
    from engine.testing.checkpoints import hf_greedy

    rng = random.Random(2)
    prompts = [[rng.randrange(4, 2048) for _ in range(n)] for n in (3, 40, 9, 77, 1, 20, 64, 5)]
    lengths = [16, 4, 16, 9, 16, 1, 12, 16]
    with Engine(model_path=ckpt, pp_size=2, dtype="bfloat16", disable_cuda_graph=disable_cuda_graph,
                chunked_prefill_size=32, max_total_tokens=8192, log_level="warning") as eng:
        outs = eng.generate(input_ids=prompts,
                            sampling_params=[{"max_new_tokens": n, "temperature": 0} for n in lengths])
        info = eng.get_server_info()
    assert info["pp_max_in_flight"] == 2 and info["pp_overlapped_micro_batches"] > 1
    assert info["pp_in_flight_micro_batches"] == 0 and info["kv_used_tokens"] == 0
    for i, (p, n, out) in enumerate(zip(prompts, lengths, outs)):
        ref = hf_greedy(hf_model, p, n)
        check_greedy_until_near_tie(hf_model, p, out["output_ids"], ref, n, 0.1, f"prompt {i} (pp 2, micro-batches)")
