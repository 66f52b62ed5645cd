"""Base test classes of the conformance kit (see ``engine.testing``)."""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest
import torch

from engine import plugins
from engine.hookspecs import resolve_factory


def _device_or_skip(device: str) -> torch.device:
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device(device)


# -- attention -------------------------------------------------------------------------
class AttentionBackendConformance:
    """Set ``backend_name``; optionally ``device``, ``dtypes``, ``page_sizes``, tolerances."""

    backend_name: ClassVar[str] = ""
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    page_sizes: ClassVar[tuple[int, ...]] = (1, 4)
    atol: ClassVar[dict[torch.dtype, float]] = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
    num_heads: ClassVar[int] = 4
    num_kv_heads: ClassVar[int] = 2
    head_dim: ClassVar[int] = 32

    def _setup(self, dtype: torch.dtype, page_size: int, pool_tokens: int = 4096) -> tuple[Any, Any, Any, Any]:
        from engine.attention import AttentionContext
        from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator

        device = _device_or_skip(self.device)
        r2t = ReqToTokenPool(16, 1024, device)
        kv = MHATokenToKVPool(pool_tokens, page_size, dtype, self.num_kv_heads, self.head_dim, 1, device)
        alloc = TokenToKVPoolAllocator(pool_tokens, page_size, device)
        # Shuffle free pages so rows are scattered through the pool.
        alloc.free_pages = alloc.free_pages[torch.randperm(len(alloc.free_pages), device=alloc.free_pages.device)]
        ctx = AttentionContext(device=device, dtype=dtype, num_layers=1, num_heads=self.num_heads,
                               num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, page_size=page_size,
                               max_context_len=1024, req_to_token_pool=r2t, token_to_kv_pool=kv)
        spec = plugins.get_attention_backend(self.backend_name)
        return resolve_factory(spec.factory)(ctx), r2t, kv, alloc

    def _run(self, mode: str, dtype: torch.dtype, page_size: int, window: int = -1, cap: float = 0.0) -> None:
        from engine.layers.radix_attention import RadixAttention
        from engine.model_executor.forward_batch import ForwardBatch, ForwardMode
        from engine.testing.reference import reference_attention

        backend, r2t, kv, alloc = self._setup(dtype, page_size)
        device = kv.device
        rng = random.Random()
        bs = rng.randint(1, 6)
        prefix = [rng.randint(0, 90) for _ in range(bs)]
        ext = [1 if mode == "decode" else rng.randint(1, 40) for _ in range(bs)]
        seq = [p + e for p, e in zip(prefix, ext)]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        slots = r2t.alloc(bs)
        # Allocate the prefix, fill it with random K/V, then allocate the new tokens.
        pre_loc = alloc.alloc_extend([0] * bs, prefix, [-1] * bs)
        off = 0
        for i in range(bs):
            r2t.write(slots[i], 0, pre_loc[off : off + prefix[i]])
            off += prefix[i]
        kv.k_buffer[0][pre_loc] = torch.randn(len(pre_loc), Hkv, D, device=device).to(dtype)
        kv.v_buffer[0][pre_loc] = torch.randn(len(pre_loc), Hkv, D, device=device).to(dtype)
        last = [int(r2t.req_to_token[slots[i], prefix[i] - 1]) if prefix[i] else -1 for i in range(bs)]
        new_loc = alloc.alloc_extend(prefix, seq, last)
        off = 0
        for i in range(bs):
            r2t.write(slots[i], prefix[i], new_loc[off : off + ext[i]])
            off += ext[i]
        n = sum(ext)
        q = torch.randn(n, H * D, device=device).to(dtype)
        k = torch.randn(n, Hkv * D, device=device).to(dtype)
        v = torch.randn(n, Hkv * D, device=device).to(dtype)
        fmode = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
        fb = ForwardBatch.build(fmode, [0] * n, slots, seq, prefix, new_loc, device)
        fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = r2t, kv, backend
        layer = RadixAttention(H, D, D**-0.5, Hkv, 0, logit_cap=cap, sliding_window_size=window)
        backend.init_forward_metadata(fb)
        out = backend.forward(q, k, v, layer, fb)
        assert out.shape == (n, H * D) and torch.isfinite(out).all()
        off = 0
        for i in range(bs):
            rows = r2t.req_to_token[slots[i], : seq[i]].long()
            ref = reference_attention(
                q[off : off + ext[i]].view(-1, H, D), kv.k_buffer[0][rows], kv.v_buffer[0][rows],
                torch.arange(prefix[i], seq[i], device=device), D**-0.5, window, cap)
            got = out[off : off + ext[i]].view(-1, H, D).double()
            err = (got - ref).abs().max().item()
            assert err <= self.atol[dtype], f"row {i}: max abs error {err} > {self.atol[dtype]} ({mode}, {dtype}, page {page_size})"
            off += ext[i]

    @pytest.mark.parametrize("mode", ["extend", "decode"])
    def test_matches_reference(self, mode: str) -> None:
        for dtype in self.dtypes:
            for page_size in self.page_sizes:
                self._run(mode, dtype, page_size)

    @pytest.mark.parametrize("mode", ["extend", "decode"])
    def test_sliding_window_and_logit_cap(self, mode: str) -> None:
        self._run(mode, self.dtypes[0], self.page_sizes[0], window=16, cap=30.0)


