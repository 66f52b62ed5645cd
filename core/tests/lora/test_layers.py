"""LoRA on the model's projections equals PEFT: greedy output per adapter equals ``PeftModel``'s
and ``merge_and_unload``'s in float32, for Llama and Qwen3, ranks 8 and 64, every target and a
subset, one batch mixing adapters and the base model (in-process schedulers, tiny checkpoints)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from engine.config import LORA_TARGET_MODULES as ALL_TARGETS
from engine.managers.scheduler import check_no_leak
from engine.testing.conformance.lora import peft_greedy
from engine.testing.harness import OutputCollector, make_scheduler, submit

MAX_NEW = 8


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(rng.randint(5, 24))] for _ in range(n)]


def _run(sched, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    rids = [submit(sched, p, params, lora_name=name) for p, name in jobs]
    col = OutputCollector()
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    return [col.ids[r] for r in rids]


def test_llama_batch_of_eight_over_four_adapters_equals_peft(llama_ckpt: str, peft_adapter: Callable[..., str]) -> None:
    adapters = {
        "all8": peft_adapter(llama_ckpt, "all8", 8, ALL_TARGETS, seed=11),
        "all64": peft_adapter(llama_ckpt, "all64", 64, ALL_TARGETS, seed=12, alpha=32),
        "qv8": peft_adapter(llama_ckpt, "qv8", 8, ["q_proj", "v_proj"], seed=13),
        "rs16": peft_adapter(llama_ckpt, "rs16", 16, ["k_proj", "o_proj", "down_proj"], seed=14, use_rslora=True),
    }
    prompts = _prompts(1, 8)
    # Two prompts per adapter, interleaved with the base model; two device slots for four
    # adapters: admission holds adapters back and slots are reused.
    names = ["all8", None, "all64", "qv8", "rs16", "all8", "qv8", None]
    sched = make_scheduler(llama_ckpt, dtype="float32", lora_paths=adapters, max_loras_per_batch=2)
    got = _run(sched, list(zip(prompts, names, strict=True)))
    base = peft_greedy(llama_ckpt, None, prompts, MAX_NEW)
    assert all(got[i] != base[i] for i, n in enumerate(names) if n), "an adapter left the output unchanged"
    for name in dict.fromkeys(names):
        mine = [i for i, n in enumerate(names) if n == name]
        want = peft_greedy(llama_ckpt, adapters.get(name) if name else None, [prompts[i] for i in mine], MAX_NEW)
        assert [got[i] for i in mine] == want, f"adapter {name}"
        if name in ("all64", "qv8"):
            merged = peft_greedy(llama_ckpt, adapters[name], [prompts[i] for i in mine], MAX_NEW, merged=True)
            assert merged == want, f"adapter {name}: merge_and_unload differs from PeftModel"
    assert sched.runner.lora.num_slots == 2
    # Each alone on a fresh scheduler gives the same as in the mixed batch.
    alone = _run(make_scheduler(llama_ckpt, dtype="float32", lora_paths={"rs16": adapters["rs16"]}),
                 [(prompts[4], "rs16")])
    assert alone == [got[4]]
    check_no_leak(sched)


def test_qwen3_equals_peft(qwen3_ckpt: str, peft_adapter: Callable[..., str]) -> None:
    adapters = {"all8": peft_adapter(qwen3_ckpt, "q_all8", 8, ALL_TARGETS, seed=21),
                "qv64": peft_adapter(qwen3_ckpt, "q_qv64", 64, ["q_proj", "v_proj"], seed=22, alpha=16)}
    prompts = _prompts(2, 3)
    names = ["all8", "qv64", None]
    sched = make_scheduler(qwen3_ckpt, dtype="float32", lora_paths=adapters, chunked_prefill_size=8)
    got = _run(sched, list(zip(prompts, names, strict=True)))
    for i, name in enumerate(names):
        want = peft_greedy(qwen3_ckpt, adapters.get(name) if name else None, [prompts[i]], MAX_NEW)
        assert [got[i]] == want, f"adapter {name}"
    merged = peft_greedy(qwen3_ckpt, adapters["all8"], [prompts[0]], MAX_NEW, merged=True)
    assert [got[0]] == merged


@pytest.mark.parametrize("kwargs", [{"enable_mixed_chunk": True, "chunked_prefill_size": 6},
                                    {"page_size": 4}])
def test_mixed_batches_and_pages_keep_the_adapter(llama_ckpt: str, peft_adapter: Callable[..., str],
                                                  kwargs: dict[str, object]) -> None:
    path = peft_adapter(llama_ckpt, "all8", 8, ALL_TARGETS, seed=11)
    prompts = _prompts(3, 3)
    sched = make_scheduler(llama_ckpt, dtype="float32", lora_paths={"a": path}, **kwargs)
    got = _run(sched, [(prompts[0], "a"), (prompts[1], None), (prompts[2], "a")])
    assert [got[0], got[2]] == peft_greedy(llama_ckpt, path, [prompts[0], prompts[2]], MAX_NEW)
    assert [got[1]] == peft_greedy(llama_ckpt, None, [prompts[1]], MAX_NEW)
    check_no_leak(sched)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shards_add_up_to_the_full_update(tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's LoRA layer, built as the layer is sharded (tp 4 replicates the 2 KV heads),
    gives its columns of the full update (QKV) or a part that sums to it (o_proj, A sharded by
    input), so the layer's own gather or all-reduce completes it."""
    import torch

    import engine.layers.linear as linear
    from engine.lora.backend import LoraBatchInfo, reference_expand, reference_shrink
    from engine.lora.layers import LoraState, build_lora_layer

    class Reference:
        name = "reference"
        shrink = staticmethod(reference_shrink)
        expand = staticmethod(reference_expand)

    gen = torch.Generator().manual_seed(5)
    r, hidden, head, heads, kv_heads, tokens = 4, 64, 16, 4, 2, 3
    a = {n: torch.randn(r, hidden, generator=gen) for n in ("q", "k", "v", "o")}
    b = {"q": torch.randn(heads * head, r, generator=gen), "k": torch.randn(kv_heads * head, r, generator=gen),
         "v": torch.randn(kv_heads * head, r, generator=gen), "o": torch.randn(hidden, r, generator=gen)}
    x = torch.randn(tokens, hidden, generator=gen)
    state = LoraState(Reference())
    state.batch_info = LoraBatchInfo(1, torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                     torch.tensor([r, 0], dtype=torch.int32), torch.tensor([0.5, 0.0]), tokens)
    full = {n: 0.5 * (x @ a[n].T) @ b[n].T for n in a}
    o_sum = torch.zeros(tokens, hidden)
    for rank in range(tp):
        monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: tp)
        monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda: rank)  # noqa: B023
        qkv = linear.QKVParallelLinear(hidden, head, heads, kv_heads)
        o_proj = linear.RowParallelLinear(heads * head, hidden)
        layers = [(build_lora_layer(qkv, ("q_proj", "k_proj", "v_proj"), state, 2, r, torch.float32,
                                    torch.device("cpu")), "qkv"),
                  (build_lora_layer(o_proj, ("o_proj",), state, 2, r, torch.float32, torch.device("cpu")), "o")]
        for layer, kind in layers:
            names = ("q", "k", "v") if kind == "qkv" else ("o",)
            layer.load_slot(0, [layer.shard(i, a[n], b[n]) for i, n in enumerate(names)])
        qkv_out = torch.zeros(tokens, qkv.output_size_per_partition)
        layers[0][0].apply(x, qkv_out)
        kv_rank = rank // qkv.kv_replicas
        q_cols, kv_cols = qkv.num_heads * head, qkv.num_kv_heads * head
        want = torch.cat([full["q"][:, rank * q_cols:(rank + 1) * q_cols],
                          full["k"][:, kv_rank * kv_cols:(kv_rank + 1) * kv_cols],
                          full["v"][:, kv_rank * kv_cols:(kv_rank + 1) * kv_cols]], dim=1)
        torch.testing.assert_close(qkv_out, want)
        part = torch.zeros(tokens, hidden)
        shard = hidden // tp
        layers[1][0].apply(x[:, rank * shard:(rank + 1) * shard], part)
        o_sum += part
    torch.testing.assert_close(o_sum, full["o"])
