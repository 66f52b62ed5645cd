"""The offline API: ``Engine(lora_paths=...)``, ``generate(..., lora_path=NAME | [NAME | None])``,
``load_lora_adapter`` / ``unload_lora_adapter`` (one Engine for the module)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from engine.config import LORA_TARGET_MODULES as ALL_TARGETS
from engine.errors import EngineError
from engine.testing.conformance.lora import peft_greedy

PROMPTS = [[5, 17, 99, 250, 31, 8, 1000, 77], [9, 400, 12, 1500, 33, 2, 70], [1200, 4, 8, 15, 16, 23, 42]]
PARAMS = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(llama_ckpt: str, peft_adapter: Callable[..., str]) -> dict[str, str]:
    return {"a": peft_adapter(llama_ckpt, "all8", 8, ALL_TARGETS, seed=11),
            "b": peft_adapter(llama_ckpt, "qv8", 8, ["q_proj", "v_proj"], seed=13)}


@pytest.fixture(scope="module")
def engine(llama_ckpt: str, adapters: dict[str, str]) -> Iterator[Any]:
    from engine.entrypoints.engine import Engine

    eng = Engine(model_path=llama_ckpt, dtype="float32", lora_paths={"a": adapters["a"]}, max_total_tokens=4096)
    yield eng
    eng.shutdown()


def test_generate_per_prompt_adapters(engine: Any, llama_ckpt: str, adapters: dict[str, str]) -> None:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS, lora_path=["a", None, "a"])
    assert [o["output_ids"] for o in outs] == [
        *peft_greedy(llama_ckpt, adapters["a"], PROMPTS[:1], 6), *peft_greedy(llama_ckpt, None, PROMPTS[1:2], 6),
        *peft_greedy(llama_ckpt, adapters["a"], PROMPTS[2:], 6)]
    one = engine.generate(input_ids=PROMPTS[0], sampling_params=PARAMS, lora_path="a")
    assert one["output_ids"] == outs[0]["output_ids"]
    with pytest.raises(ValueError, match="lora_path has 2 entries for 3 prompts"):
        engine.generate(input_ids=PROMPTS, sampling_params=PARAMS, lora_path=["a", None])


def test_load_use_unload_at_run_time(engine: Any, llama_ckpt: str, adapters: dict[str, str]) -> None:
    assert engine.load_lora_adapter("b", adapters["b"]) == {"a": adapters["a"], "b": adapters["b"]}
    out = engine.generate(input_ids=PROMPTS[1], sampling_params=PARAMS, lora_path="b")
    assert [out["output_ids"]] == peft_greedy(llama_ckpt, adapters["b"], PROMPTS[1:2], 6)
    assert engine.unload_lora_adapter("b") == {"a": adapters["a"]}
    with pytest.raises(EngineError, match="'b'"):
        engine.generate(input_ids=PROMPTS[1], sampling_params=PARAMS, lora_path="b")
    with pytest.raises(EngineError, match="lora_path"):
        engine.load_lora_adapter("c", "/nonexistent")
