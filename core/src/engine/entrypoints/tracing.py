"""OpenTelemetry traces of requests (``--otlp-traces-endpoint``), exported over OTLP/HTTP.

One trace per finished request: a root span ``engine.request`` from arrival to the last token
carrying the request id, the model and the token counts, with child spans for its phases
(``queue``, ``grammar``, ``prefill``, ``decode``; a retracted request has one ``queue`` span per
wait) and one span event per stage of the live view's timeline (``engine.managers.timeline``:
queued, grammar, scheduled, prefill_chunk with its tokens, retracted; then first_token and
finished). Spans are built after the request finished, from the times the scheduler and the
tokenizer manager recorded, so tracing adds nothing to a request's path; the SDK's batch
processor exports them from its own thread. This module is imported only when the flag is set.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlparse

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context

from engine.metrics_compat import first_token_time
from engine.version import __version__

SERVICE_NAME = "engine"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: ``endpoint`` itself, or ``endpoint/v1/traces`` when it names no path."""
    parsed = urlparse(endpoint)
    if parsed.path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def phases(stages: list[tuple[str, float, int]], created: float, first: float | None,
           end: float) -> list[tuple[str, float, float]]:
    """``(phase, start, end)`` spans from a request's stages: waiting (``queue``) from arrival or
    a retraction until it is scheduled, ``grammar`` while its grammar compiles, ``prefill`` from
    being scheduled to its first token (or the next retraction), ``decode`` after."""
    out: list[tuple[str, float, float]] = []
    open_name, open_at = "queue", created
    for name, t, _ in stages:
        if name == "grammar" and open_name == "queue":
            out.append(("queue", open_at, t))
            open_name, open_at = "grammar", t
        elif name == "queued" and open_name == "grammar":
            out.append(("grammar", open_at, t))
            open_name, open_at = "queue", t
        elif name == "scheduled" and open_name == "queue":
            out.append(("queue", open_at, t))
            open_name, open_at = "prefill", t
        elif name == "retracted" and open_name in ("prefill", "decode"):
            out.append((open_name, open_at, t))
            open_name, open_at = "queue", t
    if open_name == "prefill" and first is not None and first >= open_at:
        out.append(("prefill", open_at, first))
        open_name, open_at = "decode", first
    out.append((open_name, open_at, max(end, open_at)))
    return [p for p in out if p[2] >= p[1]]


class RequestTracer:
    """Turns finished requests (tokenizer manager ``ReqState``) into exported spans."""

    def __init__(self, endpoint: str, model_name: str, exporter: SpanExporter | None = None) -> None:
        resource = Resource.create({"service.name": SERVICE_NAME, "service.version": __version__})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(endpoint=traces_url(endpoint))))
        # A private provider: the process-wide one stays whatever the application set.
        self.tracer = self.provider.get_tracer("engine.requests", __version__)
        self.model_name = model_name

    def observe_finished(self, state: Any) -> None:
        # perf_counter seconds -> Unix nanoseconds (the offset is read now: both clocks are steady
        # over a request's life).
        offset = time.time_ns() - time.perf_counter_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        meta = state.meta
        stages = [tuple(s) for s in meta.get("stages") or []]
        end = state.last_time if state.last_time is not None else time.perf_counter()
        reason = (state.finished_reason or {}).get("type", "unknown")
        root = self.tracer.start_span("engine.request", kind=SpanKind.SERVER, start_time=ns(state.created), attributes={
            "engine.request_id": state.rid, "gen_ai.operation.name": "generate", "gen_ai.request.model": self.model_name,
            "gen_ai.usage.input_tokens": int(meta.get("prompt_tokens", len(state.prompt_ids))),
            "gen_ai.usage.output_tokens": int(meta.get("completion_tokens", len(state.output_ids))),
            "engine.cached_tokens": int(meta.get("cached_tokens", 0)), "engine.finish_reason": reason})
        root.add_event("arrived", timestamp=ns(state.created))
        for name, t, tokens in stages:
            root.add_event(str(name), {"tokens": int(tokens)}, timestamp=ns(float(t)))
        first = first_token_time(state)
        if first is not None:
            if not any(name == "first_token" for name, _, _ in stages):
                root.add_event("first_token", timestamp=ns(first))
            root.set_attribute("engine.time_to_first_token_s", first - state.created)
        root.add_event("finished", {"finish_reason": reason}, timestamp=ns(end))
        parent = set_span_in_context(root)
        for phase, start, stop in phases(stages, state.created, first, end):  # type: ignore[arg-type]
            span = self.tracer.start_span(phase, context=parent, start_time=ns(start),
                                          attributes={"engine.request_id": state.rid})
            if phase == "prefill":
                for name, t, tokens in stages:
                    if name == "prefill_chunk" and start <= t <= stop:
                        span.add_event("prefill_chunk", {"tokens": int(tokens)}, timestamp=ns(float(t)))
            span.end(end_time=ns(stop))
        root.end(end_time=ns(end))

    def shutdown(self) -> None:
        """Exports what is queued and stops the exporter thread."""
        self.provider.shutdown()
