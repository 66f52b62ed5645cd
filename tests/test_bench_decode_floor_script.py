"""``scripts/bench_decode_floor.py`` still finds what it replaces (the attention's ``forward_qkv``,
the MoE layer's ``select_experts``): on the CPU with a tiny Qwen3-MoE config every variant runs, and
each replacement runs in the variants that name it and in no other. A ``stage_*`` variant stages only
while a CUDA graph is captured, so on the CPU it runs the step unchanged."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_floor_variants_run_on_a_tiny_moe(tmp_path: pathlib.Path) -> None:
    config = json.loads((ROOT / "docs" / "bench_configs" / "qwen3-30b-a3b" / "config.json").read_text())
    config.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
                  num_experts_per_tok=4, vocab_size=1000, max_position_embeddings=1024,
                  bos_token_id=1, eos_token_id=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    names = ["base", "no_attn", "no_topk", "no_attn_no_topk", "stage_pf"]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_decode_floor.py"), str(tmp_path),
                           ",".join(names), "1"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "ATTN": "torch_native"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["variant"] for r in rows] == names
    assert all(r["decode_ms"] > 0 for r in rows)
    for r in rows:
        assert (r["replaced"]["attn"] > 0) == ("no_attn" in r["variant"]), r
        assert (r["replaced"]["topk"] > 0) == ("no_topk" in r["variant"]), r
        assert r["replaced"]["stage"] == 0, r


def test_stage_in_l2_names_what_it_accepts() -> None:
    import importlib.util

    import pytest
    import torch

    spec = importlib.util.spec_from_file_location("bench_l2_retention", ROOT / "scripts" / "bench_l2_retention.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ValueError, match="accepted: pf, pfN, ld, ldN"):
        module.stage_in_l2(torch.zeros(8), "bulk", torch.zeros(8))
