"""The embedded default model (SmolLM2-135M-Instruct) on a GPU in bfloat16 (``--dtype auto``
there), with each attention backend: greedy answers match transformers loading the same GGUF
(bf16 on the GPU, near-ties allowed) and still say Paris."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from engine.testing.default_model import CHATS as DEFAULT_MODEL_CHATS
from engine.testing.default_model import chat_prompt_ids
from engine.testing.harness import cuda_attention_backends

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CHATS = [*DEFAULT_MODEL_CHATS, [{"role": "user", "content": "Write one sentence about the sea."}]]
MAX_NEW = 32
BF16_TIE = 0.25


@pytest.fixture(scope="module")
def model_dir() -> str:
    from engine.model_executor.checkpoint import resolve_checkpoint

    return resolve_checkpoint(None)


@pytest.fixture(scope="module")
def hf_model() -> Any:
    import transformers

    from engine.default_model import default_model_gguf

    path = default_model_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              dtype=torch.float32)
    return model.to("cuda", torch.bfloat16).eval()


@pytest.fixture(scope="module")
def prompts(model_dir: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [chat_prompt_ids(tokenizer, chat) for chat in CHATS]


@pytest.mark.parametrize("attention", cuda_attention_backends())
def test_bf16_greedy_matches_transformers(attention: str, model_dir: str, hf_model: Any,
                                          prompts: list[list[int]]) -> None:
    from transformers import AutoTokenizer

    from engine.testing.checkpoints import hf_greedy
    from engine.testing.conformance import check_greedy_until_near_tie
    from engine.testing.harness import generate_greedy, make_scheduler

    sched = make_scheduler(model_dir, platform="cuda", attention=attention)  # --dtype auto
    assert sched.runner.dtype == torch.bfloat16
    ours = generate_greedy(sched, prompts, MAX_NEW)
    for i, (prompt, got) in enumerate(zip(prompts, ours)):
        ref = hf_greedy(hf_model, prompt, MAX_NEW)
        # A real model's logits reach 15-30, where bfloat16 (transformers computes them in bf16 here)
        # steps by 0.125: a gap of up to two such steps is a rounding tie, not a wrong token.
        check_greedy_until_near_tie(hf_model, prompt, got, ref, MAX_NEW, BF16_TIE, f"{attention} chat {i}")
    answer = AutoTokenizer.from_pretrained(model_dir).decode(ours[0], skip_special_tokens=True)
    # bf16 may break a near-tie at the first token the other way (seen with triton on an H100:
    # '"' vs 'The', one bf16 step apart), after which the answer is a different, still valid text;
    # the parity check above has verified that tie. Where the engine followed transformers, it says Paris.
    if ours[0] == hf_greedy(hf_model, prompts[0], MAX_NEW):
        assert "Paris" in answer, answer
