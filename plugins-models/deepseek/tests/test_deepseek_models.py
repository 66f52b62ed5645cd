"""DeepSeek-V2 and V3 against transformers on tiny random float32 checkpoints (the scheduler in
process, no server): greedy token for token through chunked prefill and a prefix-cache hit; the
grouped router against transformers' routers; the MLA pool; the refusal of a backend that does
not read the "mla" KV layout."""

from __future__ import annotations

import os
import random
import re
import types

import pytest
import torch

from engine import plugins
from engine.config import ServerArgs
from engine.errors import ConfigError
from engine.hookspecs import AttentionBackendSpec, hookimpl
from engine.layers.moe import GroupedTopK, grouped_topk
from engine.mem_cache.memory_pool import MLATokenToKVPool
from engine.selection import select_components
from engine.testing.checkpoints import copy_tokenizer, hf_greedy, load_hf_model, tiny_config
from engine.testing.harness import OutputCollector, make_scheduler, submit
from engine_models_deepseek.models import routing_for

VOCAB = 512
MAX_NEW = 10
_SHAPES = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
               qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
               n_group=2, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32, n_shared_experts=1,
               max_position_embeddings=512)
CONFIGS = {
    # V2-Lite's shape: no q_lora_rank; softmax routing limited to the best group.
    "DeepseekV2ForCausalLM": dict(_SHAPES, q_lora_rank=None, topk_method="group_limited_greedy", norm_topk_prob=False,
                                  routed_scaling_factor=1.5),
    # V3: q_lora_rank, sigmoid routing with a correction bias, YaRN with an mscale ratio != 1.
    "DeepseekV3ForCausalLM": dict(_SHAPES, q_lora_rank=48, routed_scaling_factor=2.5, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}),
}


def _build(directory: str, arch: str) -> str:
    import transformers

    config = tiny_config(arch, **CONFIGS[arch])
    torch.manual_seed(7)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)  # random init has tiny logits: keep greedy choices away from near-ties
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.05)  # the bias must change the choice, not be zero
    model.save_pretrained(directory, safe_serialization=True)
    copy_tokenizer(directory)
    return directory


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    arch = request.param
    return arch, _build(str(tmp_path_factory.mktemp(arch)), arch)


def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_hit(checkpoint: tuple[str, str]) -> None:
    arch, path = checkpoint
    hf = load_hf_model(path, reference=arch)
    rng = random.Random(5)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (5, 21)]
    # Prompts of 21 tokens prefill in chunks of 8; the second round repeats the second prompt
    # with a new tail, so its first 21 tokens come from the radix cache.
    sched = make_scheduler(path, dtype="float32", chunked_prefill_size=8, max_total_tokens=1024)
    assert type(sched.runner.token_to_kv_pool) is MLATokenToKVPool
    # Unquantized: q (or q_a) and kv_a projections run as one linear, which the input norm feeds.
    from engine_models_deepseek.mla import DeepseekMLA

    mlas = [m for m in sched.runner.model.modules() if isinstance(m, DeepseekMLA)]
    assert mlas and all(m.input_proj is not None and not hasattr(m, "kv_a_proj_with_mqa") for m in mlas)
    layers = list(sched.runner.model.model.layers)
    assert layers[0].norm_consumers == {"input_layernorm": "self_attn.input_proj",
                                        "post_attention_layernorm": "mlp.gate_up_proj"}  # the dense layer
    assert all(layer.norm_consumers == {"input_layernorm": "self_attn.input_proj",
                                        "post_attention_layernorm": "mlp.gate"} for layer in layers[1:])
    sp = {"max_new_tokens": MAX_NEW, "temperature": 0.0}
    col = OutputCollector()
    rounds = [prompts, [prompts[1] + [rng.randrange(4, VOCAB) for _ in range(6)]]]
    for batch in rounds:
        rids = [submit(sched, p, sp) for p in batch]
        while sched.step():
            col.collect(sched)
        col.collect(sched)
        for rid, prompt in zip(rids, batch):
            assert col.ids[rid] == hf_greedy(hf, prompt, MAX_NEW), f"{arch}: prompt of {len(prompt)} tokens differs"
    assert col.meta[rids[0]]["cached_tokens"] >= 16, col.meta[rids[0]]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs TRITON_INTERPRET=1")