# -- models ----------------------------------------------------------------------------------
class ModelConformance:
    """Set ``architecture`` (a HF ``architectures`` name); optionally overrides and tolerances.

    Logits at the last position of each prompt must agree with transformers within
    ``logits_atol`` (float32), and greedy generation must match token for token.
    """

    architecture: ClassVar[str] = ""
    config_overrides: ClassVar[dict[str, Any]] = {}
    logits_atol: ClassVar[float] = 1e-3
    max_new_tokens: ClassVar[int] = 24
    server_args: ClassVar[dict[str, Any]] = {}
    #: where and in what dtype both the engine and transformers run.
    device: ClassVar[str] = "cpu"
    dtype: ClassVar[str] = "float32"

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        from engine.testing.checkpoints import make_tiny_checkpoint

        path = tmp_path_factory.mktemp(cls.architecture or "model")
        return make_tiny_checkpoint(str(path), cls.architecture, **cls.config_overrides)

    @pytest.fixture(scope="class")
    @classmethod
    def hf_model(cls, checkpoint: str) -> Any:
        from engine.testing.checkpoints import load_hf_model

        _device_or_skip(cls.device)
        return load_hf_model(checkpoint, cls.dtype, cls.device)

    def _engine_args(self) -> dict[str, Any]:
        platform = "cpu" if self.device == "cpu" else self.device.split(":")[0]
        return {"platform": platform, "dtype": self.dtype, **self.server_args}

    @pytest.fixture(scope="class")
    @classmethod
    def prompts(cls) -> list[list[int]]:
        rng = random.Random(1234)
        return [[rng.randrange(4, 2048) for _ in range(n)] for n in (5, 17, 40, 3, 63)]

    def test_logits_match_transformers(self, checkpoint: str, hf_model: Any, prompts: list[list[int]]) -> None:
        from engine.testing.checkpoints import hf_last_logits
        from engine.testing.harness import last_position_logits, make_scheduler

        ours = last_position_logits(make_scheduler(checkpoint, **self._engine_args()), prompts)
        for i, p in enumerate(prompts):
            ref = hf_last_logits(hf_model, p)
            err = (ours[i] - ref).abs().max().item()
            assert err <= self.logits_atol, f"prompt {i}: max abs logit error {err} > {self.logits_atol}"

    def test_greedy_matches_transformers(self, checkpoint: str, hf_model: Any, prompts: list[list[int]]) -> None:
        from engine.testing.checkpoints import hf_greedy
        from engine.testing.harness import generate_greedy, make_scheduler

        sched = make_scheduler(checkpoint, **self._engine_args())
        ours = generate_greedy(sched, prompts, self.max_new_tokens)
        for i, p in enumerate(prompts):
            ref = hf_greedy(hf_model, p, self.max_new_tokens)
            if self.dtype == "float32":
                assert ours[i] == ref, f"prompt {i} differs"
            else:
                self._check_until_near_tie(hf_model, p, ours[i], ref, i)

    #: bf16/fp16 only: where the two greedy paths first differ, transformers' logits of the two
    #: chosen tokens must be within this distance (a near-tie that rounding may break either way).
    tie_tolerance: ClassVar[float] = 0.1

    def _check_until_near_tie(self, hf_model: Any, prompt: list[int], ours: list[int], ref: list[int], i: int) -> None:
        check_greedy_until_near_tie(hf_model, prompt, ours, ref, self.max_new_tokens, self.tie_tolerance,
                                    f"prompt {i}")


def check_greedy_until_near_tie(hf_model: Any, prompt: list[int], ours: list[int], ref: list[int],
                                max_new_tokens: int, tie_tolerance: float, label: str) -> None:
    """Greedy outputs in bf16/fp16 must equal transformers' up to the first position where the two
    chosen tokens' transformers logits are within ``tie_tolerance`` (rounding may break a near-tie
    either way); a difference anywhere else fails."""
    from engine.testing.checkpoints import hf_last_logits

    k = next((j for j in range(min(len(ours), len(ref))) if ours[j] != ref[j]), None)
    if k is None:
        assert len(ours) == len(ref) or max_new_tokens in (len(ours), len(ref)), f"{label}: lengths differ"
        return
    logits = hf_last_logits(hf_model, prompt + ref[:k])
    gap = (logits[ref[k]] - logits[ours[k]]).item()
    assert gap <= tie_tolerance, (
        f"{label}: token {k} differs ({ours[k]} vs transformers' {ref[k]}) with a logit gap of {gap:.3f} "
        f"> {tie_tolerance}: not a rounding tie")


