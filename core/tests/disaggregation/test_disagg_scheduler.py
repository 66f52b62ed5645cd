"""Prefill/decode disaggregation in-process: a prefill and a decode Scheduler in this process,
talking over the zmq transfer backend (no HTTP server, no router; tests/test_disaggregation_e2e.py
runs those)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engine.config import ServerArgs
from engine.errors import EngineError
from engine.managers.scheduler import check_no_leak
from engine.ports import free_port
from engine.testing.harness import OutputCollector, generate_greedy, make_scheduler, submit

_GREEDY = {"max_new_tokens": 9, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(llama_ckpt: str) -> Iterator[tuple[Any, Any]]:
    # Different page sizes on the two sides (tokens travel one by one), chunked prompts on the prefill side.
    prefill = make_scheduler(llama_ckpt, disaggregation_mode="prefill", disaggregation_bootstrap_port=free_port(),
                             page_size=4, chunked_prefill_size=16)
    # A generous time-out: on a loaded machine the in-process prefill of all prompts takes seconds.
    decode = make_scheduler(llama_ckpt, disaggregation_mode="decode", disaggregation_timeout_s=60.0)
    yield prefill, decode
    prefill.close_disaggregation()
    decode.close_disaggregation()


def _port(prefill: Any) -> int:
    return prefill.kv_transfer.port


class _StageCollector(OutputCollector):
    """Also keeps each finished request's stages (managers/timeline.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.stages: dict[str, list[Any]] = {}

    def collect(self, scheduler: Any) -> None:
        original = scheduler.take_outputs

        def take() -> list[Any]:
            msgs = original()
            for msg in msgs:
                for i, rid in enumerate(msg.rids):
                    if msg.stages is not None and msg.stages[i] is not None:
                        self.stages[rid] = msg.stages[i]
            return msgs
        scheduler.take_outputs = take
        try:
            super().collect(scheduler)
        finally:
            del scheduler.take_outputs


def _run(schedulers: list[Any], rids: list[str], timeout_s: float = 30.0) -> _StageCollector:
    col = _StageCollector()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(r in col.finish for r in rids):
        for s in schedulers:
            s.step()
        col.collect(schedulers[-1])
        for s in schedulers[:-1]:
            s.take_outputs()
    assert all(r in col.finish for r in rids), f"unfinished after {timeout_s} s: {set(rids) - set(col.finish)}"
    return col


def _submit_pair(prefill: Any, decode: Any, prompt: list[int], rid: str, room: int, **params: Any) -> None:
    sp = {**_GREEDY, **params}
    submit(prefill, prompt, sp, rid=rid, bootstrap_room=room)
    submit(decode, prompt, sp, rid=rid, bootstrap_room=room, bootstrap_host="127.0.0.1", bootstrap_port=_port(prefill))


