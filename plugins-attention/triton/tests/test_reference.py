"""The torch reference itself, on the CPU: the oracle must be right before it judges kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from engine_attention_triton.reference import reference_decode, reference_extend


def _paged_row(
    k_rows: torch.Tensor, page_size: int, pool_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatters a row's K into a pool on shuffled pages; returns (pool, slots per position)."""
    n = k_rows.shape[0]
    pages = torch.randperm(pool_rows // page_size - 1)[: -(-n // page_size)] + 1
    slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:n]
    pool = torch.randn(pool_rows, *k_rows.shape[1:], dtype=k_rows.dtype)
    pool[slots] = k_rows
    return pool, slots


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """torch's own attention on ``[L, H, D]`` tensors with a boolean ``[Lq, Lk]`` mask."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


def test_extend_over_paged_prefix_matches_sdpa() -> None:
    heads, kv_heads, dim, prefix, new = 8, 2, 32, 37, 11
    total = prefix + new
    q = torch.randn(new, heads, dim, dtype=torch.float64)
    k_all = torch.randn(total, kv_heads, dim, dtype=torch.float64)
    v_all = torch.randn(total, kv_heads, dim, dtype=torch.float64)
    k_pool, slots = _paged_row(k_all, 4, 128)
    v_pool = torch.randn_like(k_pool)
    v_pool[slots] = v_all
    req_to_token = torch.randint(0, 128, (3, 64), dtype=torch.int32)
    req_to_token[2, :total] = slots.to(torch.int32)

    for window in (-1, 5):
        out = reference_extend(q, k_all[prefix:], v_all[prefix:], k_pool, v_pool, req_to_token,
                               [2], [prefix], [new], dim**-0.5, 0.0, window)
        qpos = torch.arange(prefix, total)[:, None]
        kpos = torch.arange(total)[None, :]
        mask = kpos <= qpos
        if window >= 0:
            mask &= qpos - kpos <= window
        expected = _sdpa(q, k_all, v_all, mask)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)

        # Decode at the last position agrees with extend's last query.
        dec = reference_decode(q[-1:], k_pool, v_pool, req_to_token, [2], [total], dim**-0.5,
                               0.0, window)
        torch.testing.assert_close(dec, out[-1:], rtol=1e-10, atol=1e-10)


def test_logit_cap_is_a_tanh_soft_cap() -> None:
    q = torch.randn(1, 1, 4, dtype=torch.float64) * 10
    k = torch.randn(3, 1, 4, dtype=torch.float64)
    v = torch.randn(3, 1, 4, dtype=torch.float64)
    req_to_token = torch.arange(3, dtype=torch.int32)[None, :]
    out = reference_decode(q, k, v, req_to_token, [0], [3], 0.5, logit_cap=2.0)
    scores = 2.0 * torch.tanh((k[:, 0] @ q[0, 0]) * 0.5 / 2.0)
    expected = torch.softmax(scores, 0) @ v[:, 0]
    torch.testing.assert_close(out[0, 0], expected, rtol=1e-12, atol=1e-12)


def test_importing_the_package_loads_no_triton_or_cuda() -> None:
    code = (
        "import sys, torch, engine_attention_triton, engine_attention_triton.reference\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA was initialised'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
