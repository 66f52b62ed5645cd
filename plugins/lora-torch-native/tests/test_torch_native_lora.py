from __future__ import annotations

import torch
from engine_lora_torch_native.backend import TorchNativeLoraBackend

from engine.testing import LoraBackendConformance
from engine.testing.conformance.lora import (
    check_lora_backend,
    random_batch_info,
    random_pool_weights,
)


class TestTorchNativeLora(LoraBackendConformance):
    backend_name = "torch_native"


def test_per_slot_path_matches_reference() -> None:
    """The accelerator path (masked matmul per slot, slots found on the device) run on the CPU."""
    check_lora_backend(TorchNativeLoraBackend(per_segment=False), "cpu")


def test_gathered_path_matches_reference() -> None:
    """Batches of few tokens over several segments (decode) run as gathered batched products."""
    check_lora_backend(TorchNativeLoraBackend(per_segment=True, gather_max_tokens=1 << 20), "cpu")


def test_padding_tokens_beyond_the_segments_are_untouched() -> None:
    gen = torch.Generator().manual_seed(0)
    info = random_batch_info(gen, [3, 2], [1, 2], torch.device("cpu"))
    a, b = random_pool_weights(gen, 1, 16, 8, torch.device("cpu"), torch.float32)
    backend = TorchNativeLoraBackend(per_segment=False)
    x = torch.randn(8, 16)  # 5 tokens in segments, 3 of padding (a CUDA graph's larger batch)
    y = backend.shrink(x, a, info)
    assert torch.equal(y[5:], torch.zeros_like(y[5:]))
    out = torch.randn(8, 8)
    before = out.clone()
    backend.expand(y, b, info, out, [0, 8])
    assert torch.equal(out[5:], before[5:])
    assert not torch.equal(out[:5], before[:5])


def test_fold_max_rows_option() -> None:
    import pytest
    from engine_lora_torch_native.backend import TorchNativeLoraBackend

    from engine.errors import ConfigError

    assert TorchNativeLoraBackend().fold_max_rows == 0
    assert TorchNativeLoraBackend(options={"fold_max_rows": 32}).fold_max_rows == 32
    with pytest.raises(ConfigError, match=r"lora_torch_native.fold_max_rows: invalid value -1; accepted"):
        TorchNativeLoraBackend(options={"fold_max_rows": -1})
