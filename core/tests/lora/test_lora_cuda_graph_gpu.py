"""LoRA decode under CUDA graphs on a GPU (run by the lead on a GPU): a tiny float32 Llama with
the triton LoRA backend, 13 requests over three adapters and the base model decoded from a
16-row graph (three padding rows), give PEFT's greedy tokens: with the shrink folded into the
base GEMM (``fold_expand``; 3 adapter slots, so the slots' A rows fit ``FOLD_MAX_EXTRA``) and
without (``lora-triton.fold_max_rows=0``: shrink and the per-slot expand). Kept small (one scheduler, two LoRA layers per decoder layer, graphs up to 16 rows) so
that the kernels' compiles and the captures stay few."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.managers.scheduler import check_no_leak
from engine.testing.conformance.lora import peft_greedy
from engine.testing.harness import OutputCollector, make_scheduler, submit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
TARGETS = ["q_proj", "v_proj", "down_proj"]
NAMES = ["a", "b", None, "c"]  # request i runs on NAMES[i % 4]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("lora_graphs")), "LlamaForCausalLM", **_SHAPE)


@pytest.fixture(scope="module")
def adapters(ckpt: str, peft_adapter: Callable[..., str]) -> dict[str, str]:
    return {"a": peft_adapter(ckpt, "a", 8, TARGETS, seed=21), "b": peft_adapter(ckpt, "b", 16, TARGETS, seed=22),
            "c": peft_adapter(ckpt, "c", 4, ["q_proj"], seed=23)}


def _run(ckpt: str, adapters: dict[str, str], prompts: list[list[int]], **kw: Any) -> tuple[Any, list[list[int]]]:
    sched = make_scheduler(ckpt, platform="cuda", attention="triton", dtype="float32", lora_paths=adapters,
                           lora_backend="triton", lora_target_modules=TARGETS, cuda_graph_max_bs=16,
                           max_total_tokens=8192, **kw)
    col = OutputCollector()
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    rids = [submit(sched, p, params, lora_name=NAMES[i % 4]) for i, p in enumerate(prompts)]
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    return sched, [col.ids[r] for r in rids]


FORMS = {"folded": dict(max_loras_per_batch=3),
         "unfolded": dict(plugin_options={"lora-triton": {"fold_max_rows": 0}})}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_graph_decode_equals_peft(ckpt: str, adapters: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                  form: str) -> None:
    from engine.model_executor.cuda_graph_runner import CudaGraphRunner

    rng = random.Random(9)
    prompts = [[rng.randrange(4, 1000) for _ in range(rng.randint(5, 30))] for _ in range(13)]
    replays: list[int] = []
    original = CudaGraphRunner.replay

    def replay(self: CudaGraphRunner, fb: Any) -> Any:
        replays.append(fb.batch_size)
        return original(self, fb)

    monkeypatch.setattr(CudaGraphRunner, "replay", replay)
    sched, graphed = _run(ckpt, adapters, prompts, **FORMS[form])
    assert max(replays, default=0) == 13, f"decode steps of 13 rows ran from a graph: {replays}"
    folds = [layer.fold_weight is not None for layer in sched.runner.lora.layers.values()]
    assert all(folds) if form == "folded" else not any(folds), folds
    check_no_leak(sched)
    for i, p in enumerate(prompts):
        name = NAMES[i % 4]
        assert graphed[i] == peft_greedy(ckpt, adapters[name] if name else None, [p], NEW_TOKENS)[0], (i, name)
