"""The Triton kernels on a CUDA GPU at Llama-3-8B shapes, in CUDA graphs, and served.

Reference: the torch path (``formats.dequantize``, bit-identical to gguf.quants) in float64.
bfloat16 activations: bar 1e-2 relative (the output's rounding; the bf16 tl.dot inputs).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_quant_gguf import formats
from engine_quant_gguf.kernels import gguf_matmul

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TYPES = {"Q4_0": formats.Q4_0, "Q4_1": formats.Q4_1, "Q8_0": formats.Q8_0, "Q4_K": formats.Q4_K,
         "Q6_K": formats.Q6_K}
# (N, K) of Llama-3-8B's linears: qkv, o, gate_up, down
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 17, 64, 300])  # GEMV (BLOCK_M 1, 2), tl.dot GEMM, dequantize + cuBLAS
def test_kernel_at_llama_8b_shapes(name: str, n: int, k: int, m: int) -> None:
    qtype = TYPES[name]
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    w = formats.random_blocks(n, k, qtype, gen, torch.device("cuda"))
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    want = x.double() @ formats.dequantize(w, qtype).double().T
    got = gguf_matmul(x, formats.pack(w, qtype), qtype, n)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert _rel(got, want) < 1e-2


@pytest.mark.parametrize("name", list(TYPES))
def test_dequantize_kernel_is_bit_identical_on_the_gpu(name: str) -> None:
    qtype = TYPES[name]
    from engine_quant_gguf.kernels import dequantize_blocks

    w = formats.random_blocks(256, 4096, qtype, torch.Generator(device="cuda").manual_seed(4), torch.device("cuda"))
    assert torch.equal(dequantize_blocks(formats.pack(w, qtype), qtype, 4096, torch.float32), formats.dequantize(w, qtype))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_float32_and_float16_activations(name: str) -> None:
    qtype = TYPES[name]
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = formats.random_blocks(512, 1024, qtype, gen, torch.device("cuda"))
    for dtype, bar in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for m in (1, 2, 33):
            x = torch.randn(m, 1024, device="cuda", generator=gen).to(dtype)
            want = x.double() @ formats.dequantize(w, qtype).double().T
            assert _rel(gguf_matmul(x, formats.pack(w, qtype), qtype, 512), want) < bar, (dtype, m)


def test_captured_in_a_cuda_graph_and_replayed() -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    w = formats.pack(formats.random_blocks(4096, 4096, formats.Q4_K, gen, torch.device("cuda")), formats.Q4_K)
    outs = {}
    for m in (1, 32):  # M = 1: the GEMV; M = 32: the tl.dot GEMM with split-K partial sums
        x = torch.randn(m, 4096, device="cuda", generator=gen).bfloat16()
        eager = gguf_matmul(x, w, formats.Q4_K, 4096).clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            gguf_matmul(x, w, formats.Q4_K, 4096)  # warm-up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs[m] = gguf_matmul(x, w, formats.Q4_K, 4096)
        x.copy_(torch.randn(m, 4096, device="cuda", generator=gen).bfloat16())
        graph.replay()
        torch.testing.assert_close(outs[m], gguf_matmul(x, w, formats.Q4_K, 4096), rtol=0, atol=0)
        assert not torch.equal(outs[m], eager)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> str:
    import os

    from engine.model_executor.checkpoint import resolve_checkpoint
    from engine.testing.checkpoints import load_hf_model, make_tiny_checkpoint
    from engine.testing.gguf_files import write_tiny_gguf

    tmp = tmp_path_factory.mktemp("gguf-cuda")
    os.environ.setdefault("ENGINE_CACHE_DIR", str(tmp / "cache"))
    model = load_hf_model(make_tiny_checkpoint(str(tmp / "hf"), "LlamaForCausalLM", hidden_size=256,
                                               intermediate_size=512, num_attention_heads=4, num_key_value_heads=2))
    path = str(tmp / "tiny.gguf")
    write_tiny_gguf(path, model, "Q4_K", overrides={"v_proj": "Q6_K", "down_proj": "Q6_K"})
    return resolve_checkpoint(path)


def test_served_on_cuda_like_the_dequantized_model_graphs_on_and_off(converted: str) -> None:
    from engine.testing.harness import generate_greedy, make_scheduler

    prompts = [[5, 6, 7, 8, 9], [100, 200, 300, 400, 500, 600, 700], [42]]
    common: dict[str, Any] = {"platform": "cuda", "dtype": "float32", "attention": "triton"}
    want = generate_greedy(make_scheduler(converted, **common), prompts, 16)
    for graphs_off in (True, False):
        got = generate_greedy(make_scheduler(converted, quant="gguf", disable_cuda_graph=graphs_off, **common),
                              prompts, 16)
        assert got == want, f"disable_cuda_graph={graphs_off}"