# -- policies ----------------------------------------------------------------------------------
class SchedulePolicyConformance:
    """Set ``policy_name``. The order must be a deterministic permutation of the queue."""

    policy_name: ClassVar[str] = ""

    def _queue(self, seed: int) -> list[Any]:
        from engine.managers.schedule_batch import Req
        from engine.sampling.sampling_params import SamplingParams

        rng = random.Random(seed)
        reqs = []
        for i in range(20):
            r = Req(f"r{i}", [rng.randrange(100) for _ in range(rng.randint(1, 50))],
                    SamplingParams(max_new_tokens=rng.randint(1, 64)), set(), priority=rng.randint(0, 3))
            r.prefix_len_hint = rng.randint(0, len(r.origin_input_ids))
            reqs.append(r)
        return reqs

    def _policy(self) -> Any:
        spec = plugins.get_schedule_policy(self.policy_name)
        policy = resolve_factory(spec.factory)()
        policy.cache_aware = spec.cache_aware
        return policy

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> str:
        from engine.testing.checkpoints import make_tiny_checkpoint

        return make_tiny_checkpoint(str(tmp_path_factory.mktemp("policy-model")), "LlamaForCausalLM")

    def _run_scheduler(self, path: str, policy: str) -> list[list[int]]:
        from engine.testing.harness import OutputCollector, generate_greedy, make_scheduler, submit

        shared = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
        prompts = [[40, 41, 42], shared + [1, 2, 3], [40, 41, 43, 44], shared + [1, 2, 4, 5],
                   shared[:4] + [60], shared + [30, 31]]
        # Two at a time, so the order matters across several prefill rounds.
        sched = make_scheduler(path, schedule_policy=policy, max_total_tokens=4096, max_running_requests=2)
        generate_greedy(sched, [shared + [1, 2]], 2)  # prefix hits for cache-aware policies
        col = OutputCollector()
        rids = [submit(sched, p, {"max_new_tokens": 4 + 2 * i, "temperature": 0, "ignore_eos": True},
                       priority=i % 3) for i, p in enumerate(prompts)]
        while sched.step():
            col.collect(sched)
        col.collect(sched)
        return [col.ids[r] for r in rids]

    def test_greedy_outputs_match_fcfs(self, tiny_checkpoint: str) -> None:
        """Order changes when requests run, never what they generate."""
        got = self._run_scheduler(tiny_checkpoint, self.policy_name)
        assert got == self._run_scheduler(tiny_checkpoint, "fcfs")
        assert [len(ids) for ids in got] == [4 + 2 * i for i in range(6)]

    def test_orders_deterministically(self) -> None:
        from engine.managers.policy import PolicyContext

        queue = self._queue(7)
        first = self._policy().order(list(queue), PolicyContext())
        second = self._policy().order(list(queue), PolicyContext())
        assert [r.rid for r in first] == [r.rid for r in second]
        assert sorted(r.rid for r in first) == sorted(r.rid for r in queue), "order() must return a permutation"


# -- platforms -----------------------------------------------------------------------------------
class PlatformConformance:
    """Set ``platform_name``; probes must answer with the documented types."""

    platform_name: ClassVar[str] = ""

    def test_answers_probes(self) -> None:
        spec = plugins.get_platform_spec(self.platform_name)
        platform = resolve_factory(spec.factory)()
        assert isinstance(platform.is_available(), bool)
        assert platform.device_type == spec.device_type
        assert isinstance(platform.distributed_backend(), str) and platform.distributed_backend()
        assert platform.default_attention_backend() in plugins.attention_backends(), "default attention backend is not installed"
        assert isinstance(platform.supports_graph_capture(), bool)
        if not platform.is_available():
            assert platform.unavailable_reason()
            return
        free, total = platform.memory_info(platform.device(0))
        assert 0 <= free <= total and total > 0


# -- quantization ------------------------------------------------------------------------------------
class QuantMethodConformance:
    """Set ``method_name`` and ``max_rel_error``: a linear layer through the method vs float."""

    method_name: ClassVar[str] = ""
    device: ClassVar[str] = "cpu"
    dtype: ClassVar[torch.dtype] = torch.float32
    max_rel_error: ClassVar[float] = 0.05

    def test_linear_round_trip(self) -> None:
        from engine.layers.linear import RowParallelLinear

        device = _device_or_skip(self.device)
        spec = plugins.get_quantization_method(self.method_name)
        qcfg = resolve_factory(spec.factory)({})
        torch.manual_seed(0)
        weight = torch.randn(96, 128, dtype=self.dtype)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(device):
                layer = RowParallelLinear(128, 96, bias=False, quant_config=qcfg, prefix="model.layers.0.mlp.down_proj")
        finally:
            torch.set_default_dtype(prev)
        assert layer.weight.dtype == self.dtype, "on-the-fly methods load the weight in the model dtype"
        layer.weight.weight_loader(layer.weight, weight)
        layer.quant_method.process_weights_after_loading(layer)
        x = torch.randn(8, 128, dtype=self.dtype, device=device)
        ref = x.double() @ weight.double().to(device).t()
        got = layer(x).double()
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel <= self.max_rel_error, f"relative error {rel} > {self.max_rel_error}"
