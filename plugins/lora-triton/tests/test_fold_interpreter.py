"""The folded expand (``engine_lora_triton.fold``) against the torch loop, under Triton's interpreter.

``h`` is built as the layer's GEMM makes it, ``x @ [W; A_0; ...]^T``; the kernel's output must
equal ``reference_fold_expand`` and, through it, shrink-then-expand on the base output: empty
segments, rank-0 slots with stale weights, padding tokens after the last segment, one to three
slices, segments of several tokens, more tokens than one token tile, and more pool slots than
the kernel unrolls.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest
import torch
from engine_lora_triton import interpreting
from engine_lora_triton.fold import sgmv_expand_folded

from engine.lora.backend import (
    LoraBatchInfo,
    reference_expand,
    reference_fold_expand,
    reference_shrink,
)
from engine.testing.conformance.lora import random_pool_weights

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (set where no GPU is present)")

# (segment lengths, slots, slot ranks, R, K, slice offsets, padding tokens)
CASES = {
    "decode-qkv": ([1] * 6, [2, 0, 2, 1, 3, 1], [0, 4, 16, 8], 16, 40, [0, 16, 24, 32], 0),
    "decode-padded-empty": ([1, 1, 0, 1, 0], [1, 0, 1, 1, 0], [0, 8], 8, 24, [0, 24], 3),
    "mixed-gate-up": ([5, 0, 19, 1, 0, 3], [1, 2, 0, 1, 1, 2], [0, 8, 4], 8, 48, [0, 21, 37], 2),
    "two-token-tiles": ([1] * 70, [i * 7 % 3 for i in range(70)], [8, 0, 4], 8, 24, [0, 20], 0),
    # The last slot is the base model's (rank 0): the layer's GEMM leaves its columns out of h.
    "qkv-base-last": ([1] * 9 + [2, 0, 4], [i % 4 for i in range(12)], [8, 4, 16, 0], 16, 40, [0, 16, 24, 32], 2),
    "40-slots": ([1] * 20, [i * 7 % 40 for i in range(20)], [8 * (i % 3 > 0) for i in range(40)], 8, 16, [0, 24], 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_expand_matches_the_loop(case: str, dtype: torch.dtype, batch_info: Callable[..., LoraBatchInfo]) -> None:
    torch.manual_seed(sorted(CASES).index(case))
    lens, slots, ranks, r, k, offsets, pad = CASES[case]
    n_slices, n = len(offsets) - 1, offsets[-1]
    info = batch_info(lens, slots, ranks)
    a, b = random_pool_weights(torch.default_generator, n_slices, k, n, torch.device("cpu"), dtype, tuple(ranks), r)
    w = (torch.randn(n, k) / k ** 0.5).to(dtype)
    x = torch.randn(sum(lens) + pad, k).to(dtype)
    h = x @ torch.cat([w, a.reshape(-1, k)]).T
    if ranks[-1] == 0:  # as LoRA layers run it: without the last (base) slot's columns
        h = h[:, :h.shape[1] - n_slices * r]
    got = sgmv_expand_folded(h, b, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                             info.num_segments, offsets)
    want = reference_fold_expand(h, b, info, offsets)
    if set(lens) == {1}:  # segment t is token t (padding rows after): the decode form too
        fast = sgmv_expand_folded(h, b, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                                  info.num_segments, offsets, one_token=True)
        torch.testing.assert_close(fast, got, rtol=0, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == (x.shape[0], n) and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # The fold is the shrink-then-expand of the unfolded layer.
    unfolded = h[:, :n].clone()
    reference_expand(reference_shrink(x, a, info), b, info, unfolded, offsets)
    torch.testing.assert_close(want.float(), unfolded.float(), rtol=tol * 4, atol=tol * 4)


def test_folded_expand_refuses_mismatched_h() -> None:
    info = LoraBatchInfo(num_segments=1, seg_indptr=torch.tensor([0, 2], dtype=torch.int32),
                         weight_indices=torch.tensor([0], dtype=torch.int32),
                         lora_ranks=torch.tensor([4, 0], dtype=torch.int32), scalings=torch.ones(2), max_seg_len=2)
    b = torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match=r"h \(2, 15\) must be \[T, N \+ k \* n_slices \* R\] for k <= 2 slots"):
        sgmv_expand_folded(torch.randn(2, 15), b, info.seg_indptr, info.weight_indices, info.lora_ranks,
                           info.scalings, 1, [0, 8])


@pytest.mark.parametrize("value", [-1, "8", True])
def test_fold_max_rows_option_is_checked(value: object) -> None:
    from engine_lora_triton.backend import create

    from engine.errors import ConfigError

    assert create({"fold_max_rows": 0}).fold_max_rows == 0
    with pytest.raises(ConfigError, match=r"lora-triton.fold_max_rows: invalid value .*; accepted: an integer >= 0"):
        create({"fold_max_rows": value})


def test_fold_min_rows_above_fold_max_rows_is_refused() -> None:
    from engine_lora_triton.backend import create

    from engine.errors import ConfigError

    assert create({"fold_min_rows": 300, "fold_max_rows": 0}).fold_max_rows == 0  # never folds: no conflict
    assert create({"fold_min_rows": 32, "fold_max_rows": 32}).fold_min_rows == 32
    with pytest.raises(ConfigError, match=r"^lora-triton.fold_min_rows: invalid value 300 with "
                                          r"lora-triton.fold_max_rows 256; accepted: fold_min_rows <= fold_max_rows"):
        create({"fold_min_rows": 300})


def test_fold_rows_conflict_exits_2_with_one_line(tmp_path: pathlib.Path) -> None:
    """Start-up through the CLI: the backend is built with the model runner, and its error is the
    command's one-line answer (exit status 2)."""
    import os
    import subprocess
    import sys

    from engine.testing.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(str(tmp_path), "LlamaForCausalLM")
    res = subprocess.run([sys.executable, "-m", "engine", "generate", "--model-path", ckpt, "--prompt", "Hi",
                          "--max-new-tokens", "2", "--enable-lora", "--lora-backend", "triton",
                          "--plugin-option", "lora-triton.fold_min_rows=64",
                          "--plugin-option", "lora-triton.fold_max_rows=32"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    errors = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("error:")]
    assert res.returncode == 2, res.stderr[-2000:]
    assert errors == ["error: lora-triton.fold_min_rows: invalid value 64 with lora-triton.fold_max_rows 32; "
                      "accepted: fold_min_rows <= fold_max_rows (or fold_max_rows 0: never fold the shrink into "
                      "the base GEMM)"], res.stderr[-2000:]
