"""Tiny checkpoints and cached random PEFT adapters for the LoRA tests (PEFT is the oracle)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture(scope="session")
def peft_adapter(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """``peft_adapter(base, name, r, targets, seed, **kw)``: a random adapter directory, made
    once per session for the same arguments (``make_peft_adapter``)."""
    from engine.testing.conformance.lora import make_peft_adapter

    made: dict[tuple[Any, ...], str] = {}

    def make(base: str, name: str, r: int, targets: Any, seed: int, **kw: Any) -> str:
        key = (base, name, r, tuple(targets), seed, tuple(sorted(kw.items())))
        if key not in made:
            out = os.path.join(str(tmp_path_factory.mktemp("lora")), name)
            made[key] = make_peft_adapter(base, out, r, targets, seed, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3")), "Qwen3ForCausalLM")