def test_fused_prologue_path_matches_transformers_on_cpu(checkpoint: tuple[str, str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's CUDA wiring on the CPU, its kernels under Triton's interpreter: the fused prologue
    writes the pool and the query rows (at decode batches of up to 4 with the W_UK product's programs in
    the same launch, else after the bmm wrote the latent part in place), the backend
    (torch_native) reads the rows from the pool, the gate's logits and the grouped routing are the
    one-launch kernels, the per-head W_UK / W_UV products the one-launch kernel at small batches, the
    experts the fused ones (at a decode batch of one, the shared expert in the routed experts'
    launches, and the post-attention norm folded into the router's launch, which writes the norm
    output the experts read and the next residual); greedy equal to transformers, with chunked prefill."""
    import engine.layers.moe.fused_moe as fused_module
    import engine.layers.moe.layer as moe_layer
    from engine.layers.moe.router_grouped_kernel import grouped_topk_triton
    from engine_models_deepseek.gate_kernel import gate_logits
    import engine_models_deepseek.gate_kernel as gate_module
    from engine.layers.layernorm import PendingNorm
    from engine_models_deepseek.head_matvec import MAX_TOKENS
    from engine_models_deepseek.mla import HEAD_MATVEC_MAX_TOKENS, DeepseekMLA
    from engine_models_deepseek.models import DeepseekGate

    assert HEAD_MATVEC_MAX_TOKENS == MAX_TOKENS
    arch, path = checkpoint
    calls: list[int] = []
    real = DeepseekMLA._attend_fused

    def counted(self: DeepseekMLA, *args: object) -> torch.Tensor:
        calls.append(1)
        return real(self, *args)

    monkeypatch.setattr(DeepseekMLA, "_prologue_applies", lambda self, kv_a, forward_batch: True)
    monkeypatch.setattr(DeepseekMLA, "_head_matvec_applies", lambda self, x: x.shape[0] <= HEAD_MATVEC_MAX_TOKENS)
    monkeypatch.setattr(DeepseekMLA, "_attend_fused", counted)
    real_gate = DeepseekGate.forward
    # Chunks of <= 8 tokens through the one-launch logits; a pending post-attention norm (batch 1,
    # linked below as the CUDA platform links it) through the real forward's folded path.
    monkeypatch.setattr(DeepseekGate, "forward",
                        lambda self, x: real_gate(self, x) if isinstance(x, PendingNorm) else gate_logits(x, self.weight))
    monkeypatch.setattr(DeepseekGate, "can_fuse_norm", lambda self: True)
    monkeypatch.setattr(DeepseekGate, "takes_pending_norm", lambda self, x: x.shape[0] == 1)
    folded: list[int] = []
    real_logits = gate_module.gate_logits
    monkeypatch.setattr(gate_module, "gate_logits",
                        lambda x, *a, **k: folded.append(isinstance(x, PendingNorm)) or real_logits(x, *a, **k))
    monkeypatch.setattr(moe_layer, "grouped_topk", grouped_topk_triton)
    monkeypatch.setattr(moe_layer, "triton_available", lambda x: True)
    shared_calls: list[int] = []
    real_small = fused_module.fused_moe_small_batch

    def small(*args: object, **kwargs: object) -> torch.Tensor:
        shared_calls.append(kwargs.get("shared") is not None)
        return real_small(*args, **kwargs)

    monkeypatch.setattr(fused_module, "fused_moe_small_batch", small)
    import engine_models_deepseek.mla_prologue as prologue_module

    absorbed: list[bool] = []
    real_prologue = prologue_module.mla_prologue
    monkeypatch.setattr(prologue_module, "mla_prologue",
                        lambda *a, **k: absorbed.append(k.get("w_uk") is not None) or real_prologue(*a, **k))
    hf = load_hf_model(path, reference=arch)
    prompts = [[7, 99, 300, 41, 8], list(range(20, 41))]
    sched = make_scheduler(path, dtype="float32", chunked_prefill_size=8, max_total_tokens=1024)
    # Two prompts together (decode batch 2: the grouped kernels), then one alone (batch 1).
    for batch in (prompts, [[5, 61, 203]]):
        col = OutputCollector()
        rids = [submit(sched, p, {"max_new_tokens": 4, "temperature": 0.0}) for p in batch]
        while sched.step():
            col.collect(sched)
        col.collect(sched)
        for rid, prompt in zip(rids, batch, strict=True):
            assert col.ids[rid] == hf_greedy(hf, prompt, 4), f"{arch}: prompt of {len(prompt)} tokens differs"
    assert calls, "the fused path did not run"
    assert shared_calls and all(shared_calls), shared_calls
    assert any(folded), "the router's launch never took the post-attention norm"
    assert any(absorbed) and not all(absorbed), "prefill chunks apart, decode steps in one launch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_cuda_path_matches_transformers(checkpoint: tuple[str, str], kv_cache_dtype: str) -> None:
    """The CUDA path in float32 (the fused MLA prologue and input projections, the one-launch gate
    and grouped router, the triton MLA kernels, the experts' kernels with the shared expert in the
    routed launches at batch 1, CUDA graphs at decode): greedy equal to transformers with a 16-bit
    pool, for two prompts together and then one alone. Over an fp8 pool (the prologue's quantized
    store, the kernels' fp8 reads; V2 only, the pool's path is the same for V3) the oracle is the
    torch path on the CPU over the same fp8 pool: rows quantized from float32 values that differ in
    the last bits may round to neighbouring fp8 values, so the first 3 tokens must agree."""
    arch, path = checkpoint
    if kv_cache_dtype != "auto" and arch != "DeepseekV2ForCausalLM":
        pytest.skip("the fp8 pool's path does not depend on the architecture: checked with V2")
    rng = random.Random(9)
    rounds = [[[rng.randrange(4, VOCAB) for _ in range(n)] for n in (5, 21)],
              [[rng.randrange(4, VOCAB) for _ in range(13)]]]

    def run(**kwargs: object) -> list[list[int]]:
        sched = make_scheduler(path, dtype="float32", chunked_prefill_size=8, max_total_tokens=1024,
                               kv_cache_dtype=kv_cache_dtype, **kwargs)
        got = []
        for prompts in rounds:
            col = OutputCollector()
            rids = [submit(sched, p, {"max_new_tokens": MAX_NEW, "temperature": 0.0}) for p in prompts]
            while sched.step():
                col.collect(sched)
            col.collect(sched)
            got += [col.ids[rid] for rid in rids]
        return got

    got = run(platform="cuda", attention="triton", cuda_graph_max_bs=2)
    if kv_cache_dtype == "auto":
        hf = load_hf_model(path, reference=arch)
        assert got == [hf_greedy(hf, p, MAX_NEW) for prompts in rounds for p in prompts], arch
    else:
        expected = run()
        assert all(len(g) == MAX_NEW and g[:3] == e[:3] for g, e in zip(got, expected, strict=True)), (got, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_decode_with_folded_norms_and_fused_experts(checkpoint: tuple[str, str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on CUDA with graphs, batch 1: the input norm folded into the fused q/kv_a projection, the
    post-attention norm into the router's launch (which writes the norm output the experts read),
    the shared expert in the routed launches; greedy equal to the same engine with norm fusion
    and PDL off, up to near-ties of bf16 logits. V2 only (the folds do not depend on the routing)."""
    arch, path = checkpoint
    if arch != "DeepseekV2ForCausalLM":
        pytest.skip("the folds and fusions are the same for V3: checked with V2")
    import engine_models_deepseek.gate_kernel as gate_module
    from engine.testing.harness import assert_equal_up_to_near_ties, generate_greedy

    folded: list[int] = []
    real = gate_module.gate_logits
    monkeypatch.setattr(gate_module, "gate_logits",
                        lambda x, *a, **k: folded.append(not isinstance(x, torch.Tensor)) or real(x, *a, **k))
    prompts = [list(range(40, 57))]

    def run(on: bool) -> tuple[list[list[int]], object]:
        sched = make_scheduler(path, platform="cuda", dtype="bfloat16", attention="triton", cuda_graph_max_bs=1,
                               plugin_options={"cuda": {"norm_fusion": on, "pdl": on}})
        return generate_greedy(sched, prompts, MAX_NEW, ignore_eos=True), sched

    off, _ = run(False)
    assert folded and not any(folded)
    folded.clear()
    on, sched = run(True)
    assert any(folded), "the router's launch never took the norm"
    assert_equal_up_to_near_ties(sched, prompts, off, on)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_grouped_router_matches_transformers(arch: str) -> None:
    import transformers

    module = vars(transformers.models)["deepseek_v2" if "V2" in arch else "deepseek_v3"]
    router_cls = getattr(module, f"modeling_{module.__name__.rsplit('.', 1)[1]}")
    config = tiny_config(arch, **dict(CONFIGS[arch], n_routed_experts=16, n_group=4, topk_group=2,
                                      num_experts_per_tok=3))
    router = getattr(router_cls, "DeepseekV2TopkRouter" if "V2" in arch else "DeepseekV3TopkRouter")(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.3)
    hidden = torch.randn(64, config.hidden_size, generator=gen)
    logits, ref_w, ref_ids = router(hidden)
    weights, ids = grouped_topk(logits, 3, routing_for(config), bias)
    order, ref_order = ids.long().sort(dim=-1), ref_ids.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices))


