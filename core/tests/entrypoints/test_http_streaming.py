"""The streamed events' encoding and the tokenizer manager's hand-off to the streams.

/generate encodes a stream's cumulative ``output_ids`` incrementally and the OpenAI routes encode
a stream's chunk head once: both must give exactly ``sse``'s bytes. Messages the scheduler side
queued while the event loop was busy reach a stream as one output (one event), not one each.
The e2e streams (``tests/test_server_e2e*.py``) check the same through a real engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine.entrypoints.http.generation import ChunkSSE, sse
from engine.entrypoints.http.native import _IdsJSON, _sse_event
from engine.managers.io_struct import BatchStrOut, SchedulerReady, TokenizedGenerateReqInput
from engine.managers.tokenizer_manager import GenerateRequest, TokenizerManager


def test_generate_events_are_the_bytes_of_sse_of_the_whole_body() -> None:
    ids_json, ids, text = _IdsJSON(), [], ""
    for step in range(40):
        # one, two or no new ids an event (a held-back partial character brings none)
        ids = ids + [step * 7919 % 128256, step][: step % 3]
        text += "é \"q\"\n\u2028" if step % 5 == 0 else str(step)
        body = {"text": text, "output_ids": list(ids),
                "meta_info": {"id": "r1", "finish_reason": None if step < 39 else {"type": "length", "length": 40},
                              "e2e_latency": 0.1 * step, "output_token_logprobs": [[-0.5, 7, None]]},
                "index": 2}
        event = _sse_event(body, ids_json)
        assert event == sse(body), step
        assert json.loads(event[len(b"data: "):])["output_ids"] == ids
    assert _sse_event({"text": "", "output_ids": [], "meta_info": {}}, _IdsJSON()) == \
        sse({"text": "", "output_ids": [], "meta_info": {}})


def test_chunk_head_encoded_once_gives_the_same_bytes() -> None:
    head = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m/ü"}
    encode = ChunkSSE(head)
    for tail in ({"choices": []}, {"choices": [{"index": 0, "delta": {"content": "hé"}}], "usage": None},
                 {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}):
        assert encode(tail) == sse({**head, **tail})


def test_messages_queued_together_reach_a_stream_as_one_output(tmp_path: Path) -> None:
    import zmq

    ipc = SimpleNamespace(tokenizer=f"ipc://{tmp_path}/tok", replica_scheduler=lambda r: f"ipc://{tmp_path}/s{r}")
    args = SimpleNamespace(lora_enabled=False, lora_paths={}, dp_size=1, tokenizer_workers=0)
    ready = SchedulerReady(100, 8, 64, 32, "cpu", "torch_native", "cpu", "float32", [3], [])
    zctx = zmq.Context()
    scheduler, push = zctx.socket(zmq.PULL), zctx.socket(zmq.PUSH)
    scheduler.bind(ipc.replica_scheduler(0))

    def step(rid: str, k: int, last: bool) -> BatchStrOut:
        reason: dict[str, Any] | None = {"type": "length", "length": k + 1} if last else None
        return BatchStrOut([rid], [f"t{k}"], [[10 + k]], [reason], [2], [k + 1], [0])

    async def run() -> list[dict[str, Any]]:
        manager = TokenizerManager(args, "/m", ipc, ready, [], None)
        push.connect(ipc.tokenizer)
        outputs: list[dict[str, Any]] = []
        try:
            agen = manager.generate(GenerateRequest(input_ids=[1, 2], stream=True, rid="r",
                                                    sampling_params={"max_new_tokens": 4}))
            first = asyncio.ensure_future(agen.__anext__())
            while not scheduler.poll(0):
                await asyncio.sleep(0.01)
            assert isinstance(scheduler.recv_pyobj(), TokenizedGenerateReqInput)
            push.send_pyobj(step("r", 0, False))
            outputs.append(await first)  # one message: one output
            for k in range(1, 4):
                push.send_pyobj(step("r", k, k == 3))
            time.sleep(0.5)  # the event loop is held while the three arrive, as in a busy server
            outputs.extend([out async for out in agen])
        finally:
            await manager.close()
        return outputs

    try:
        outputs = asyncio.run(run())
    finally:
        scheduler.close(0)
        push.close(0)
        zctx.term()
    assert [out["output_ids"] for out in outputs] == [[10], [10, 11, 12, 13]]
    assert outputs[-1]["text"] == "t0t1t2t3"
    assert outputs[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
