from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def llama_ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama-e2e")), "LlamaForCausalLM")
