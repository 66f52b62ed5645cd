"""Adapters in the scheduler: loading and unloading at run time (a running request keeps its
adapter), --max-loaded-loras, adapters per batch, the radix cache keyed by adapter, errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from engine.config import LORA_TARGET_MODULES as ALL_TARGETS
from engine.managers.io_struct import LoadLoraAdapterReqInput, UnloadLoraAdapterReqInput
from engine.managers.scheduler import check_no_leak
from engine.testing.conformance.lora import peft_greedy
from engine.testing.harness import OutputCollector, make_scheduler, submit

PROMPT = [5, 17, 99, 250, 31, 8, 1000, 77, 12, 600, 44, 9, 130, 7, 1800, 23]
PARAMS = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(llama_ckpt: str, peft_adapter: Callable[..., str]) -> dict[str, str]:
    return {"a": peft_adapter(llama_ckpt, "all8", 8, ALL_TARGETS, seed=11),
            "b": peft_adapter(llama_ckpt, "qv8", 8, ["q_proj", "v_proj"], seed=13),
            "big": peft_adapter(llama_ckpt, "big", 16, ["q_proj"], seed=15)}


def _finish(sched: Any, col: OutputCollector) -> None:
    while sched.step():
        col.collect(sched)
    col.collect(sched)


def test_prefix_cache_is_keyed_by_adapter(llama_ckpt: str, adapters: dict[str, str]) -> None:
    sched = make_scheduler(llama_ckpt, dtype="float32", lora_paths={"a": adapters["a"], "b": adapters["b"]})
    col = OutputCollector()
    rids = []
    for name in ("a", "b", None, "a"):  # one after the other: each sees what the others cached
        rids.append(submit(sched, PROMPT, PARAMS, lora_name=name))
        _finish(sched, col)
    cached = [col.meta[r]["cached_tokens"] for r in rids]
    assert cached[:3] == [0, 0, 0], "a prefix computed with one adapter was reused by another or the base"
    assert cached[3] >= len(PROMPT) - 1, "the same adapter reuses its own prefix"
    want = {n: peft_greedy(llama_ckpt, adapters.get(n) if n else None, [PROMPT], 6)[0] for n in ("a", "b", None)}
    assert [col.ids[r] for r in rids] == [want["a"], want["b"], want[None], want["a"]]
    check_no_leak(sched)


def test_unload_waits_for_running_requests_then_reload(llama_ckpt: str, adapters: dict[str, str]) -> None:
    sched = make_scheduler(llama_ckpt, dtype="float32", lora_paths={"a": adapters["a"]})
    col = OutputCollector()
    first = submit(sched, PROMPT, {**PARAMS, "max_new_tokens": 10}, lora_name="a")
    for _ in range(3):
        sched.step()
    reply = sched.unload_lora_adapter(UnloadLoraAdapterReqInput("a", token=7))
    assert reply.success and reply.token == 7 and reply.loaded == {} and "1 running" in reply.message
    refused = submit(sched, PROMPT, PARAMS, lora_name="a")
    col.collect(sched)
    assert col.finish[refused]["type"] == "abort" and "'a'" in col.finish[refused]["message"]
    uid = next(iter(sched.lora_draining))
    assert uid in sched.runner.lora.adapters, "dropped while a request still runs on it"
    # Loaded again under the same name (other weights) while the old one drains: a new adapter.
    reply = sched.load_lora_adapter(LoadLoraAdapterReqInput("a", adapters["b"]))
    assert reply.success and reply.loaded == {"a": adapters["b"]}
    again = submit(sched, PROMPT, PARAMS, lora_name="a")
    _finish(sched, col)
    assert col.ids[first] == peft_greedy(llama_ckpt, adapters["a"], [PROMPT], 10)[0]
    assert col.ids[again] == peft_greedy(llama_ckpt, adapters["b"], [PROMPT], 6)[0]
    assert col.meta[again]["cached_tokens"] == 0, "the reloaded name reused the old adapter's prefix"
    assert uid not in sched.runner.lora.adapters and not sched.lora_draining
    stats = sched.stats()
    assert stats["lora_adapters"] == {"a": adapters["b"]} and stats["lora_draining"] == []
    assert "a" in stats["lora_slots"] and None in stats["lora_slots"]
    check_no_leak(sched)


def test_adapters_per_batch_and_loaded_limits(llama_ckpt: str, adapters: dict[str, str]) -> None:
    sched = make_scheduler(llama_ckpt, dtype="float32", lora_paths={"a": adapters["a"]}, max_loras_per_batch=1,
                           max_loaded_loras=2, max_lora_rank=8)
    # Run-time loads are unpinned: past --max-loaded-loras the least recently used idle one goes.
    assert sched.load_lora_adapter(LoadLoraAdapterReqInput("b", adapters["b"])).success
    reply = sched.load_lora_adapter(LoadLoraAdapterReqInput("c", adapters["b"]))
    assert reply.success and reply.loaded == {"a": adapters["a"], "c": adapters["b"]}
    col = OutputCollector()
    rids = [submit(sched, PROMPT, PARAMS, lora_name=n) for n in ("a", "c", "a", None)]
    while sched.step():
        batch_adapters = {r.lora_uid for r in sched.running_batch.reqs if r.lora_uid is not None}
        assert len(batch_adapters) <= 1, "more adapters in a batch than --max-loras-per-batch"
        col.collect(sched)
    col.collect(sched)
    assert col.ids[rids[0]] == col.ids[rids[2]] == peft_greedy(llama_ckpt, adapters["a"], [PROMPT], 6)[0]
    assert col.ids[rids[1]] == peft_greedy(llama_ckpt, adapters["b"], [PROMPT], 6)[0]
    # Pinned (start-up) adapters stay: with "c" pinned too, nothing can make room.
    assert sched.load_lora_adapter(LoadLoraAdapterReqInput("d", adapters["b"], pinned=True)).success
    reply = sched.load_lora_adapter(LoadLoraAdapterReqInput("e", adapters["b"]))
    assert not reply.success and "--max-loaded-loras 2" in reply.message
    check_no_leak(sched)


def test_load_refusals_name_the_field(llama_ckpt: str, adapters: dict[str, str], tmp_path: Any) -> None:
    sched = make_scheduler(llama_ckpt, dtype="float32", enable_lora=True, max_lora_rank=8,
                           lora_target_modules=["q_proj", "k_proj", "v_proj"])
    cases = [
        (LoadLoraAdapterReqInput("big", adapters["big"]), "r 16 exceeds --max-lora-rank 8"),
        (LoadLoraAdapterReqInput("a", adapters["a"]), "target module down_proj is not enabled"),
        (LoadLoraAdapterReqInput("x", str(tmp_path)), "no adapter_config.json"),
    ]
    for msg, words in cases:
        reply = sched.load_lora_adapter(msg)
        assert not reply.success and reply.message.startswith("lora_path") and words in reply.message, reply.message
    assert sched.load_lora_adapter(LoadLoraAdapterReqInput("b", adapters["b"])).success
    dup = sched.load_lora_adapter(LoadLoraAdapterReqInput("b", adapters["b"]))
    assert not dup.success and dup.message.startswith("lora_name 'b' is already loaded")
    col = OutputCollector()
    unknown = submit(sched, PROMPT, PARAMS, lora_name="nope")
    col.collect(sched)
    assert "lora_path 'nope'" in col.finish[unknown]["message"] and "loaded: b" in col.finish[unknown]["message"]


def test_lora_off_refuses_adapter_requests(llama_ckpt: str) -> None:
    sched = make_scheduler(llama_ckpt)
    col = OutputCollector()
    rid = submit(sched, PROMPT, PARAMS, lora_name="a")
    col.collect(sched)
    assert "--lora-paths" in col.finish[rid]["message"]
    assert not sched.load_lora_adapter(LoadLoraAdapterReqInput("a", "/x")).success


def test_moe_attention_adapter_equals_peft(tmp_path_factory: pytest.TempPathFactory,
                                           peft_adapter: Callable[..., str]) -> None:
    from engine.testing.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(str(tmp_path_factory.mktemp("moe")), "Qwen3MoeForCausalLM", num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    path = peft_adapter(ckpt, "moe_attn", 8, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=31)
    sched = make_scheduler(ckpt, dtype="float32", lora_paths={"attn": path})
    col = OutputCollector()
    rids = [submit(sched, PROMPT, PARAMS, lora_name=n) for n in ("attn", None)]
    _finish(sched, col)
    assert col.ids[rids[0]] == peft_greedy(ckpt, path, [PROMPT], 6)[0]
    assert col.ids[rids[1]] == peft_greedy(ckpt, None, [PROMPT], 6)[0]
    # An adapter on an expert projection (experts are fused MoE weights here, not linear layers).
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    mlp = str(tmp_path_factory.mktemp("moe_mlp"))
    shutil.copy(f"{path}/adapter_config.json", mlp)
    tensors = load_file(f"{path}/adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight"] = torch.zeros(8, 64)
    tensors["base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_B.weight"] = torch.zeros(32, 8)
    save_file(tensors, f"{mlp}/adapter_model.safetensors")
    reply = sched.load_lora_adapter(LoadLoraAdapterReqInput("mlp", mlp))
    assert not reply.success and "gate_proj" in reply.message, reply.message
    # With every target enabled, the expert projection itself is what is refused.
    sched = make_scheduler(ckpt, dtype="float32", enable_lora=True, lora_target_modules=["all"])
    reply = sched.load_lora_adapter(LoadLoraAdapterReqInput("mlp", mlp))
    assert not reply.success and "experts.0.gate_proj takes no LoRA weights" in reply.message, reply.message


def test_slots_lru_and_static_decode_info(llama_ckpt: str, adapters: dict[str, str]) -> None:
    """The device pool: an adapter a batch needs takes the least recently used slot the batch
    does not need; decode info for CUDA graphs is one segment per row in static buffers whose
    rows past the batch read the base slot."""
    sched = make_scheduler(llama_ckpt, dtype="float32", enable_lora=True, max_loras_per_batch=2, max_lora_rank=8)
    lora = sched.runner.lora
    uids = [sched.load_lora_adapter(LoadLoraAdapterReqInput(n, adapters["b"])).success and sched.lora_names[n]
            for n in ("x", "y", "z")]
    x, y, z = uids
    lora.prepare([x, None, x], [3, 2, 4])
    info = lora.state.batch_info
    assert info.seg_indptr.tolist() == [0, 3, 5, 9] and info.max_seg_len == 4
    assert info.weight_indices.tolist() == [lora.slot_uid.index(x), lora.base_slot, lora.slot_uid.index(x)]
    lora.prepare([y], [1])
    lora.prepare([z], [1])  # both slots taken: x, the least recently used, gives way
    assert set(lora.slot_uid) == {y, z}
    assert int(lora.ranks[lora.base_slot]) == 0 and lora.ranks.tolist().count(8) == 2
    lora.prepare(None, [1, 1])
    assert lora.state.batch_info is None, "a batch without adapters runs no LoRA work"
    lora.static_rows(8)
    lora.prepare([y, None, x], [1, 1, 1], graph=True)
    info = lora.state.batch_info
    indices = lora._static["indices"]
    assert info.weight_indices.data_ptr() == indices.data_ptr() and info.num_segments == 3
    assert indices[3:].tolist() == [lora.base_slot] * 5
    assert info.weight_indices.tolist() == [lora.slot_uid.index(y), lora.base_slot, lora.slot_uid.index(x)]
    assert info.seg_indptr.tolist() == [0, 1, 2, 3]


def test_decode_graph_replays_keep_each_rows_adapter(llama_ckpt: str, adapters: dict[str, str]) -> None:
    """Decode steps replayed from (CPU stand-in) graphs read the rows' slots from the static
    buffers: 3 rows on two adapters and the base model, padded to a 4-row graph, equal PEFT."""
    from engine.testing.graphs import EagerReplayGraphs

    sched = make_scheduler(llama_ckpt, dtype="float32", lora_paths={"a": adapters["a"], "b": adapters["b"]})
    graphs = sched.runner.cuda_graph_runner = EagerReplayGraphs(sched.runner, 4)
    col = OutputCollector()
    rids = [submit(sched, PROMPT, PARAMS, lora_name=n) for n in ("a", None, "b")]
    _finish(sched, col)
    assert graphs.replayed and set(graphs.replayed) == {4}
    for rid, name in zip(rids, ("a", None, "b"), strict=True):
        assert col.ids[rid] == peft_greedy(llama_ckpt, adapters.get(name) if name else None, [PROMPT], 6)[0], name


def test_retraction_keeps_each_requests_adapter(llama_ckpt: str, adapters: dict[str, str]) -> None:
    """Under KV pressure decode retracts requests; they resume on their own adapter (and its
    prefix namespace): outputs equal a run with room for all."""
    import random

    rng = random.Random(4)
    prompts = [[rng.randrange(4, 2048) for _ in range(rng.randint(16, 24))] for _ in range(6)]
    names = ["a", "b", None, "a", "b", "a"]
    params = {"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True, "stop_token_ids": [1]}
    loras = {"a": adapters["a"], "b": adapters["b"]}

    def run(**kw: Any) -> tuple[Any, list[list[int]]]:
        sched = make_scheduler(llama_ckpt, dtype="float32", lora_paths=loras, **kw)
        col = OutputCollector()
        rids = [submit(sched, p, params, lora_name=n) for p, n in zip(prompts, names, strict=True)]
        _finish(sched, col)
        return sched, [col.ids[r] for r in rids]

    _, reference = run()
    sched, ours = run(max_total_tokens=144, schedule_conservativeness=0.05)
    assert sched.num_retractions > 0
    assert ours == reference
    check_no_leak(sched)
