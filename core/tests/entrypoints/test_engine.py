"""The offline Engine on its three processes, against transformers."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engine import Engine
from engine.testing.checkpoints import hf_greedy


@pytest.fixture(scope="module")
def engine(llama_ckpt: str) -> Iterator[Engine]:
    with Engine(model_path=llama_ckpt, max_total_tokens=4096) as eng:
        yield eng


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in (3, 11, 30, 7)]


def test_batch_greedy_equals_transformers(engine: Engine, hf_llama: Any) -> None:
    prompts = _prompts()
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0})
    assert isinstance(outs, list) and len(outs) == len(prompts)
    for p, out in zip(prompts, outs):
        assert out["output_ids"] == hf_greedy(hf_llama, p, 16)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(p) and meta["completion_tokens"] == len(out["output_ids"])
        assert meta["finish_reason"]["type"] in ("length", "stop")


def test_text_prompt_single_returns_dict(engine: Engine, hf_llama: Any) -> None:
    out = engine.generate("Hello there", {"max_new_tokens": 8, "temperature": 0})
    assert isinstance(out, dict)
    ids = engine.tokenizer.encode("Hello there")
    assert out["output_ids"] == hf_greedy(hf_llama, ids, 8)
    assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_stream_equals_non_stream(engine: Engine) -> None:
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = engine.generate("The quick brown fox", params)
    chunks = list(engine.generate("The quick brown fox", params, stream=True))
    # A chunk carries every token ready when the stream's reader wakes: how many chunks arrive depends on
    # the machine's load, so only their content is checked (each a prefix of the next, the last the whole).
    assert chunks
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "stream text must grow monotonically"
    ids = [c["output_ids"] for c in chunks]
    assert all(b[: len(a)] == a and len(b) > len(a) for a, b in zip(ids, ids[1:])), "each chunk adds tokens"


def test_seeded_sampling_is_reproducible_and_n(engine: Engine) -> None:
    params = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 42, "ignore_eos": True}
    a = engine.generate("Once upon", params)
    b = engine.generate("Once upon", params)
    assert a["output_ids"] == b["output_ids"]
    many = engine.generate("Once upon", {**params, "n": 3})
    assert isinstance(many, list) and len(many) == 3
    assert many[0]["output_ids"] == a["output_ids"]
    assert len({tuple(m["output_ids"]) for m in many}) > 1


def test_stop_token_ids_and_ignore_eos(engine: Engine) -> None:
    base = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    stop_at = base["output_ids"][3]
    first = base["output_ids"].index(stop_at)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [stop_at]})
    assert out["output_ids"] == base["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_stop_string_cuts_text(engine: Engine) -> None:
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    first = engine.generate("The lazy dog", params)
    full = first["text"]
    assert len(full) > 6
    stop = full[3:6]
    out = engine.generate("The lazy dog", {**params, "stop": [stop]})
    assert out["text"] == full[: full.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # The scheduler ended it at the token that completes the stop string, not at max_new_tokens.
    ids = first["output_ids"]
    k = next(k for k in range(1, len(ids) + 1) if stop in engine.tokenizer.decode(ids[:k]))
    assert out["output_ids"] == ids[:k] and out["meta_info"]["completion_tokens"] == k < 16


def test_cached_tokens_on_shared_prefix(engine: Engine) -> None:
    prefix = list(range(100, 160))
    engine.generate(input_ids=prefix + [7], sampling_params={"max_new_tokens": 2})
    out = engine.generate(input_ids=prefix + [9, 10], sampling_params={"max_new_tokens": 2})
    assert out["meta_info"]["cached_tokens"] >= len(prefix)


def test_invalid_request_raises(engine: Engine) -> None:
    from engine.managers.tokenizer_manager import RequestError

    with pytest.raises(RequestError, match="temperature"):
        engine.generate("x", {"temperature": -1})
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate(input_ids=[999999])
    with pytest.raises(RequestError, match="unknown sampling parameter 'max_tokens'.*max_new_tokens"):
        engine.generate("x", {"max_tokens": 3})


def test_server_info_reports_no_leak(engine: Engine) -> None:
    info = engine.get_server_info()
    assert info["kv_used_tokens"] == 0 and info["num_running_reqs"] == 0
    assert info["kv_free_tokens"] + info["kv_evictable_tokens"] == info["max_total_num_tokens"]


def test_shutdown_leaves_no_processes_or_sockets(llama_ckpt: str) -> None:
    eng = Engine(model_path=llama_ckpt, max_total_tokens=1024)
    pids = [p.pid for p in eng.runtime.processes]
    ipc_dir = eng.runtime.ipc.directory
    assert oct(os.stat(ipc_dir).st_mode & 0o777) == "0o700"
    eng.generate("hi", {"max_new_tokens": 2})
    eng.shutdown()
    time.sleep(0.2)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not os.path.exists(ipc_dir)


def test_killed_scheduler_fails_pending_fast(llama_ckpt: str) -> None:
    from engine.managers.tokenizer_manager import EngineDeadError

    eng = Engine(model_path=llama_ckpt, max_total_tokens=2048)
    try:
        sched = eng.runtime.processes[0]
        # A long generation is in flight when the scheduler dies.
        it = eng.generate("count", {"max_new_tokens": 1000, "ignore_eos": True}, stream=True)
        next(it)
        os.kill(sched.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="scheduler"):
            for _ in it:
                pass
        assert time.monotonic() - start < 3.0
        with pytest.raises(EngineDeadError):
            eng.generate("again", {"max_new_tokens": 2})
    finally:
        eng.shutdown()
