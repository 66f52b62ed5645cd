"""AWQ checkpoints of a tiny random Llama, served by the engine on CPU.

Each checkpoint is written by ``pack_awq`` from a round-to-nearest quantization; the reference is
the same model with every projection replaced by its dequantized float32 weight. Bar: last-position
logits within relative L2 error 1e-4 of the reference (measured on CPU: 0, bit-identical)
and identical greedy outputs. Against the unquantized model the 4-bit error is far larger
(cosine of logits 0.95-0.97 at groups of 128, 0.98 at 32), which is the format's, not the loader's.
"""

from __future__ import annotations

import pytest
from engine_quant_awq.format import pack_awq
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
    return random_prompts(11)


def awq_config(group_size: int) -> dict[str, object]:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_checkpoint_matches_dequantized_model(base: str, prompts: list[list[int]], tmp_path: object,
                                                  group_size: int) -> None:
    quantized, reference = write_quantized_checkpoint(base, f"{tmp_path}/awq", f"{tmp_path}/ref",
                                                      awq_config(group_size), pack_awq, group_size=group_size)
    rel, out_q, out_r = compare_with_reference(quantized, reference, prompts, MAX_NEW_TOKENS)
    assert float(rel.max()) < MAX_REL_ERROR, f"relative logit error per prompt: {rel.tolist()}"
    assert out_q == out_r
