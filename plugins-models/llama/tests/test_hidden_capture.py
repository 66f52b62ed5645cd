"""Hidden-state capture (``engine.layers.hidden_capture``) through LlamaModel: the final hidden
states and decoder layer outputs equal transformers' ``output_hidden_states``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.model_executor.forward_batch import ForwardBatch, ForwardMode


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: Any) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("capture")), "LlamaForCausalLM", num_hidden_layers=4)


def _forward(model_dir: str, prompts: list[list[int]], capture: tuple[int, ...] | None) -> Any:
    from engine.testing.harness import make_scheduler

    runner = make_scheduler(model_dir).runner
    lens = [len(p) for p in prompts]
    slots = runner.req_to_token_pool.alloc(len(prompts))
    loc = runner.token_to_kv_pool_allocator.alloc_extend([0] * len(lens), lens, [-1] * len(lens))
    offset = 0
    for slot, n in zip(slots, lens):
        runner.req_to_token_pool.write(slot, 0, loc[offset: offset + n])
        offset += n
    fb = ForwardBatch.build(ForwardMode.EXTEND, [t for p in prompts for t in p], slots, lens, [0] * len(lens),
                            loc, runner.device)
    runner.capture_hidden = capture
    return runner.forward(fb)


def _reference(model_dir: str, prompt: list[int]) -> tuple[torch.Tensor, ...]:
    from engine.testing.checkpoints import load_hf_model

    hf = load_hf_model(model_dir)
    with torch.no_grad():
        return hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states


PROMPTS = [[5, 9, 33, 7, 100, 2], [40, 41, 42]]


def test_nothing_is_captured_unless_asked(model_dir: str) -> None:
    assert _forward(model_dir, PROMPTS, None).hidden_states is None


def test_final_hidden_states_are_the_lm_head_input(model_dir: str) -> None:
    out = _forward(model_dir, PROMPTS, ())
    got = out.hidden_states
    assert got.shape == (sum(map(len, PROMPTS)), 64)
    offset = 0
    for prompt in PROMPTS:
        ref = _reference(model_dir, prompt)[-1][0]  # transformers: after the final norm
        torch.testing.assert_close(got[offset: offset + len(prompt)], ref, rtol=1e-4, atol=1e-4)
        offset += len(prompt)


def test_layer_outputs_are_concatenated_in_the_order_asked(model_dir: str) -> None:
    out = _forward(model_dir, PROMPTS, (2, 0, 1))
    got = out.hidden_states
    assert got.shape == (sum(map(len, PROMPTS)), 3 * 64)
    offset = 0
    for prompt in PROMPTS:
        ref = _reference(model_dir, prompt)  # [embeddings, layer 0 out, layer 1 out, ...]
        expect = torch.cat([ref[3][0], ref[1][0], ref[2][0]], dim=-1)
        torch.testing.assert_close(got[offset: offset + len(prompt)], expect, rtol=1e-4, atol=1e-4)
        offset += len(prompt)


def test_a_layer_the_model_never_records_is_an_error(model_dir: str) -> None:
    from engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"decoder layer\(s\) \[7\]"):
        _forward(model_dir, PROMPTS, (7,))
