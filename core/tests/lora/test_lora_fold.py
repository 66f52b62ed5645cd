"""The folded shrink (``LoraLayer.fold_into``: the slots' A rows under the base weight, one GEMM
and the backend's ``fold_expand``) equals the unfolded layer: greedy output equal to PEFT's with
folding on for decode batches and off for the larger prefill batches of the same run, the
weight and A slots as views of one buffer, and tensor-parallel shards that add up to the full
update (column-parallel QKV gathered, row-parallel o summed)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.config import LORA_TARGET_MODULES as ALL_TARGETS
from engine.managers.scheduler import check_no_leak
from engine.testing.conformance.lora import peft_greedy
from engine.testing.harness import OutputCollector, make_scheduler, submit

MAX_NEW = 6
PROMPTS = [[5, 17, 99, 250, 31, 8, 1000, 77], [9, 400, 12, 1500, 33, 2, 70], [1200, 4, 8, 15, 16, 23, 42],
           [7, 7, 300, 21, 64, 900]]


def test_folded_decode_equals_peft(llama_ckpt: str, peft_adapter: Callable[..., str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.lora.layers

    # The tiny model's layers are narrower than the A rows of its slots.
    monkeypatch.setattr(engine.lora.layers, "FOLD_MAX_EXTRA", 8.0)
    adapters = {"all8": peft_adapter(llama_ckpt, "all8", 8, ALL_TARGETS, seed=11),
                "qv16": peft_adapter(llama_ckpt, "qv16", 16, ["q_proj", "v_proj", "down_proj"], seed=13)}
    # Decode batches (4 rows) fold; the 29-token prefill batch does not (fold_max_rows 16).
    sched = make_scheduler(llama_ckpt, dtype="float32", lora_paths=adapters, lora_backend="torch_native",
                           plugin_options={"lora_torch_native": {"fold_max_rows": 16}})
    lora = sched.runner.lora
    folded = [(name, layer) for name, layer in lora.layers.items() if layer.fold_weight is not None]
    assert len(folded) == len(lora.layers), "every unquantized layer of the tiny Llama folds"
    module = sched.runner.model.get_submodule(folded[0][0])
    layer = folded[0][1]
    assert module.weight.data_ptr() == layer.fold_weight.data_ptr()
    assert layer.a_buffer.data_ptr() == layer.fold_weight[module.weight.shape[0]:].data_ptr()
    backend = lora.state.backend
    calls = {"fold": 0, "plain": 0}
    real_fold, real_expand = backend.fold_expand, backend.expand

    def fold_expand(*args, **kw):  # type: ignore[no-untyped-def]
        calls["fold"] += 1
        return real_fold(*args, **kw)

    def expand(*args, **kw):  # type: ignore[no-untyped-def]
        calls["plain"] += 1
        return real_expand(*args, **kw)

    monkeypatch.setattr(backend, "fold_expand", fold_expand)
    monkeypatch.setattr(backend, "expand", expand)
    names = ["all8", None, "qv16", "all8"]
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    rids = [submit(sched, p, params, lora_name=n) for p, n in zip(PROMPTS, names, strict=True)]
    col = OutputCollector()
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    got = [col.ids[r] for r in rids]
    for i, name in enumerate(names):
        want = peft_greedy(llama_ckpt, adapters[name] if name else None, [PROMPTS[i]], MAX_NEW)
        assert [got[i]] == want, f"prompt {i} on {name}"
    # torch_native's fold_expand calls its expand too: plain expands outnumber the folds by the
    # prefill's.
    assert calls["fold"] > 0 and calls["plain"] > calls["fold"], calls
    check_no_leak(sched)


class _Reference:
    name = "reference"
    fold_max_rows = 8

    def __init__(self) -> None:
        from engine.lora.backend import reference_expand, reference_fold_expand, reference_shrink

        self.shrink, self.expand, self.fold_expand = reference_shrink, reference_expand, reference_fold_expand


@pytest.mark.parametrize("tp", [1, 2])
def test_folded_shards_add_up_to_the_full_update(tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.layers.linear as linear
    import engine.lora.layers

    monkeypatch.setattr(engine.lora.layers, "FOLD_MAX_EXTRA", 1.0)
    from engine.lora.backend import LoraBatchInfo
    from engine.lora.layers import LoraState, build_lora_layer

    gen = torch.Generator().manual_seed(5)
    r, hidden, head, heads, kv_heads, tokens = 4, 64, 16, 4, 2, 3
    a = {n: torch.randn(r, hidden, generator=gen) for n in ("q", "k", "v", "o")}
    b = {"q": torch.randn(heads * head, r, generator=gen), "k": torch.randn(kv_heads * head, r, generator=gen),
         "v": torch.randn(kv_heads * head, r, generator=gen), "o": torch.randn(hidden, r, generator=gen)}
    w_qkv = torch.randn((heads + 2 * kv_heads) * head, hidden, generator=gen)
    w_o = torch.randn(hidden, heads * head, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    state = LoraState(_Reference())
    # Token 0 on the base slot, tokens 1-2 on the adapter.
    state.batch_info = LoraBatchInfo(2, torch.tensor([0, 1, tokens], dtype=torch.int32),
                                     torch.tensor([1, 0], dtype=torch.int32), torch.tensor([r, 0], dtype=torch.int32),
                                     torch.tensor([0.5, 0.0]), tokens - 1)
    full = {n: 0.5 * (x @ a[n].T) @ b[n].T for n in a}
    for n in full:
        full[n][0] = 0
    q_cols, kv_cols = heads * head, kv_heads * head
    want_qkv = x @ w_qkv.T + torch.cat([full["q"], full["k"], full["v"]], dim=1)
    qkv_parts, o_sum = [], torch.zeros(tokens, hidden)
    for rank in range(tp):
        monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: tp)
        monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda: rank)  # noqa: B023
        qkv = linear.QKVParallelLinear(hidden, head, heads, kv_heads)
        o_proj = linear.RowParallelLinear(heads * head, hidden, reduce_results=False)
        for part, name in zip(w_qkv.split([q_cols, kv_cols, kv_cols]), ("q", "k", "v"), strict=True):
            qkv.weight_loader(qkv.weight, part, name)
        o_proj.weight_loader(o_proj.weight, w_o)
        for module, peft, names in ((qkv, ("q_proj", "k_proj", "v_proj"), ("q", "k", "v")),
                                    (o_proj, ("o_proj",), ("o",))):
            layer = build_lora_layer(module, peft, state, 2, r, torch.float32, torch.device("cpu"))
            before = module.weight.detach().clone()
            assert layer.fold_into(module, 8)
            torch.testing.assert_close(module.weight.detach(), before)  # the weight, now a view of [W; A]
            layer.load_slot(0, [layer.shard(i, a[n], b[n]) for i, n in enumerate(names)])
            module.lora = layer
        qkv_parts.append(qkv(x))
        shard = hidden // tp
        o_sum += o_proj(x[:, rank * shard:(rank + 1) * shard] if tp > 1 else x)
    q_parts = [p[:, :q_cols // tp] for p in qkv_parts]
    k_parts = [p[:, q_cols // tp:q_cols // tp + kv_cols // tp] for p in qkv_parts]
    v_parts = [p[:, q_cols // tp + kv_cols // tp:] for p in qkv_parts]
    torch.testing.assert_close(torch.cat(q_parts + k_parts + v_parts, dim=1), want_qkv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o_sum, x @ w_o.T + full["o"], rtol=1e-4, atol=1e-4)


def test_a_replaced_weight_ends_the_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight swapped for a new tensor after folding (not copied into) is used as it is: the
    layer runs its own product and the shrink, whose A still lives in the folded buffer."""
    import engine.layers.linear as linear
    import engine.lora.layers
    from engine.lora.backend import LoraBatchInfo
    from engine.lora.layers import LoraState, build_lora_layer

    monkeypatch.setattr(engine.lora.layers, "FOLD_MAX_EXTRA", 1.0)
    gen = torch.Generator().manual_seed(3)
    r, hidden, tokens = 4, 32, 3
    o_proj = linear.RowParallelLinear(hidden, hidden)
    o_proj.weight.data.copy_(torch.randn(hidden, hidden, generator=gen))
    a, b = torch.randn(r, hidden, generator=gen), torch.randn(hidden, r, generator=gen)
    state = LoraState(_Reference())
    state.batch_info = LoraBatchInfo(1, torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                     torch.tensor([r, 0], dtype=torch.int32), torch.tensor([0.5, 0.0]), tokens)
    layer = build_lora_layer(o_proj, ("o_proj",), state, 2, r, torch.float32, torch.device("cpu"))
    assert layer.fold_into(o_proj, 8, gemm_slots=1)
    layer.load_slot(0, [(a, b)])
    o_proj.lora = layer
    x = torch.randn(tokens, hidden, generator=gen)
    update = 0.5 * (x @ a.T) @ b.T
    torch.testing.assert_close(o_proj(x), x @ o_proj.weight.T + update, rtol=1e-4, atol=1e-4)
    new = torch.randn(hidden, hidden, generator=gen)
    o_proj.weight.data = new.clone()
    torch.testing.assert_close(o_proj(x), x @ new.T + update, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fold_rows", [8, 0])
def test_each_fold_releases_the_replaced_weight(fold_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``attach_lora``'s ``release`` (the platform's ``empty_cache``) runs right after each layer
    folds, when that layer's weight already lives in its ``[W; A]`` and the next layer has not
    folded yet (a cached old weight would take the next layers' smaller buffers and could then not
    be given back); layers that do not fold release nothing."""
    import engine.layers.linear as linear
    import engine.lora.layers
    from engine.lora.layers import LoraState, attach_lora

    monkeypatch.setattr(engine.lora.layers, "FOLD_MAX_EXTRA", 1.0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for _ in range(2):
        block = torch.nn.Module()
        block.qkv_proj = linear.QKVParallelLinear(32, 8, 4, 2)
        block.o_proj = linear.RowParallelLinear(32, 32)
        model.layers.append(block)
    modules = [m for block in model.layers for m in (block.qkv_proj, block.o_proj)]
    before = [m.weight.data_ptr() for m in modules]
    moved: list[list[bool]] = []

    def release() -> None:
        moved.append([m.weight.data_ptr() != ptr for m, ptr in zip(modules, before, strict=True)])

    backend = _Reference()
    backend.fold_max_rows = fold_rows
    layers = attach_lora(model, {"q_proj", "k_proj", "v_proj", "o_proj"}, LoraState(backend), 2, 4,
                         torch.float32, torch.device("cpu"), release)
    assert len(layers) == 4
    if not fold_rows:
        assert moved == [] and all(layer.fold_weight is None for layer in layers.values())
        return
    assert moved == [[i < k for i in range(4)] for k in range(1, 5)]
    assert [m.weight.data_ptr() for m in modules] == [layer.fold_weight.data_ptr() for layer in layers.values()]
