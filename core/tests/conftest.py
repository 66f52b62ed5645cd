from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama checkpoint shared by the core tests."""
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "LlamaForCausalLM")


@pytest.fixture(scope="session")
def hf_llama(llama_ckpt: str):  # type: ignore[no-untyped-def]
    from engine.testing.checkpoints import load_hf_model

    return load_hf_model(llama_ckpt)
