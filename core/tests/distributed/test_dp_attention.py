"""DP attention on the CPU (gloo, one process per replica): ``--enable-dp-attention --tp-size 2
--dp-size 2`` serves a tiny DeepSeek-V3 (MLA, a dense first layer, then shared + routed experts)
with greedy outputs equal to transformers' (which one rank's equal, tests of the DeepSeek plugin).

Each replica holds whole attention and its own requests' KV; the MLPs split over both replicas and
run on both replicas' tokens. Four prompts of different lengths (round-robin: two per replica,
with chunked prefill) keep the replicas' batches unlike; then one prompt alone keeps one replica
idle while the other decodes, so the idle one runs its MLP-only forwards in lockstep.
"""

from __future__ import annotations

import random

import pytest

from engine import Engine
from engine.errors import ConfigError
from engine.testing.checkpoints import hf_greedy, load_hf_model, make_tiny_checkpoint

MAX_NEW = 6
SHAPES = dict(vocab_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
              q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
              num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32,
              n_shared_experts=1, max_position_embeddings=512)


def test_dp_attention_tp2_equals_transformers(tmp_path: pytest.TempPathFactory) -> None:
    ckpt = make_tiny_checkpoint(str(tmp_path), "DeepseekV3ForCausalLM", **SHAPES)
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 500) for _ in range(n)] for n in (3, 30, 9, 21)]
    model = load_hf_model(ckpt)
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0}
    with Engine(model_path=ckpt, tp_size=2, dp_size=2, enable_dp_attention=True, router_policy="round-robin",
                max_total_tokens=256, chunked_prefill_size=16, log_level="warning") as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=greedy)
        alone = eng.generate(input_ids=prompts[3], sampling_params=greedy)
        info = eng.get_server_info()
    assert [o["output_ids"] for o in outs] == expected
    assert alone["output_ids"] == expected[3]
    assert info["kv_used_tokens"] == 0


@pytest.mark.parametrize("flags, message", [
    (dict(tp_size=2, dp_size=1), "needs --tp-size N --dp-size N with N >= 2"),
    (dict(tp_size=2, dp_size=2, pp_size=2), "--pp-size: invalid value 2 with --enable-dp-attention"),
])
def test_dp_attention_refuses_other_layouts(flags: dict[str, int], message: str) -> None:
    from engine.config import ServerArgs

    with pytest.raises(ConfigError, match=message):
        ServerArgs.from_dict({"model_path": "x", "enable_dp_attention": True, **flags})


def test_a_model_without_split_mlps_is_refused() -> None:
    from torch import nn

    from engine.distributed.dp_attention import check_model_splits_mlps
    from engine.errors import EngineError

    plain = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(EngineError, match="--enable-dp-attention: Sequential does not split its MLPs"):
        check_model_splits_mlps(plain)
    plain[0].dp_attention_mlp = True  # what data_parallel_mlp marks
    check_model_splits_mlps(plain)
