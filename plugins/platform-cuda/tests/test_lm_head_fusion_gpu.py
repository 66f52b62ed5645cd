"""The decode step's tail in the engine (GPU only): the model's final RMSNorm folded into the LM
head's skinny GEMM (``cuda.final_norm_fusion``) and the logits stored as float32 by it
(``cuda.logits_f32``) give the separate norm's and ``.float()``'s logits bit for bit.

Tiny models, CUDA graphs on, batches of one (the fold's row) and two (not folded): a Llama and a
Qwen3-MoE of hidden 256 (one-warp sum order), a Qwen2 of hidden 1024 with its LM head tied to the
embedding (4 warps) and a Llama of hidden 2048 (8 warps, Qwen3-30B-A3B's). Every step's logits as
the sampler gets them, the greedy tokens and the logits of a one- and a two-token prompt must be
equal with both options on (the default) and off, and for the Llama with each alone; the fold
and the float32 store must run exactly where their option is on.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from engine.testing.checkpoints import DECODE_KERNEL_MODELS
from engine.testing.harness import generate_greedy, last_position_logits, make_scheduler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: run as a batch of one, then of two: every decode step has 1 or 2 rows.
BATCHES = [[list(range(5, 10))], [list(range(300, 317)), list(range(1000, 1040))]]
MODELS = {
    **DECODE_KERNEL_MODELS,
    "qwen2-tied-h1024": ("Qwen2ForCausalLM", dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                                                  intermediate_size=512)),
    "llama-h2048": ("LlamaForCausalLM", dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                                             intermediate_size=1024)),
}
OPTIONS = {"on": {}, "off": {"final_norm_fusion": False, "logits_f32": False},
           "fold-only": {"logits_f32": False}, "f32-only": {"final_norm_fusion": False}}


def _run(path: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Greedy outputs, every step's logits, last-position logits of a 1- and a 2-token prompt, and
    how often the fold and the float32 store were launched from Python (captures included)."""
    import engine_platform_cuda.gemv as gemv

    calls = {"fold": 0, "f32": 0}
    fold, plain = gemv.norm_skinny_linear, gemv.skinny_linear

    def counting_fold(*args: Any, **kwargs: Any) -> Any:
        calls["fold"] += bool(kwargs.get("exact_norm"))
        calls["f32"] += kwargs.get("out_dtype") is torch.float32
        return fold(*args, **kwargs)

    def counting_plain(*args: Any, **kwargs: Any) -> Any:
        calls["f32"] += kwargs.get("out_dtype") is torch.float32
        return plain(*args, **kwargs)

    monkeypatch.setattr(gemv, "norm_skinny_linear", counting_fold)  # what SkinnyLinear calls
    monkeypatch.setattr(gemv, "skinny_linear", counting_plain)
    sched = make_scheduler(path, platform="cuda", dtype="bfloat16", attention="triton", cuda_graph_max_bs=4,
                           plugin_options={"cuda": options})
    assert sched.runner.cuda_graph_runner is not None
    model = sched.runner.model
    fused = options.get("final_norm_fusion", True)
    assert (model.model.norm.fuse_into is model.lm_head) == fused
    steps: list[torch.Tensor] = []
    sample = sched.runner.sample

    def recording(logits_output: Any, forward_batch: Any) -> Any:
        steps.append(logits_output.next_token_logits.clone())
        return sample(logits_output, forward_batch)

    sched.runner.sample = recording
    out = [o for batch in BATCHES for o in generate_greedy(sched, batch, 16, ignore_eos=True)]
    logits = [last_position_logits(sched, [[7]]), last_position_logits(sched, [[7, 8]])]
    del sched, model
    gc.collect()
    torch.cuda.empty_cache()
    monkeypatch.undo()
    return {"out": out, "steps": steps, "logits": logits, "calls": calls}


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_are_bit_equal_with_and_without_the_fold_and_the_float32_store(
        name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.testing.checkpoints import make_tiny_checkpoint

    arch, cfg = MODELS[name]
    path = make_tiny_checkpoint(str(tmp_path), arch, dtype="bfloat16", seed=7, **cfg)
    runs = ["off", "on"] + (["fold-only", "f32-only"] if name == "llama" else [])
    results = {run: _run(path, OPTIONS[run], monkeypatch) for run in runs}
    want = results["off"]
    assert want["calls"] == {"fold": 0, "f32": 0}
    assert all(len(o) == 16 for o in want["out"])
    for run in runs[1:]:
        got = results[run]
        assert got["out"] == want["out"], run
        assert len(got["steps"]) == len(want["steps"]), run
        for i, (a, b) in enumerate(zip(got["steps"], want["steps"], strict=True)):
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), (run, i)
        for a, b in zip(got["logits"], want["logits"], strict=True):
            assert torch.equal(a, b), run
        fold_on = "final_norm_fusion" not in OPTIONS[run]
        f32_on = "logits_f32" not in OPTIONS[run]
        assert (got["calls"]["fold"] > 0) == fold_on and (got["calls"]["f32"] > 0) == f32_on, (run, got["calls"])
