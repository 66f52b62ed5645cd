"""What every kit class shares: device selection and reproducible random draws."""

from __future__ import annotations

import zlib

import pytest
import torch

from engine.platforms import device_type_available

#: The kit's fixed base seed. A class may set its own ``seed``; every test derives its
#: draws from that and its own parameters, so a failure reproduces on a re-run.
KIT_SEED = 20240917


def device_or_skip(device: str) -> torch.device:
    """``torch.device(device)``, or a skip with a reason where that device is absent."""
    kind = torch.device(device).type
    if kind != "cpu" and not device_type_available(kind):
        pytest.skip(f"needs a {kind.upper()} device (this kit class runs on device '{device}')")
    return torch.device(device)


def derive_seed(base: int, *parts: object) -> int:
    """A seed for one test from the class's base seed and the test's parameters.

    ``crc32`` of the parameters' text, not ``hash()``: Python salts string hashes per
    process, which would give a different seed on every run.
    """
    text = "|".join(str(p) for p in (base, *parts))
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def generator(seed: int) -> torch.Generator:
    """A CPU generator: tensors are drawn on the CPU and moved, so CPU and GPU runs see the
    same numbers for the same seed."""
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(gen: torch.Generator, *shape: int, device: torch.device, dtype: torch.dtype = torch.float32,
          scale: float = 1.0) -> torch.Tensor:
    """Standard normal draws from ``gen``, scaled, on ``device`` in ``dtype``."""
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)
