"""The CUDA paths of ``w8a8_int8``: the compiled Triton kernels at Llama-3-8B shapes against the
torch reference of their path, CUDA-graph capture, and a tiny model's greedy output with graphs
on and off.

Tolerances: the W8A8 path computes the reference's numbers exactly (same int8 codes and scales,
exact int32 sums, the same float32 epilogue and rounding), so its codes must be equal and its
output equal up to a rare last-bit difference. The weight-only path differs from its float32
reference only in the order of the float32 sums, which can move a bfloat16 output by one ulp.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from engine.testing.checkpoints import make_tiny_checkpoint
from engine.testing.harness import generate_greedy, make_scheduler
from engine_quant_int8 import gemm, kernels_w8a8
from engine_quant_int8.quantize import quantize_per_channel, quantize_per_token

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
# Llama-3-8B's linears (in -> out): qkv, o, gate_up, down.
LLAMA_8B = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


@pytest.fixture(autouse=True)
def _no_tf32() -> Iterator[None]:
    """The float32 reference matmul must be a float32 one."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _layer(k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=DEV) * (k ** -0.5)
    qw, sw = quantize_per_channel(w)
    bias = torch.randn(n, generator=gen, device=DEV).to(torch.bfloat16)
    return qw, sw, bias


def _activations(m: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=DEV)
    x[:, :8] *= 20  # outlier channels, as real activations have
    return x.to(dtype)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("shape", list(LLAMA_8B))
@pytest.mark.parametrize("m", [1, 16, 64])
def test_weight_only_path_at_llama_8b_shapes(shape: str, m: int) -> None:
    k, n = LLAMA_8B[shape]
    qw, sw, bias = _layer(k, n, seed=m)
    x = _activations(m, k, seed=m + 1)
    got = gemm.w8a16_linear(x, qw, sw, bias)
    want = gemm.w8a16_reference(x, qw, sw, bias)
    assert _rel(got, want) <= 2e-3


@pytest.mark.parametrize("shape", list(LLAMA_8B))
@pytest.mark.parametrize("m", [17, 64, 256])
@pytest.mark.parametrize("large_m_gemm", ["triton", "int_mm"])
def test_w8a8_path_at_llama_8b_shapes(shape: str, m: int, large_m_gemm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemm, "LARGE_M_GEMM", large_m_gemm)
    k, n = LLAMA_8B[shape]
    qw, sw, bias = _layer(k, n, seed=m)
    x = _activations(m, k, seed=m + 1)
    q, scale = kernels_w8a8.quantize_per_token(x)
    # The reference runs on the CPU: CUDA's torch divides by a Python scalar as a multiplication by
    # its reciprocal (one ulp off IEEE division), the kernel and the CPU divide exactly (div_rn).
    q_ref, scale_ref = quantize_per_token(x.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(scale.cpu(), scale_ref.reshape(-1))
    got = gemm.w8a8_linear(x, qw, sw, bias)
    # The integer products are exact; what differs is the float32 rescale and the bf16 output
    # rounding. Measured on an H100 (2026-11-23): up to 1.66e-4 (int_mm, M=256, down); a wrong
    # scale or row gives errors of order 1.
    assert _rel(got, gemm.w8a8_reference(x, qw, sw, bias)) <= 5e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 300])
def test_other_activation_dtypes_and_static_scale(dtype: torch.dtype, m: int) -> None:
    qw, sw, bias = _layer(1000, 520, seed=3)  # sizes no tile divides
    x = _activations(m, 1000, seed=4, dtype=dtype)
    b = bias.to(dtype)
    input_scale = (x.float().abs().amax() / 200).reshape(1)  # half the range: outliers clip
    got = gemm.int8_linear(x, qw, sw, b, input_scale)
    if m <= gemm.WEIGHT_ONLY_MAX_M:
        assert _rel(got, gemm.w8a16_reference(x, qw, sw, b)) <= (1e-5 if dtype == torch.float32 else 2e-3)
    else:
        assert _rel(got, gemm.w8a8_reference(x, qw, sw, b, input_scale)) <= 1e-4


@pytest.mark.parametrize("m", [1, 8, 64, 65, 256])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_cuda_graph_replay_equals_eager(m: int, static: bool) -> None:
    k, n = LLAMA_8B["qkv"]
    qw, sw, bias = _layer(k, n, seed=5)
    input_scale = torch.tensor([0.05], device=DEV) if static else None
    static_x = _activations(m, k, seed=6)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gemm.int8_linear(static_x, qw, sw, bias, input_scale)  # compile outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_out = gemm.int8_linear(static_x, qw, sw, bias, input_scale)
    for seed in (7, 8):
        static_x.copy_(_activations(m, k, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, gemm.int8_linear(static_x, qw, sw, bias, input_scale))


def test_tiny_model_greedy_is_the_same_with_cuda_graphs_on_and_off(tmp_path: object) -> None:
    checkpoint = make_tiny_checkpoint(str(tmp_path), "LlamaForCausalLM")
    rng = random.Random(11)
    # 130 prompt tokens: prefill runs the W8A8 path, decode (5 requests) the weight-only one.
    prompts = [[rng.randrange(4, 2048) for _ in range(n)] for n in (3, 9, 17, 33, 68)]
    outputs = []
    for disable in (False, True):
        scheduler = make_scheduler(checkpoint, platform="cuda", quant="w8a8_int8", dtype="bfloat16",
                                   attention="triton", disable_cuda_graph=disable)
        outputs.append(generate_greedy(scheduler, prompts, 24, ignore_eos=True))
    assert outputs[0] == outputs[1]
    assert all(len(o) == 24 for o in outputs[0])
