"""Reproducible kit draws: the attention kit picks its batch shapes with ``random.Random()`` and
its tensors with torch's global generator, so both are pinned here and a failing case comes back
on the next run."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from engine.testing import conformance

SEED = 1234


@pytest.fixture(autouse=True)
def seeded_kit(monkeypatch):  # type: ignore[no-untyped-def]
    torch.manual_seed(SEED)
    monkeypatch.setattr(conformance, "random",
                        SimpleNamespace(Random=lambda seed=SEED: random.Random(seed)))