def test_grouped_topk_keeps_to_the_best_groups() -> None:
    # Two groups of 4; group 1 holds the two best experts by the top-2 sum, group 0 the single best.
    logits = torch.tensor([[3.0, -5, -5, -5, 1.0, 1.0, -5, -5]])
    v3 = GroupedTopK("sigmoid", 2, 1, "top2_sum", renormalize=True, scaling_factor=2.0)
    weights, ids = grouped_topk(logits, 2, v3)
    assert sorted(ids[0].tolist()) == [4, 5]
    torch.testing.assert_close(weights.sum(), torch.tensor(2.0))
    _, ids = grouped_topk(logits, 2, GroupedTopK("softmax", 2, 1, "max"))
    assert ids[0, 0].item() == 0 and 0 <= ids[0, 1].item() < 4
    with pytest.raises(ValueError, match="topk_group=1 groups of 2; accepted"):
        GroupedTopK("softmax", 4, 1).check_experts(8, 3)


def test_mla_pool_stores_one_latent_row() -> None:
    pool = MLATokenToKVPool(16, 1, torch.float32, 8, 4, 2, "cpu")
    assert pool.kv_layout == "mla" and pool.bytes_per_token() == 2 * 12 * 4
    rows = torch.randn(3, 1, 12)
    pool.set_kv_buffer(1, torch.tensor([2, 5, 7]), rows, None)
    k, v = pool.get_kv_buffer(1)
    assert torch.equal(k[[2, 5, 7]], rows) and torch.equal(v[[2, 5, 7]], rows[..., :8])
    assert v.data_ptr() == k.data_ptr()  # V is a view of the latent, not a second buffer


