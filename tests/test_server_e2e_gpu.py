"""``engine serve`` on a GPU with each attention backend, CUDA graphs and overlap on (the
defaults there): greedy outputs over HTTP match transformers (bf16, near-ties allowed)."""

from __future__ import annotations

import os
import pathlib
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from engine.testing.harness import cuda_attention_backends

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import API_KEY, MODEL_NAME, Server, launch  # noqa: E402

MAX_NEW = 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    # head_dim 64: a size FlashInfer has kernels for (the default tiny model's 16 is not).
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("gpu-serve")), "LlamaForCausalLM",
                                hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def hf_model(ckpt: str) -> Any:
    from engine.testing.checkpoints import load_hf_model

    return load_hf_model(ckpt, "bfloat16", "cuda")


@pytest.fixture(params=cuda_attention_backends())
def gpu_server(request: pytest.FixtureRequest, ckpt: str, tmp_path: pathlib.Path) -> Any:
    server = launch(ckpt, str(tmp_path), "--attention", request.param, "--dtype", "bfloat16",
                    "--cuda-graph-max-bs", "16")
    try:
        server.wait_ready(timeout=600)  # FlashInfer compiles its kernels at start-up
        yield server
    finally:
        server.stop()


def _generate(server: Server, prompt: list[int]) -> list[int]:
    r = server.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": MAX_NEW, "temperature": 0}})
    r.raise_for_status()
    return r.json()["output_ids"]


def test_serves_greedy_outputs_matching_transformers(gpu_server: Server, hf_model: Any) -> None:
    from openai import OpenAI

    from engine.testing.checkpoints import hf_greedy
    from engine.testing.conformance import check_greedy_until_near_tie

    info = gpu_server.get("/get_server_info").json()
    assert info["device"].startswith("cuda") and info["overlap_schedule"] is True
    assert info["cuda_graph_batch_sizes"][-1] == 16
    rng = random.Random(7)
    prompts = [[rng.randrange(4, 2048) for _ in range(n)] for n in (5, 17, 40, 3, 63, 9, 30, 12)]
    # Concurrent requests: decode batches of several rows run in the captured graphs.
    with ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(lambda p: _generate(gpu_server, p), prompts))
    for i, (prompt, ours) in enumerate(zip(prompts, outputs)):
        ref = hf_greedy(hf_model, prompt, MAX_NEW)
        check_greedy_until_near_tie(hf_model, prompt, ours, ref, MAX_NEW, 0.1, f"prompt {i}")
    after = gpu_server.get("/get_server_info").json()
    assert after["overlapped_decode_steps"] > 0
    # The OpenAI client over the same server: chat streaming works on the GPU path too.
    client = OpenAI(base_url=gpu_server.url + "/v1", api_key=API_KEY)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=8, temperature=0, stream=True)
    finishes = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])  # the stream ran to its end and said why
    final = client.completions.create(model=MODEL_NAME, prompt=prompts[0], max_tokens=MAX_NEW, temperature=0)
    assert 1 <= final.usage.completion_tokens <= MAX_NEW
