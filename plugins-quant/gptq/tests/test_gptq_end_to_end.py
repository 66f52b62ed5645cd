"""GPTQ checkpoints of a tiny random Llama, served by the engine on CPU.

Written by ``pack_gptq`` from a round-to-nearest quantization (with a random act-order ``g_idx``
shared by projections of one input, as GPTQ's shared Hessian gives); the reference is the model
with every projection replaced by its dequantized float32 weight. Bar: last-position logits
within relative L2 error 1e-4 (measured on CPU: 0, bit-identical), identical greedy
outputs.
"""

from __future__ import annotations

import functools

import pytest
from engine_quant_gptq.format import pack_gptq
from engine_quant_wna16.checkpoints import (
    compare_with_reference,
    make_base_checkpoint,
    random_prompts,
    write_quantized_checkpoint,
)

MAX_REL_ERROR = 1e-4
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_base_checkpoint(str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(13)


def gptq_config(bits: int, group_size: int, sym: bool, desc_act: bool, v2: bool) -> dict[str, object]:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": "gptq_v2" if v2 else "gptq", "damp_percent": 0.01, "true_sequential": True}


@pytest.mark.parametrize(("bits", "group_size", "sym", "desc_act", "v2"), [
    (4, 32, False, False, False),
    (4, 64, True, True, False),
    (4, 128, False, True, True),
    (4, 128, True, False, True),
    (4, -1, True, False, False),
    (8, 128, False, True, False),
])
def test_gptq_checkpoint_matches_dequantized_model(base: str, prompts: list[list[int]], tmp_path: object, bits: int,
                                                   group_size: int, sym: bool, desc_act: bool, v2: bool) -> None:
    quantized, reference = write_quantized_checkpoint(
        base, f"{tmp_path}/gptq", f"{tmp_path}/ref", gptq_config(bits, group_size, sym, desc_act, v2),
        functools.partial(pack_gptq, v2=v2), bits=bits, group_size=group_size, symmetric=sym, act_order=desc_act)
    rel, out_q, out_r = compare_with_reference(quantized, reference, prompts, MAX_NEW_TOKENS)
    assert float(rel.max()) < MAX_REL_ERROR, f"relative logit error per prompt: {rel.tolist()}"
    assert out_q == out_r
