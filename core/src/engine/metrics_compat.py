"""SGLang's and vLLM's metric names beside the engine's own (``--metrics-compat``).

Grafana dashboards built for SGLang (``sglang:*``) or vLLM (``vllm:*``) query these series
by name, with a ``model_name`` label, and their histogram panels assume those projects' bucket
layouts, so the histograms here are observed separately with those layouts rather than renamed
copies of the ``engine_*`` ones. They are fed by the same two calls as ``ServerMetrics``: one per
finished request and one per scheduler ``server_info`` reply.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Accepted values of ``--metrics-compat``.
COMPAT_CHOICES = ("none", "sglang", "vllm", "all")

# SGLang's bucket layouts (python/sglang/srt/metrics/collector.py), seconds.
SGLANG_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                       7.5, 10.0, 15.0, 20.0, 25.0, 30.0)
SGLANG_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
SGLANG_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                       0.5, 0.75, 1.0, 2.5)
# vLLM's (vllm/v1/metrics/loggers.py), seconds.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_count_buckets(max_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 layout for token-count histograms: 1, 2, 5, 10, 20, 50, ... up to ``max_len``."""
    out: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            value = step * scale
            if value > max_len:
                return tuple(out) if out else (1.0,)
            out.append(float(value))
        scale *= 10


def first_token_time(state: Any) -> float | None:
    """When a request's first token was sampled: the scheduler's ``first_token`` stage
    (``engine.managers.timeline``), else when the tokenizer manager received it. A request that
    does not stream receives all its tokens at the end, so only the stage tells its TTFT."""
    for name, t, _ in state.meta.get("stages") or ():
        if name == "first_token":
            return min(float(t), state.first_token_time) if state.first_token_time is not None else float(t)
    return state.first_token_time


def request_phases(state: Any) -> dict[str, float]:
    """Seconds a finished request spent queued, prefilling, decoding and running in all, from the
    scheduler's stage times (``meta["stages"]``) and the tokenizer manager's token times; a phase
    whose ends are unknown is left out."""
    stages = state.meta.get("stages") or []
    scheduled = next((t for name, t, _ in stages if name == "scheduled"), None)
    queued = next((t for name, t, _ in stages if name == "queued"), state.created)
    first, last = first_token_time(state), state.last_time
    out: dict[str, float] = {}
    if scheduled is not None:
        out["queue"] = max(0.0, scheduled - queued)
        if first is not None:
            out["prefill"] = max(0.0, first - scheduled)
        if last is not None:
            out["inference"] = max(0.0, last - scheduled)
    if first is not None and last is not None:
        out["decode"] = max(0.0, last - first)
    return out


