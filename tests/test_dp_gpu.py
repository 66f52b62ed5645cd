"""``--dp-size 2`` on two GPUs: each replica on its own device, greedy outputs equal DP=1 (bf16,
CUDA graphs and overlap on), and the cache-aware router keeps a shared prefix on one replica."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

_GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("dp-gpu")), "LlamaForCausalLM", dtype="bfloat16",
                                hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def _run(ckpt: str, dp: int, prompts: list[list[int]]) -> tuple[list[list[int]], list[Any], list[str]]:
    from engine.entrypoints.engine import Engine

    engine = Engine(model_path=ckpt, dp_size=dp, attention="triton", max_total_tokens=16384, log_level="warning")
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=_GREEDY)
        devices = [r.device for r in engine.runtime.replicas]
    finally:
        engine.shutdown()
    return [o["output_ids"] for o in outs], [o["meta_info"].get("dp_rank") for o in outs], devices


def test_dp2_on_two_gpus_equals_dp1(ckpt: str) -> None:
    shared = list(range(100, 164))
    prompts = [shared + [i, i + 1] for i in range(8)] + [[7 + i, 30 + i, 9] for i in range(8)]
    want, _, _ = _run(ckpt, 1, prompts)
    got, ranks, devices = _run(ckpt, 2, prompts)
    assert devices == ["cuda:0", "cuda:1"]
    assert got == want
    assert set(ranks) == {0, 1}
