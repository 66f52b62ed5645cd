"""``FusedMoE.fuses_shared`` on the CPU: which shared experts the routed experts' launches take,
and every refusal (``forward(..., shared=...)`` then raises a ValueError naming the rule).

Whether Triton can run on the tensor's device is the one condition the CPU cannot meet, so the
tests that reach the later conditions say it can (``triton_available`` patched to True); each
refusal is checked against a case that is accepted with the same layer, so a rule that stopped
refusing fails here."""

from __future__ import annotations

import pytest
import torch

import engine.layers.moe.layer as layer_module
from engine.layers.moe import FusedMoE, UnquantizedFusedMoEMethod
from engine.layers.moe.small_batch import SMALL_BATCH_MAX_TOKENS, small_batch_applies

# 64 experts, top 2: up to SMALL_BATCH_MAX_TOKENS tokens take the small-batch kernels.
E, TOP_K, H, INTER = 64, 2, 32, 16


def _layer() -> FusedMoE:
    return FusedMoE(E, TOP_K, H, INTER, renormalize=True, params_dtype=torch.float32)


def _shared(chunks: int = 2, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared experts of ``chunks * INTER`` features: gate/up ``[2 * width, H]``, down ``[H, width]``."""
    width = chunks * INTER
    return torch.randn(2 * width, H, dtype=dtype), torch.randn(H, width, dtype=dtype)


@pytest.fixture
def triton_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layer_module, "triton_available", lambda x: True)


def test_accepts_small_batches_of_whole_chunks(triton_here: None) -> None:
    layer = _layer()
    assert small_batch_applies(SMALL_BATCH_MAX_TOKENS, TOP_K, E)
    for tokens in range(1, SMALL_BATCH_MAX_TOKENS + 1):
        for chunks in (1, 3):
            assert layer.fuses_shared(torch.randn(tokens, H), _shared(chunks)), (tokens, chunks)


def test_refuses_where_triton_cannot_run() -> None:
    # The CPU without the patch: the same layer, batch and weights as an accepted case.
    assert not _layer().fuses_shared(torch.randn(1, H), _shared())


def test_refuses_without_shared_weights(triton_here: None) -> None:
    assert not _layer().fuses_shared(torch.randn(1, H), None)


def test_refuses_other_quant_methods_and_activations(triton_here: None) -> None:
    hidden, shared = torch.randn(1, H), _shared()

    class OtherMethod(UnquantizedFusedMoEMethod):
        """Stands for a quant method: only the unquantized method itself runs shared experts."""

    layer = _layer()
    assert layer.fuses_shared(hidden, shared)
    layer.quant_method = OtherMethod()
    assert not layer.fuses_shared(hidden, shared)
    layer = _layer()
    layer.act_fn = torch.nn.functional.gelu  # not SwiGLU: the kernels' epilogue is SiLU-and-mul
    assert not layer.fuses_shared(hidden, shared)


def test_refuses_batches_the_small_batch_kernels_do_not_take(triton_here: None) -> None:
    tokens = SMALL_BATCH_MAX_TOKENS + 1
    assert not small_batch_applies(tokens, TOP_K, E)
    assert not _layer().fuses_shared(torch.randn(tokens, H), _shared())


def test_refuses_weights_that_are_not_whole_chunks(triton_here: None) -> None:
    layer, hidden = _layer(), torch.randn(1, H)
    gate_up, down = _shared()
    refused = {
        "width not a multiple of I": (torch.randn(2 * (INTER + 4), H), torch.randn(H, INTER + 4)),
        "gate/up rows not twice the width": (gate_up[: 3 * INTER], down),
        "other hidden size": (torch.randn(gate_up.shape[0], H + 8), torch.randn(H + 8, down.shape[1])),
        "other dtype": _shared(dtype=torch.bfloat16),
        "down transposed in memory": (gate_up, down.t().contiguous().t()),
        "gate/up transposed in memory": (gate_up.t().contiguous().t(), down),
        "down not 2-D": (gate_up, down.unsqueeze(0)),
    }
    for why, shared in refused.items():
        assert not layer.fuses_shared(hidden, shared), why


def test_forward_raises_on_a_refused_shared() -> None:
    layer = _layer()
    with pytest.raises(ValueError, match="fuses_shared"):
        layer(torch.randn(1, H), torch.randn(1, E), shared=_shared())
