"""Pooling requests of a decoder (--task embed on a tiny random Llama) through the scheduler,
against transformers' final hidden states pooled by hand."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest
import torch

from engine.errors import ConfigError
from engine.managers.scheduler import check_no_leak
from engine.testing.checkpoints import make_tiny_checkpoint
from engine.testing.harness import embed_prompts, make_scheduler


def _prompts(seed: int, lens: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in lens]


def _states(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0].float()


def _unit(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v, dim=0)


def _with_pooling(src: str, dst: Any, mode: str, normalize: bool) -> str:
    """``src`` plus sentence-transformers' pooling files selecting ``mode``."""
    dst.mkdir()
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), dst / name)
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({mode: True, "include_prompt": True}))
    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"},
               {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    return str(dst)


def test_last_token_pooling_chunked_and_from_the_radix_cache(llama_ckpt: str, hf_llama: Any) -> None:
    sched = make_scheduler(llama_ckpt, task="embed", chunked_prefill_size=8)
    prompts = _prompts(0, [3, 21, 9, 40])
    first = embed_prompts(sched, prompts)
    for p, got in zip(prompts, first):
        torch.testing.assert_close(torch.tensor(got["embedding"]), _unit(_states(hf_llama, p)[-1]), atol=1e-4, rtol=1e-4)
    # Again: the decoder's KV stayed in the radix cache, so only each prompt's last token runs.
    again = embed_prompts(sched, prompts)
    assert [g["cached_tokens"] for g in again] == [len(p) - 1 for p in prompts]
    for a, b in zip(first, again):
        torch.testing.assert_close(torch.tensor(a["embedding"]), torch.tensor(b["embedding"]), atol=1e-5, rtol=1e-5)
    check_no_leak(sched)


@pytest.mark.parametrize("mode,normalize", [("pooling_mode_mean_tokens", False), ("pooling_mode_cls_token", True),
                                            ("pooling_mode_max_tokens", False)])
def test_whole_prompt_pooling_over_chunks(llama_ckpt: str, hf_llama: Any, tmp_path: Any, mode: str,
                                          normalize: bool) -> None:
    sched = make_scheduler(_with_pooling(llama_ckpt, tmp_path / "st", mode, normalize), task="embed",
                           chunked_prefill_size=8)
    prompts = _prompts(1, [30, 5, 17])
    embed_prompts(sched, prompts)  # fills the radix cache: pooling over every token must not use it
    out = embed_prompts(sched, prompts)
    for p, got in zip(prompts, out):
        states = _states(hf_llama, p)
        ref = {"pooling_mode_mean_tokens": states.mean(0), "pooling_mode_cls_token": states[0],
               "pooling_mode_max_tokens": states.max(0).values}[mode]
        ref = _unit(ref) if normalize else ref
        torch.testing.assert_close(torch.tensor(got["embedding"]), ref, atol=1e-4, rtol=1e-4)
        assert got["cached_tokens"] == 0
    check_no_leak(sched)


def test_dimensions_truncate_then_normalise(llama_ckpt: str, hf_llama: Any) -> None:
    sched = make_scheduler(llama_ckpt, task="embed")
    p = _prompts(2, [11])[0]
    got = embed_prompts(sched, [p], dimensions=16)[0]["embedding"]
    torch.testing.assert_close(torch.tensor(got), _unit(_states(hf_llama, p)[-1][:16]), atol=1e-4, rtol=1e-4)
    assert "dimensions 65" in embed_prompts(sched, [p], dimensions=65)[0]["error"]["message"]


def test_bare_decoder_checkpoint_pools_but_cannot_generate(tmp_path: Any, hf_llama: Any) -> None:
    """Embedding checkpoints saved from the bare decoder (Qwen3-Embedding): no "model." prefix, no LM head."""
    ckpt = make_tiny_checkpoint(str(tmp_path / "bare"), "LlamaForCausalLM", reference="LlamaModel")
    from transformers import LlamaModel

    hf = LlamaModel.from_pretrained(ckpt).eval()
    p = _prompts(3, [13])[0]
    got = embed_prompts(make_scheduler(ckpt, task="embed"), [p])[0]["embedding"]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(got), _unit(ref), atol=1e-4, rtol=1e-4)
    with pytest.raises(ConfigError, match="no LM head"):
        make_scheduler(ckpt)
