"""Per-request stage times kept by the scheduler, for the live view and request tracing.

A request's ``stages`` is a list of ``(name, time, tokens)``: ``time`` is ``time.perf_counter()``
in the scheduler process (CLOCK_MONOTONIC on Linux, the same clock the tokenizer manager reads,
so the two processes' times compare), ``tokens`` what the stage handled. The names:

- ``queued``: the request entered the waiting queue (again after its grammar compiled);
- ``grammar``: its grammar started compiling (structured output);
- ``scheduled``: it was admitted to a prefill batch (again after a retraction); on a
  disaggregated decode server, its KV was asked of the prefill server (its prefill runs there);
- ``prefill_chunk``: a prefill forward over ``tokens`` of its prompt began;
- ``retracted``: it was taken off the running batch to free KV (it resumes later);
- ``first_token``: its first output token was sampled; on a disaggregated decode server, the
  prefill server's first token was handed over with the KV (TTFT counts from there);
- ``kv_fetch``, ``kv_arrived``: on a disaggregated decode server, its KV was asked of the prefill
  server, and it arrived (``tokens``: the prompt's).

The finished request's list rides on its last output message to the tokenizer manager, whose
own times are the arrival (``ReqState.created``) and the last token (``ReqState.last_time``).
"""

from __future__ import annotations

import time
from typing import Any

# A request retracted and resumed over and over must not grow its list without bound.
MAX_STAGES = 256


def mark(req: Any, name: str, tokens: int = 0, now: float | None = None) -> None:
    """Appends a stage to ``req.stages`` (the latest one replaces the last past ``MAX_STAGES``)."""
    entry = (name, time.perf_counter() if now is None else now, int(tokens))
    if len(req.stages) >= MAX_STAGES:
        req.stages[-1] = entry
    else:
        req.stages.append(entry)


def request_state(scheduler: Any, req: Any) -> str:
    """Where a request is now: grammar-compiling, queued, retracted, prefilling or decoding."""
    if req in scheduler.grammar_queue.waiting:
        return "grammar-compiling"
    if req in scheduler.waiting_queue:
        return "retracted" if req.retractions else "queued"
    if req is scheduler.chunked_req or req.is_chunked:
        return "prefilling"
    return "decoding"


def live_requests(scheduler: Any) -> dict[str, Any]:
    """The ``requests`` control reply: every request the scheduler holds, with its state, token
    counts and stages so far."""
    rows = []
    for req in list(scheduler.reqs.values()):
        if req.finished():
            continue
        rows.append({"rid": req.rid, "state": request_state(scheduler, req),
                     "prompt_tokens": len(req.origin_input_ids), "output_tokens": len(req.output_ids),
                     "cached_tokens": req.cached_tokens, "retractions": req.retractions,
                     "stages": list(req.stages)})
    return {"requests": rows, "decode_batch_size": len(scheduler.running_batch.reqs)}

