"""The model's final RMSNorm folded into the LM head (``norm_consumers = {"model.norm": "lm_head"}``,
``ParallelLMHead.takes_pending_norm``, ``LogitsProcessor`` projecting a ``PendingNorm``) and
float32 logits from the kernel (``float32_out``), on the CPU.

The platform's kernel is a PyTorch stand-in (``_TorchLmHeadKernel``) that computes the norm as
``RMSNorm`` does and multiplies by ``F.linear``, so the engine must give the unfused engine's
logits, tokens and hidden states bit for bit: what is checked is the plumbing (who hands what to
whom, which rows, the norm output filled before a reader), not the kernel
(plugins/platform-cuda/tests/test_gemv_lm_head.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.layers.layernorm import PendingNorm
from engine.layers.quantization.fusion import link_norm_consumers
from engine.model_executor.forward_batch import ForwardBatch, ForwardMode
from engine.testing.harness import generate_greedy, last_position_logits, make_scheduler


class _TorchLmHeadKernel:
    """Stands for ``layer_kernels()['linear']`` with the final norm's fusion: PyTorch on the CPU
    (it takes CPU rows, which the real kernel never does); the decoder norms stay unfused."""

    max_rows = 8
    norm_fusion = True
    final_norm_fusion = True

    def __init__(self, float32_out: bool = True) -> None:
        self.float32_out = float32_out
        self.final_calls = 0
        self.out_dtypes: list[torch.dtype | None] = []

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        raise AssertionError("not called: linear_with_kernel wants CUDA tensors")

    def takes_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return False

    def takes_final_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype

    def final_norm_linear(self, pending: PendingNorm, weight: torch.Tensor,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
        self.final_calls += 1
        self.out_dtypes.append(out_dtype)
        x = pending.x
        if pending.residual is not None:
            x = x + pending.residual
            pending.res_sum.view_as(x).copy_(x)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + pending.eps)
        normed = pending.weight * h.to(x.dtype)
        pending.normed.view_as(normed).copy_(normed)
        y = F.linear(normed, weight)
        return y if out_dtype is None else y.to(out_dtype)


def _install(sched: Any, kernel: Any) -> None:
    """What the model runner does at start-up, with the stand-in as the platform's ``linear``."""
    model = sched.runner.model
    for module in model.modules():
        use = getattr(module, "use_kernels", None)
        if callable(use):
            use({"linear": kernel})
    link_norm_consumers(model)
    assert model.model.norm.fuse_into is model.lm_head


def _recording(sched: Any) -> list[torch.Tensor]:
    """Every step's logits as the sampler gets them."""
    seen: list[torch.Tensor] = []
    sample = sched.runner.sample

    def recording(logits_output: Any, forward_batch: Any) -> Any:
        seen.append(logits_output.next_token_logits.clone())
        return sample(logits_output, forward_batch)

    sched.runner.sample = recording
    return seen


def _one_token_forward(sched: Any, token: int) -> Any:
    """An EXTEND forward of a one-token prompt asking for prompt logprobs and the final hidden states."""
    runner = sched.runner
    slots = runner.req_to_token_pool.alloc(1)
    loc = runner.token_to_kv_pool_allocator.alloc_extend([0], [1], [-1])
    runner.req_to_token_pool.write(slots[0], 0, loc)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [token], slots, [1], [0], loc, runner.device,
                               return_logprob=True)
    runner.capture_hidden = ()
    try:
        return runner.forward(batch)
    finally:
        runner.capture_hidden = None


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3MoeForCausalLM", "Qwen2ForCausalLM"])
def checkpoint(request: Any, tmp_path_factory: Any) -> str:
    from engine.testing.checkpoints import make_tiny_checkpoint

    extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if "Moe" in request.param else {}
    # Qwen2's tiny checkpoint ties the LM head to the embedding.
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("final-norm")), request.param, dtype="bfloat16",
                                seed=3, **extra)


def test_the_folded_final_norm_gives_the_unfused_engines_logits_and_tokens(checkpoint: str) -> None:
    plain = make_scheduler(checkpoint, dtype="bfloat16")
    fused = make_scheduler(checkpoint, dtype="bfloat16")
    kernel = _TorchLmHeadKernel()
    _install(fused, kernel)
    plain_steps, fused_steps = _recording(plain), _recording(fused)
    for batch in ([list(range(5, 10))], [list(range(30, 47)), list(range(100, 109))]):
        want = generate_greedy(plain, batch, 8, ignore_eos=True)
        assert generate_greedy(fused, batch, 8, ignore_eos=True) == want
    # Every step's logits (the prefills of 5 and 17 + 9 tokens, decode steps at batch 1 and 2).
    assert len(fused_steps) == len(plain_steps) and all(
        got.dtype == torch.float32 and torch.equal(got, want) for got, want in zip(fused_steps, plain_steps, strict=True))
    calls = kernel.final_calls
    assert calls == 7  # the decode steps at batch 1 (8 tokens: one prefill, then 7 steps of one row)
    assert set(kernel.out_dtypes) == {torch.float32}  # one GPU: float32 logits from the kernel
    # A one-token prefill is one row too: taken, with its prompt logits and hidden states.
    for token in (7, 1999):
        want = _one_token_forward(plain, token)
        got = _one_token_forward(fused, token)
        assert torch.equal(got.next_token_logits, want.next_token_logits)
        assert torch.equal(got.full_logits, want.full_logits) and got.full_logits is not got.next_token_logits
        assert torch.equal(got.hidden_states, want.hidden_states)
    assert kernel.final_calls == calls + 2
    # Two rows: the norm runs as before.
    assert torch.equal(last_position_logits(fused, [[7, 8]]), last_position_logits(plain, [[7, 8]]))
    assert kernel.final_calls == calls + 2


def test_not_linked_without_the_kernels_final_norm_fusion(checkpoint: str) -> None:
    sched = make_scheduler(checkpoint, dtype="bfloat16")
    model = sched.runner.model
    kernel = _TorchLmHeadKernel()
    kernel.final_norm_fusion = False  # type: ignore[misc]  # cuda.final_norm_fusion (or norm_fusion) off
    for module in model.modules():
        use = getattr(module, "use_kernels", None)
        if callable(use):
            use({"linear": kernel})
    link_norm_consumers(model)
    assert model.model.norm.fuse_into is None
    generate_greedy(sched, [[5, 6, 7]], 3, ignore_eos=True)
    assert kernel.final_calls == 0