def test_greedy_output_equals_a_whole_server(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    prompts = [[7 + i, 20 + 3 * i, 5, 9 + i, 11] * (1 + 4 * (i % 3)) for i in range(6)]  # up to 45 tokens: chunked
    want = generate_greedy(decode, prompts, _GREEDY["max_new_tokens"], ignore_eos=True)  # no room: runs whole
    rids = [f"pair-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts, strict=True):
        _submit_pair(prefill, decode, prompt, rid, room=7)
    col = _run([prefill, decode], rids)
    assert [col.ids[r] for r in rids] == want
    assert all(col.finish[r]["type"] == "length" for r in rids)
    stats = decode.stats()["disaggregation"]
    assert stats["transferred"] >= len(prompts) and stats["failed"] == 0 and stats["waiting_for_kv"] == 0
    # Each request's transfer, on both sides; the decode side's TTFT stage is the handover.
    sent = {row["rid"]: row for row in prefill.stats()["disaggregation"]["recent"]}
    got = {row["rid"]: row for row in stats["recent"]}
    for rid, prompt in zip(rids, prompts, strict=True):
        assert got[rid]["bytes"] == sent[rid]["bytes"] > 0 and got[rid]["tokens"] == len(prompt)
        assert got[rid]["wait_s"] > 0 and got[rid]["transfer_s"] >= 0 and got[rid]["write_s"] >= 0
        assert sent[rid]["stage_s"] >= 0 and "copy_s" in sent[rid]
        names = [name for name, _, _ in col.stages[rid]]
        assert names.index("scheduled") <= names.index("kv_fetch") < names.index("kv_arrived") < names.index("first_token")
        assert names.count("first_token") == 1 and "prefill_chunk" not in names
    prefill.flush_cache()
    decode.flush_cache()
    check_no_leak(prefill)
    check_no_leak(decode)


def test_torch_distributed_backend_gives_the_same_output(pair: tuple[Any, Any]) -> None:
    """The torch backend (gloo here) in place of zmq on both schedulers, for a few prompts."""
    from engine_kvtransfer_torch.backend import TorchKvTransfer

    prefill, decode = pair
    saved = prefill.kv_transfer, decode.kv_transfer
    # Each backend is told the name it is selected by: the handshake refuses two different ones.
    assert saved[0].ctx.backend == saved[1].ctx.backend == "zmq"
    prefill.kv_transfer = TorchKvTransfer(dataclasses.replace(saved[0].ctx, port=0, backend="torch"))
    decode.kv_transfer = TorchKvTransfer(dataclasses.replace(saved[1].ctx, backend="torch"))
    try:
        prompts = [[11 + i, 4, 40 + i, 8] * (1 + 3 * i) for i in range(3)]
        want = generate_greedy(decode, prompts, _GREEDY["max_new_tokens"], ignore_eos=True)
        rids = [f"torch-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(rids, prompts, strict=True):
            _submit_pair(prefill, decode, prompt, rid, room=13)
        col = _run([prefill, decode], rids)
        assert [col.ids[r] for r in rids] == want
        assert decode.kv_transfer.stats()["fetched"] == len(prompts)
    finally:
        prefill.kv_transfer.close()
        decode.kv_transfer.close()
        prefill.kv_transfer, decode.kv_transfer = saved


def test_a_full_decode_pool_waits_and_retracts_with_the_same_output(pair: tuple[Any, Any], llama_ckpt: str) -> None:
    """A decode pool too small for every arrived request at once: KV waits in host memory for
    slots, running requests are retracted (and recompute locally), and the output is unchanged."""
    prefill, _ = pair
    small = make_scheduler(llama_ckpt, disaggregation_mode="decode", max_total_tokens=160)
    try:
        prompts = [[7 + i, 20 + 3 * i, 5, 9 + i, 11] * 8 for i in range(5)]
        want = generate_greedy(small, prompts, 32, ignore_eos=True)
        rids = [f"small-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(rids, prompts, strict=True):
            _submit_pair(prefill, small, prompt, rid, room=14, max_new_tokens=32)
        col = _run([prefill, small], rids, timeout_s=60)
        assert [col.ids[r] for r in rids] == want
        assert small.num_retractions > 0, "the pool was meant to be too small for all five at once"
        small.flush_cache()
        check_no_leak(small)
    finally:
        small.close_disaggregation()


def test_a_stop_token_from_the_prefill_side_ends_the_request(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    prompt = [3, 30, 300, 4, 40]
    (first,) = generate_greedy(decode, [prompt], 1)
    _submit_pair(prefill, decode, prompt, "stop-first", room=8, stop_token_ids=[first[0]], ignore_eos=False)
    col = _run([prefill, decode], ["stop-first"])
    assert col.ids["stop-first"] == first and col.finish["stop-first"] == {"type": "stop", "matched": first[0]}


def test_abort_while_waiting_for_kv_frees_everything(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    submit(decode, [5, 6, 7, 8], _GREEDY, rid="orphan", bootstrap_room=9, bootstrap_host="127.0.0.1",
           bootstrap_port=_port(prefill))
    for _ in range(3):
        decode.step()
    assert decode.stats()["disaggregation"]["waiting_for_kv"] == 1
    decode.abort_request("orphan", "aborted by request")
    col = _run([decode], ["orphan"], timeout_s=5)
    assert col.finish["orphan"]["type"] == "abort"
    assert decode.stats()["disaggregation"]["waiting_for_kv"] == 0 and not decode.has_work()
    decode.flush_cache()
    check_no_leak(decode)


def test_kv_that_never_comes_times_out_with_the_reason(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    started = time.monotonic()
    decode.args.disaggregation_timeout_s = 2.0  # read when the fetch starts
    try:
        submit(decode, [5, 6, 7], _GREEDY, rid="lost", bootstrap_room=10, bootstrap_host="127.0.0.1",
               bootstrap_port=_port(prefill))
        col = _run([decode], ["lost"], timeout_s=15)
    finally:
        decode.args.disaggregation_timeout_s = 60.0
    assert 1.5 < time.monotonic() - started < 10
    assert col.finish["lost"]["type"] == "abort" and "KV transfer failed" in col.finish["lost"]["message"]
    decode.flush_cache()
    check_no_leak(decode)


def test_a_layout_mismatch_fails_naming_it(pair: tuple[Any, Any]) -> None:
    import torch
    from engine_kvtransfer_zmq.backend import ZmqKvTransfer

    from engine.disaggregation import KvLayout, KvPayload, KvTransferContext, transfer_key

    _, decode = pair
    theirs = KvLayout(num_layers=2, num_kv_heads=7, head_dim=16, v_head_dim=16, dtype="torch.float32")
    other = ZmqKvTransfer(KvTransferContext(role="prefill", layout=theirs, port=0))
    try:
        other.publish(transfer_key(11, "odd"), KvPayload(1, torch.zeros(2, 3, 7, 16), torch.zeros(2, 3, 7, 16)))
        submit(decode, [5, 6, 7], _GREEDY, rid="odd", bootstrap_room=11, bootstrap_host="127.0.0.1", bootstrap_port=other.port)
        col = _run([decode], ["odd"], timeout_s=10)
    finally:
        other.close()
    message = col.finish["odd"]["message"]
    assert "KV layouts differ" in message and "num_kv_heads" in message, message


def _logprobs(schedulers: list[Any], rid: str, timeout_s: float = 30.0) -> dict[str, list[Any]]:
    """Steps the schedulers until ``rid`` ends on the last one; its logprob fields, concatenated."""
    got: dict[str, list[Any]] = {"output_token_logprobs": [], "output_top_logprobs": [], "input_token_logprobs": []}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for s in schedulers:
            s.step()
        for s in schedulers[:-1]:
            s.take_outputs()
        for msg in schedulers[-1].take_outputs():
            for i, r in enumerate(msg.rids):
                if r != rid:
                    continue
                got["output_token_logprobs"] += msg.output_token_logprobs[i]
                got["output_top_logprobs"] += msg.output_top_logprobs[i]
                got["input_token_logprobs"] += msg.input_token_logprobs[i] or []
                if msg.finished_reasons[i] is not None:
                    return got
    raise AssertionError(f"{rid} did not finish in {timeout_s} s")


def test_logprobs_of_prompt_and_output_equal_a_whole_server(pair: tuple[Any, Any]) -> None:
    prefill, decode = pair
    prompt, kw = [21, 22, 23, 24, 25, 26, 27], {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    submit(decode, prompt, _GREEDY, rid="lp-whole", **kw)
    want = _logprobs([decode], "lp-whole")
    submit(prefill, prompt, _GREEDY, rid="lp", bootstrap_room=12, **kw)
    submit(decode, prompt, _GREEDY, rid="lp", bootstrap_room=12, bootstrap_host="127.0.0.1",
           bootstrap_port=_port(prefill), **kw)
    got = _logprobs([prefill, decode], "lp")
    assert len(got["output_token_logprobs"]) == _GREEDY["max_new_tokens"] and len(got["input_token_logprobs"]) == len(prompt)
    for field in want:
        for a, b in zip(got[field], want[field], strict=True):
            assert _close(a, b), (field, a, b)


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < 1e-4
    return a == b


@pytest.mark.parametrize("values, needle", [
    ({"tp_size": 2}, "--tp-size 2"),
    ({"dp_size": 2}, "--dp-size 2"),
    ({"disaggregation_bootstrap_port": 30000}, "--disaggregation-bootstrap-port"),
    ({"disaggregation_transfer_backend": "carrier-pigeon"}, "--disaggregation-transfer-backend"),
    ({"disaggregation_timeout_s": 0}, "--disaggregation-timeout-s"),
    ({"speculative_algorithm": "ngram"}, "--speculative-algorithm ngram"),
])
def test_config_refusals_name_the_flag(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(EngineError, match=needle.replace("-", r"\-")):
        ServerArgs.from_dict({"disaggregation_mode": "decode", **values})


def test_router_cli_refuses_bad_urls_with_status_2() -> None:
    from typer.testing import CliRunner

    from engine.cli import app

    runner = CliRunner()
    missing = runner.invoke(app, ["router", "--prefill", "http://127.0.0.1:1"])
    assert missing.exit_code == 2 and "--decode" in missing.output
    bad = runner.invoke(app, ["router", "--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2"])
    assert bad.exit_code == 2 and "--prefill: invalid value '127.0.0.1:1'" in bad.output
    nobody = runner.invoke(app, ["router", "--prefill", f"http://127.0.0.1:{free_port()}",
                                 "--decode", "http://127.0.0.1:2", "--wait-s", "0"])
    assert nobody.exit_code == 2 and "--prefill http://127.0.0.1:" in nobody.output and "no answer" in nobody.output
