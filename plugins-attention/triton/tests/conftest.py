"""Fixtures shared by the triton backend's tests."""

from __future__ import annotations

import random

import pytest
import torch


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, applied to torch and random; quoted in failure messages."""
    value = random.SystemRandom().randrange(2**31)
    torch.manual_seed(value)
    random.seed(value)
    return value
