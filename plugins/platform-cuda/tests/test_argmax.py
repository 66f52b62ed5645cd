"""The greedy argmax kernel (``argmax.argmax_rows``) against ``torch.argmax``: equal ids, not close.

Without a GPU the kernel runs in Triton's interpreter (the root conftest sets ``TRITON_INTERPRET=1``)
on CPU tensors; on a GPU the same tests run compiled on CUDA tensors (test_argmax_gpu.py adds the
decode shapes there). ``programs`` forces how many programs share a batch, so short rows also take
the split path (partials, ticket) and the loop over several tiles per program.
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_platform_cuda import argmax
from engine_platform_cuda.argmax import BLOCK, argmax_rows, plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="no GPU and Triton's interpreter is off (TRITON_INTERPRET=1 runs these on CPU)")
NAN, NEG_INF = float("nan"), float("-inf")


@pytest.fixture
def programs(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """``programs(k)``: the kernel plans for ``k`` programs over the batch from now on."""
    def force(k: int) -> None:
        monkeypatch.setattr(argmax, "_target_programs", lambda device: k)
    return force


def _check(x: torch.Tensor) -> None:
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got.cpu(), torch.argmax(x.cpu(), dim=-1))


def test_torch_semantics_this_file_relies_on() -> None:
    """torch.argmax on the CPU: first index among equal maxima, first NaN above every number
    (+inf included), 0 for a row of all -inf. The kernel's docstring promises the same."""
    x = torch.tensor([[1.0, 5.0, 5.0, 2.0], [1.0, NAN, float("inf"), NAN], [NEG_INF] * 4])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.argmax(x.to(dtype), dim=-1).tolist() == [1, 1, 0]


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("vocab", [1, 7, 8192, 8193, 151936])
def test_random_rows_match_torch(rows: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + vocab)
    _check(torch.randn(rows, vocab, generator=gen).to(DEVICE))


def test_bf16_and_fp16_rows_with_natural_ties() -> None:
    """151936 normal draws in bf16 repeat their maximum now and then: the first must win."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 151936, generator=gen)
    _check(x.to(torch.bfloat16).to(DEVICE))
    _check(x.to(torch.float16).to(DEVICE))


def test_strided_rows_are_read_in_place() -> None:
    x = torch.randn(3, 2 * 9000).to(DEVICE)
    _check(x[:, 100:9100])  # row stride 18000, not the vocab


@pytest.mark.parametrize("forced", [None, 15])
def test_ties_go_to_the_lowest_index(programs, forced: int | None) -> None:  # type: ignore[no-untyped-def]
    """The maximum repeated: within one tile, in the same lane of tiles of one program (``forced``
    = 15: three programs a row, four tiles each), and across programs (default: one tile each)."""
    n = 10 * BLOCK + 5
    x = torch.randn(5, n).clamp(max=3.0)
    x[0, [7, 9]] = 4.0  # one tile
    x[1, [40, 40 + BLOCK, 40 + 2 * BLOCK]] = 4.0  # one lane, several tiles
    x[2, [BLOCK - 1, BLOCK, 9 * BLOCK + 3]] = 4.0  # neighbouring tiles, and the last one
    x[3, [5 * BLOCK + 1, n - 1]] = 4.0
    x[4] = 1.0  # all equal
    if forced is not None:
        programs(forced)
    if forced is not None:
        assert plan(5, n, forced) == (4, 3)
    _check(x.to(DEVICE))
    assert argmax_rows(x.to(DEVICE)).tolist() == [7, 40, BLOCK - 1, 5 * BLOCK + 1, 0]


@pytest.mark.parametrize("forced", [None, 12])  # 12: three programs a row, four tiles each
@pytest.mark.parametrize("vocab", [7, 20000])
def test_the_first_nan_wins_over_every_number(programs, forced: int | None, vocab: int) -> None:  # type: ignore[no-untyped-def]
    if forced is not None:
        programs(forced)
    x = torch.randn(4, vocab)
    x[0, [vocab - 1, 2]] = NAN  # two NaNs: the first, in another tile when vocab is long
    x[1, 0] = float("inf")
    x[1, vocab // 2] = NAN
    x[2, :] = NAN
    x[3, vocab - 1] = NAN
    _check(x.to(DEVICE))


@pytest.mark.parametrize("vocab", [7, 20000])
def test_rows_of_minus_infinity_give_index_0(vocab: int) -> None:
    x = torch.full((3, vocab), NEG_INF)
    x[1, vocab - 1] = -1e30  # any number beats -inf
    _check(x.to(DEVICE))
    _check(x.to(torch.bfloat16).to(DEVICE))


def test_calls_in_a_row_reuse_the_workspace(programs) -> None:  # type: ignore[no-untyped-def]
    """The last program of a row puts its ticket back to 0: a second call, and one with more rows
    (the workspace grows), agree with torch too, and every ticket is 0 after each call."""
    programs(15)
    for rows, seed in ((2, 0), (2, 1), (5, 2), (2, 3)):
        x = torch.randn(rows, 30000, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        _check(x)
        assert int(argmax._WORKSPACES[x.device].tickets.abs().sum()) == 0


def test_plan_fills_the_gpu_and_keeps_short_rows_whole() -> None:
    assert plan(1, 151936, 132) == (1, 75)  # one tile a program: 75 programs
    assert plan(8, 151936, 132) == (5, 15)  # 120 programs
    assert plan(64, 151936, 132) == (38, 2)
    assert plan(256, 151936, 132) == (75, 1)  # the batch alone fills the GPU
    assert plan(1, 8192, 132) == (4, 1)  # short: one program, no ticket
    assert plan(1, 8193, 132) == (1, 5)


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(2, 3, 4), torch.zeros(3, 4, dtype=torch.int32),
                                 torch.zeros(3, 0), torch.zeros(4, 3).t()],
                         ids=["1d", "3d", "int32", "empty-vocab", "strided-vocab"])
def test_bad_logits_name_the_argument_and_what_is_accepted(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"argmax_rows: logits of shape .*; accepted: "):
        argmax_rows(bad.to(DEVICE))


def test_no_rows_give_no_ids_and_one_column_any_stride() -> None:
    assert argmax_rows(torch.zeros(0, 10, device=DEVICE)).shape == (0,)
    assert argmax_rows(torch.randn(1, 3, device=DEVICE).t()).tolist() == [0, 0, 0]  # [3, 1], strides (1, 3)


def test_the_platform_offers_it_with_cuda_argmax_on() -> None:
    from engine.errors import ConfigError
    from engine_platform_cuda.kernels import layer_kernels
    from engine_platform_cuda.platform import CudaPlatform

    assert layer_kernels(argmax=True)["argmax"] is argmax_rows
    assert layer_kernels(gemv_max_rows=0, qkv_prologue=False, argmax=True)["argmax"] is argmax_rows
    assert "argmax" not in layer_kernels()
    assert CudaPlatform(options={"argmax": True}).layer_kernels()["argmax"] is argmax_rows
    assert "argmax" not in CudaPlatform().layer_kernels()  # off by default
    with pytest.raises(ConfigError, match=r"cuda.argmax: invalid value 'yes'; accepted: on/true or off/false"):
        CudaPlatform(options={"argmax": "yes"})
