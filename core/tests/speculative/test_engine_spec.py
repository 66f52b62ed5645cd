"""The offline Engine (all processes) with --speculative-algorithm ngram: greedy output equal to
transformers, acceptance statistics in meta_info and in the server info."""

from __future__ import annotations

from typing import Any

from engine.entrypoints.engine import Engine
from engine.testing.checkpoints import hf_greedy


def test_engine_ngram_meta_info(llama_ckpt: str, hf_llama: Any) -> None:
    phrase = [11, 400, 52, 930, 7, 1500, 64, 222]
    prompts = [phrase * 4, [5, 9, 13]]
    with Engine(model_path=llama_ckpt, max_total_tokens=2048, speculative_algorithm="ngram",
                speculative_num_steps=4) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 20, "temperature": 0})
        for p, out in zip(prompts, outs):
            assert out["output_ids"] == hf_greedy(hf_llama, p, 20)
            meta = out["meta_info"]
            assert meta["spec_verify_ct"] >= 1
            assert meta["spec_accept_length"] == (meta["spec_accepted_tokens"] + meta["spec_verify_ct"]) / meta["spec_verify_ct"]
            assert 1.0 <= meta["spec_accept_length"] <= 5.0
