"""End to end: the requests SGLang's own benchmark client sends, against ``engine serve``.

SGLang's ``python/sglang/bench_serving.py`` (its ``sglang``, ``sglang-oai`` and
``sglang-oai-chat`` backends) is verified by hand against this server (docs/benchmarks.md);
this module replays its exact payloads and its reads of ``/get_server_info`` so a regression
shows up here without the external file. The bodies below are the client's, field for field,
with its default flags (streaming, ``ignore_eos``, no LoRA, no logprobs).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import MODEL_NAME, Server, assert_no_kv_leak, shared_server, wait_idle  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog and"
OUTPUT_LEN = 6


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Server:
    return shared_server(request.config, tmp_path_factory, llama_ckpt_dir)


def _stream(server: Server, path: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The client's reading of a stream: strip ``data: ``, skip ``[DONE]``, parse the rest."""
    events = []
    with httpx.stream("POST", server.url + path, json=payload, headers=server.headers, timeout=60) as r:
        assert r.status_code == 200, r.read().decode()
        for line in r.iter_lines():
            line = line.strip()
            if not line:
                continue
            chunk = line.removeprefix("data: ")
            if chunk != "[DONE]":
                events.append(json.loads(chunk))
    return events


@pytest.mark.parametrize("prompt_key", ["text", "input_ids"])  # input_ids: its --tokenize-prompt
def test_backend_sglang_generate(server: Server, prompt_key: str) -> None:
    prompt: Any = PROMPT if prompt_key == "text" else server.post("/v1/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    payload = {
        prompt_key: prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": OUTPUT_LEN, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
    }
    events = _stream(server, "/generate", payload)
    with_text = [e for e in events if "text" in e and e["text"]]
    assert with_text, events
    # It takes the last event's text and meta_info.completion_tokens as the output.
    assert with_text[-1]["meta_info"]["completion_tokens"] == OUTPUT_LEN
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == OUTPUT_LEN


def test_backend_sglang_generate_with_a_lora_is_refused_by_name(server: Server) -> None:
    # Its --lora-name sends the adapter in lora_path: this server runs without LoRA, named in the 400.
    r = server.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, "lora_path": "a"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "LoRA adapters" in r.json()["error"]["message"]


def test_backend_sglang_oai_completions(server: Server) -> None:
    payload = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0.0, "best_of": 1, "max_tokens": OUTPUT_LEN,
               "stream": True, "ignore_eos": True}
    events = _stream(server, "/v1/completions", payload)
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert text and all(e["choices"][0].get("text") is not None for e in events if e.get("choices"))


def test_backend_sglang_oai_chat(server: Server) -> None:
    payload = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0.0,
               "max_tokens": OUTPUT_LEN, "stream": True}
    events = _stream(server, "/v1/chat/completions", payload)
    contents = [e.get("choices", [{}])[0].get("delta", {}).get("content", "") for e in events]
    assert any(contents)


def test_server_info_as_the_client_reads_it(server: Server) -> None:
    # After the run it reads internal_states[0] (no "decode" key: not a disaggregated server).
    info = server.get("/get_server_info").json()
    if "decode" in info:
        info = info["decode"][0]
    assert info["internal_states"][0].get("avg_spec_accept_length", None) is None
    assert info["internal_states"][0]["memory_usage"]["token_capacity"] == info["max_total_num_tokens"]
    assert server.get("/server_info").json()["internal_states"]  # newer clients' route


def test_max_new_tokens_zero_is_prompt_only(server: Server) -> None:
    ids = server.post("/v1/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0, "lora_path": None}
    out = server.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == "" and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids
    assert meta["input_token_logprobs"][0][0] is None and all(lp < 0 for lp, _, _ in meta["input_token_logprobs"][1:])
    assert meta["output_token_logprobs"] == []
    events = _stream(server, "/generate", {**body, "stream": True})
    assert [e["output_ids"] for e in events] == [[]]
    assert_no_kv_leak(wait_idle(server))