class CompatMetrics:
    """The ``sglang:*`` and/or ``vllm:*`` series in ``registry`` (``flavour``: sglang, vllm or all)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, flavour: str, max_model_len: int = 1 << 17) -> None:
        if flavour not in COMPAT_CHOICES or flavour == "none":
            raise ValueError(f"metrics_compat: invalid value {flavour!r}; accepted: sglang, vllm, all")
        self.model_name = model_name
        self.sglang = flavour in ("sglang", "all")
        self.vllm = flavour in ("vllm", "all")
        r, labels = registry, ["model_name"]
        self._last_decode: tuple[float, float] | None = None  # (decode_rows, wall time) of the last reply
        self._retractions = 0
        if self.sglang:
            self.s_prompt = Counter("sglang:prompt_tokens", "Number of prefill tokens processed", labels, registry=r)
            self.s_gen = Counter("sglang:generation_tokens", "Number of generation tokens processed", labels, registry=r)
            self.s_cached = Counter("sglang:cached_tokens", "Number of cached prompt tokens", labels, registry=r)
            self.s_requests = Counter("sglang:num_requests", "Number of finished requests", labels, registry=r)
            self.s_ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token in seconds", labels,
                                    buckets=SGLANG_TTFT_BUCKETS, registry=r)
            self.s_e2e = Histogram("sglang:e2e_request_latency_seconds", "End-to-end request latency in seconds",
                                   labels, buckets=SGLANG_E2E_BUCKETS, registry=r)
            self.s_tpot = Histogram("sglang:time_per_output_token_seconds", "Time per output token in seconds",
                                    labels, buckets=SGLANG_TPOT_BUCKETS, registry=r)
            self.s_itl = Histogram("sglang:inter_token_latency_seconds", "Inter-token latency in seconds "
                                   "(one observation per request: its mean)", labels, buckets=SGLANG_TPOT_BUCKETS,
                                   registry=r)
            self.s_running = Gauge("sglang:num_running_reqs", "The number of running requests", labels, registry=r)
            self.s_queue = Gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue", labels,
                                 registry=r)
            self.s_grammar = Gauge("sglang:num_grammar_queue_reqs", "The number of requests waiting for their "
                                   "grammar to compile", labels, registry=r)
            self.s_used = Gauge("sglang:num_used_tokens", "The number of used KV tokens", labels, registry=r)
            self.s_usage = Gauge("sglang:token_usage", "The KV token usage (0..1)", labels, registry=r)
            self.s_max = Gauge("sglang:max_total_num_tokens", "KV pool size in tokens", labels, registry=r)
            self.s_gen_tp = Gauge("sglang:gen_throughput", "The generate throughput (token/s) since the previous "
                                  "scrape", labels, registry=r)
            self.s_hit = Gauge("sglang:cache_hit_rate", "The prefix cache hit rate (cached / prompt tokens)", labels,
                               registry=r)
        if self.vllm:
            self.v_prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed", labels, registry=r)
            self.v_gen = Counter("vllm:generation_tokens", "Number of generation tokens processed", labels, registry=r)
            self.v_success = Counter("vllm:request_success", "Count of successfully processed requests",
                                     [*labels, "finished_reason"], registry=r)
            self.v_preempt = Counter("vllm:num_preemptions", "Cumulative number of preemptions", labels, registry=r)
            self.v_pc_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens",
                                        labels, registry=r)
            self.v_pc_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens", labels,
                                     registry=r)
            self.v_running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches",
                                   labels, registry=r)
            self.v_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed", labels,
                                   registry=r)
            self.v_kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent usage", labels,
                              registry=r)
            self.v_gpu_kv = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (the older name); 1 means 100 "
                                  "percent usage", labels, registry=r)
            self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds", labels,
                                    buckets=VLLM_TTFT_BUCKETS, registry=r)
            self.v_tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token in seconds",
                                    labels, buckets=VLLM_TPOT_BUCKETS, registry=r)
            self.v_itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds (one "
                                   "observation per request: its mean)", labels, buckets=VLLM_TPOT_BUCKETS, registry=r)
            self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "End to end request latency in seconds",
                                   labels, buckets=VLLM_REQUEST_BUCKETS, registry=r)
            self.v_phase = {phase: Histogram(f"vllm:request_{phase}_time_seconds", f"Time spent in the {word} "
                                             "phase of a request", labels, buckets=VLLM_REQUEST_BUCKETS, registry=r)
                            for phase, word in (("queue", "WAITING"), ("prefill", "PREFILL"), ("decode", "DECODE"),
                                                ("inference", "RUNNING"))}
            tokens = token_count_buckets(max_model_len)
            self.v_req_prompt = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens per request",
                                          labels, buckets=tokens, registry=r)
            self.v_req_gen = Histogram("vllm:request_generation_tokens", "Number of generation tokens per request",
                                       labels, buckets=tokens, registry=r)
            self.v_req_max_gen = Histogram("vllm:request_max_num_generation_tokens", "Maximum generation tokens "
                                           "of a request's sequences", labels, buckets=tokens, registry=r)

    def observe_finished(self, state: Any, prompt: int, completion: int, cached: int, hit_rate: float | None) -> None:
        """One finished request (``ServerMetrics.observe_finished`` has read its counts)."""
        name = self.model_name
        ttft = e2e = tpot = None
        first = first_token_time(state)
        if first is not None:
            ttft = first - state.created
            if state.last_time is not None and completion > 1:
                tpot = (state.last_time - first) / (completion - 1)
        end = state.last_time if state.last_time is not None else state.first_token_time
        if end is not None:
            e2e = end - state.created
        if self.sglang:
            self.s_prompt.labels(name).inc(prompt)
            self.s_gen.labels(name).inc(completion)
            self.s_cached.labels(name).inc(cached)
            self.s_requests.labels(name).inc()
            if hit_rate is not None:
                self.s_hit.labels(name).set(hit_rate)
            for hist, value in ((self.s_ttft, ttft), (self.s_e2e, e2e), (self.s_tpot, tpot), (self.s_itl, tpot)):
                if value is not None:
                    hist.labels(name).observe(value)
        if self.vllm:
            self.v_prompt.labels(name).inc(prompt)
            self.v_gen.labels(name).inc(completion)
            self.v_pc_queries.labels(name).inc(prompt)
            self.v_pc_hits.labels(name).inc(cached)
            reason = (state.finished_reason or {}).get("type", "unknown")
            self.v_success.labels(name, reason).inc()
            for hist, value in ((self.v_ttft, ttft), (self.v_e2e, e2e), (self.v_tpot, tpot), (self.v_itl, tpot)):
                if value is not None:
                    hist.labels(name).observe(value)
            for phase, seconds in request_phases(state).items():
                self.v_phase[phase].labels(name).observe(seconds)
            self.v_req_prompt.labels(name).observe(prompt)
            self.v_req_gen.labels(name).observe(completion)
            self.v_req_max_gen.labels(name).observe(completion)

    def update_from_server_info(self, info: dict[str, Any]) -> None:
        name = self.model_name
        running, waiting = info.get("num_running_reqs", 0), info.get("num_waiting_reqs", 0)
        usage = info.get("kv_usage", 0.0)
        if self.sglang:
            self.s_running.labels(name).set(running)
            self.s_queue.labels(name).set(waiting)
            self.s_grammar.labels(name).set(info.get("num_grammar_queue_reqs", 0))
            self.s_used.labels(name).set(info.get("kv_used_tokens", 0))
            self.s_usage.labels(name).set(usage)
            self.s_max.labels(name).set(info.get("max_total_num_tokens", 0))
            now, rows = time.monotonic(), float(info.get("decode_rows", 0))
            if self._last_decode is not None and now > self._last_decode[1]:
                self.s_gen_tp.labels(name).set(max(0.0, rows - self._last_decode[0]) / (now - self._last_decode[1]))
            self._last_decode = (rows, now)
        if self.vllm:
            self.v_running.labels(name).set(running)
            self.v_waiting.labels(name).set(waiting)
            self.v_kv.labels(name).set(usage)
            self.v_gpu_kv.labels(name).set(usage)
            retractions = int(info.get("num_retractions", 0))
            if retractions > self._retractions:
                self.v_preempt.labels(name).inc(retractions - self._retractions)
                self._retractions = retractions