def _no_mla_backend() -> types.ModuleType:
    mod = types.ModuleType("nomla")

    @hookimpl
    def register_attention_backends(register):  # type: ignore[no-untyped-def]
        register(AttentionBackendSpec(name="nomla", factory="engine_attention_torch_native.backend:create",
                                      device_types=("cpu",)))

    mod.register_attention_backends = register_attention_backends  # type: ignore[attr-defined]
    return mod


def test_backend_without_the_mla_layout_is_refused_before_load(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = plugins.PluginRegistry(extra_plugins=[("nomla", _no_mla_backend())])
    monkeypatch.setattr(plugins, "get_registry", lambda disabled=(): reg)
    config = types.SimpleNamespace(architectures=["DeepseekV3ForCausalLM"], torch_dtype="float32",
                                   quantization_config=None)
    with pytest.raises(ConfigError) as err:
        select_components(ServerArgs.from_dict({"platform": "cpu", "attention": "nomla"}), config)
    assert re.fullmatch(r"--attention nomla: backend 'nomla' does not read the 'mla' KV layout of "
                        r"DeepseekV3ForCausalLM; backends that do: (.*, )?torch_native(, .*)?", str(err.value)), err.value
    # Without --attention the platform picks among the backends that read the layout.
    chosen = select_components(ServerArgs.from_dict({"platform": "cpu"}), config).attention.name
    assert chosen == "torch_native"
    # An MHA model may still use it.
    llama = types.SimpleNamespace(architectures=["LlamaForCausalLM"], torch_dtype="float32", quantization_config=None)
    assert select_components(ServerArgs.from_dict({"platform": "cpu", "attention": "nomla"}), llama).attention.name == "nomla"


def test_unknown_topk_method_is_refused() -> None:
    config = tiny_config("DeepseekV2ForCausalLM", **dict(CONFIGS["DeepseekV2ForCausalLM"]))
    config.topk_method = "random"
    with pytest.raises(Exception, match=r"config topk_method: invalid value 'random'; accepted: greedy, "
                                        r"group_limited_greedy, noaux_tc"):
        routing_for(config)
