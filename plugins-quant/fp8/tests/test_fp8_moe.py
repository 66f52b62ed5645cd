"""FP8 experts (``engine_quant_fp8.moe``): quantization maths, and ``--quant fp8`` on a tiny MoE.

Bar: at the last position of every prompt the quantized Qwen3-MoE's logits have cosine
similarity > 0.99 with the unquantized model's (attention and dense layers are fp8 too), the
experts are stored as float8 codes with one scale per expert and output channel, and generation
produces ``max_new_tokens`` tokens. Measured on CPU (float32, reference path): cosine 0.9987-0.9993, argmax unchanged.
The fused kernel's fp8 path is tested against the reference in core/tests/layers/moe.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine.layers.moe import FusedMoE
from engine.testing.checkpoints import make_tiny_checkpoint
from engine.testing.harness import assert_cosine_close, assert_generates, last_position_logits, make_scheduler
from engine_quant_fp8.moe import quantize_experts
from engine_quant_fp8.quantize import FP8_DTYPE, FP8_MAX


def test_quantize_experts_per_expert_and_channel() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 16, generator=gen) * torch.tensor([1.0, 10.0, 0.1])[:, None, None]
    q, scale = quantize_experts(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.shape == (3, 8)
    torch.testing.assert_close(scale, w.abs().amax(-1) / FP8_MAX)
    deq = q.float() * scale[..., None]
    assert ((deq - w).abs() <= w.abs().amax(-1, keepdim=True) / 8).all()  # e4m3: 3 mantissa bits


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3moe_fp8")), "Qwen3MoeForCausalLM",
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def test_quant_fp8_on_a_moe_checkpoint(checkpoint: str) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 2048) for _ in range(n)] for n in (1, 9, 21)]
    reference = last_position_logits(make_scheduler(checkpoint), prompts)
    sched = make_scheduler(checkpoint, quant="fp8")
    model = sched.runner.model
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.w13_weight.dtype == FP8_DTYPE and m.w2_weight_scale.shape == (4, 64) for m in experts)
    assert_cosine_close(last_position_logits(sched, prompts), reference, 0.99)
    assert_generates(checkpoint, prompts, 6, quant="fp8")


def test_fp8_experts_take_the_router_logits() -> None:
    """``Fp8MoEMethod`` opts into routing inside the expert launches (``takes_router_logits``: at
    1-2 tokens on CUDA ``FusedMoE`` hands it ``layer.pending_routing`` and no topk tensors); where
    the kernels do not run it resolves that routing itself, equal to being given the tensors."""
    from engine.layers.moe.layer import PendingRouting
    from engine.layers.moe.router import select_experts_reference
    from engine_quant_fp8.moe import Fp8MoEMethod

    assert Fp8MoEMethod.takes_router_logits and Fp8MoEMethod.takes_expert_blocks
    gen = torch.Generator().manual_seed(1)
    layer = FusedMoE(6, 2, 16, 8, renormalize=True, prefix="mlp.experts")
    layer.quant_method = method = Fp8MoEMethod()
    method.create_weights(layer, 6, 16, 8, torch.float32, layer.weight_loader)
    layer.w13_weight.data.copy_(torch.randn(6, 16, 16, generator=gen))
    layer.w2_weight.data.copy_(torch.randn(6, 16, 8, generator=gen))
    method.process_weights_after_loading(layer)
    x = torch.randn(1, 16, generator=gen)
    logits = torch.randn(1, 6, generator=gen)
    w, ids = select_experts_reference(logits, 2, True)
    given = method.apply(layer, x, w, ids)
    layer.pending_routing = PendingRouting(logits, 2, True, 0, 6)
    torch.testing.assert_close(method.apply(layer, x, None, None), given, atol=0, rtol=0)
    assert given.abs().sum() > 0
