"""Prometheus metrics of the HTTP server (``GET /metrics``).

Counters and latency histograms are fed by the tokenizer manager's ``on_finish``
callback, one call per finished request; the gauges (running and queued
requests, KV use) are refreshed from the scheduler's ``server_info`` reply on
each scrape. Everything lives in the server's own ``CollectorRegistry`` so
several servers (or tests) in one process never collide.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.metrics_compat import CompatMetrics, first_token_time

PREFIX = "engine_"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds; CPU test models sit at the low end, large models on busy GPUs at the high end.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The server's metrics; ``observe_finished`` per request, ``update_from_server_info`` per scrape."""

    def __init__(self, model_name: str, compat: str = "none", max_model_len: int = 1 << 17) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests", labels, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Generated tokens of finished requests",
                                         labels, registry=r)
        self.cached_tokens = Counter(f"{PREFIX}cached_tokens", "Prompt tokens served from the prefix cache",
                                     labels, registry=r)
        self.requests = Counter(f"{PREFIX}requests", "Finished requests by finish reason",
                                [*labels, "finish_reason"], registry=r)
        self.lora_requests = Counter(f"{PREFIX}lora_requests", "Finished requests that ran with a LoRA adapter, "
                                     "by adapter name", [*labels, "lora_name"], registry=r)
        self.running = Gauge(f"{PREFIX}num_running_reqs", "Requests being decoded or prefilled", labels, registry=r)
        self.queued = Gauge(f"{PREFIX}num_queue_reqs", "Requests waiting in the scheduler's queue", labels,
                            registry=r)
        self.kv_usage = Gauge(f"{PREFIX}kv_cache_usage", "Fraction of the KV pool held by running requests",
                              labels, registry=r)
        self.kv_used = Gauge(f"{PREFIX}kv_used_tokens", "KV slots held by running requests", labels, registry=r)
        self.kv_total = Gauge(f"{PREFIX}kv_total_tokens", "KV pool size in tokens", labels, registry=r)
        self.kv_evictable = Gauge(f"{PREFIX}kv_evictable_tokens", "KV slots held only by the prefix cache",
                                  labels, registry=r)
        self.cache_hit_rate = Gauge(f"{PREFIX}cache_hit_rate",
                                    "Cached prompt tokens / prompt tokens, over all finished requests",
                                    labels, registry=r)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds",
                             "Mean time between output tokens, one observation per request", labels,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Request latency, arrival to last token",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        # Data parallelism (--dp-size > 1): the router's decisions and each replica's load.
        replica = [*labels, "replica"]
        self.router_requests = Counter(f"{PREFIX}router_requests",
                                       "Requests routed to each data-parallel replica, by the router policy's reason "
                                       "(cache_hit: its cached prefixes matched the prompt)",
                                       [*replica, "reason"], registry=r)
        self.router_in_flight = Gauge(f"{PREFIX}router_in_flight_requests",
                                      "Requests routed to the replica and not finished", replica, registry=r)
        self.replica_running = Gauge(f"{PREFIX}replica_num_running_reqs", "Requests the replica is decoding or prefilling",
                                     replica, registry=r)
        self.replica_queued = Gauge(f"{PREFIX}replica_num_queue_reqs", "Requests waiting in the replica's queue",
                                    replica, registry=r)
        self.replica_kv_usage = Gauge(f"{PREFIX}replica_kv_cache_usage",
                                      "Fraction of the replica's KV pool held by running requests", replica, registry=r)
        # Speculative decoding: tokens a request gained per verify forward (1.0: no gain).
        self.spec_accept_length = Histogram(
            f"{PREFIX}spec_accept_length", "Speculative decoding: mean tokens per verify forward, one observation "
            "per finished request that took part in one", labels,
            buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0), registry=r)
        self.spec_server_accept_length = Gauge(
            f"{PREFIX}spec_mean_accept_length", "Speculative decoding: tokens per request and verify step, "
            "over the scheduler's life", labels, registry=r)
        self.spec_steps = Gauge(
            f"{PREFIX}spec_steps", "Speculative decoding: decode steps over the scheduler's life, by kind "
            "(verify: drafts verified; tree: those with a tree draft; fallback: decoded without drafts)",
            [*labels, "kind"], registry=r)
        # --enable-hierarchical-cache (docs/kv_cache.md): counts over the scheduler's life.
        self.hicache_hit_tokens = Gauge(
            f"{PREFIX}hicache_hit_tokens", "Hierarchical cache: prompt tokens found at admission, by tier "
            "(device: in the KV pool; host: loaded back from the storage tier)", [*labels, "tier"], registry=r)
        self.hicache_hit_rate = Gauge(
            f"{PREFIX}hicache_hit_rate", "Hierarchical cache: hit tokens / prompt tokens looked up, by tier",
            [*labels, "tier"], registry=r)
        self.hicache_bytes = Gauge(
            f"{PREFIX}hicache_bytes_moved", "Hierarchical cache: KV bytes copied, by direction (to_tier: "
            "written to the storage tier; to_device: loaded back)", [*labels, "direction"], registry=r)
        self.hicache_tier_tokens = Gauge(f"{PREFIX}hicache_tier_tokens", "Tokens held in the storage tier",
                                         labels, registry=r)
        self.model_name = model_name
        self._prompt_total = 0
        self._cached_total = 0
        # --metrics-compat: SGLang's and/or vLLM's names, for their published Grafana dashboards.
        self.compat: CompatMetrics | None = None
        if compat != "none":
            self.compat = CompatMetrics(r, model_name, compat, max_model_len)

    def observe_finished(self, state: Any) -> None:
        """Records one finished request (a tokenizer manager ``ReqState``)."""
        name = self.model_name
        meta = state.meta
        prompt = int(meta.get("prompt_tokens", len(state.prompt_ids)))
        completion = int(meta.get("completion_tokens", len(state.output_ids)))
        cached = int(meta.get("cached_tokens", 0))
        self.prompt_tokens.labels(name).inc(prompt)
        self.generation_tokens.labels(name).inc(completion)
        self.cached_tokens.labels(name).inc(cached)
        reason = (state.finished_reason or {}).get("type", "unknown")
        self.requests.labels(name, reason).inc()
        if meta.get("lora_name"):
            self.lora_requests.labels(name, meta["lora_name"]).inc()
        self._prompt_total += prompt
        self._cached_total += cached
        hit_rate = self._cached_total / self._prompt_total if self._prompt_total else None
        if hit_rate is not None:
            self.cache_hit_rate.labels(name).set(hit_rate)
        if self.compat is not None:
            self.compat.observe_finished(state, prompt, completion, cached, hit_rate)
        first = first_token_time(state)
        if first is not None:
            self.ttft.labels(name).observe(first - state.created)
            if state.last_time is not None and completion > 1:
                self.itl.labels(name).observe((state.last_time - first) / (completion - 1))
        end = state.last_time if state.last_time is not None else state.first_token_time
        if end is not None:
            self.e2e.labels(name).observe(end - state.created)
        verify = int(meta.get("spec_verify_ct", 0) or 0)
        if verify:
            self.spec_accept_length.labels(name).observe((int(meta.get("spec_accepted_tokens", 0)) + verify) / verify)

    def observe_route(self, rid: str, decision: Any) -> None:
        """Records one routing decision (a ``RouteDecision``; none are counted with one replica)."""
        if decision.reason != "single":
            self.router_requests.labels(self.model_name, str(decision.replica), decision.reason).inc()

    def update_router(self, router_stats: dict[str, Any]) -> None:
        """Refreshes the per-replica in-flight gauges from ``Router.stats()`` (several replicas only)."""
        if router_stats.get("dp_size", 1) > 1:
            for replica in router_stats["replicas"]:
                self.router_in_flight.labels(self.model_name, str(replica["index"])).set(replica["in_flight_requests"])

    def update_from_server_info(self, info: dict[str, Any]) -> None:
        """Refreshes the gauges from the scheduler's ``server_info`` control reply (summed over the
        replicas, with each replica's own numbers in ``dp_replicas``)."""
        name = self.model_name
        for i, replica in enumerate(info.get("dp_replicas") or []):
            self.replica_running.labels(name, str(i)).set(replica.get("num_running_reqs", 0))
            self.replica_queued.labels(name, str(i)).set(replica.get("num_waiting_reqs", 0))
            self.replica_kv_usage.labels(name, str(i)).set(replica.get("kv_usage", 0.0))
        self.running.labels(name).set(info.get("num_running_reqs", 0))
        self.queued.labels(name).set(info.get("num_waiting_reqs", 0))
        self.kv_usage.labels(name).set(info.get("kv_usage", 0.0))
        self.kv_used.labels(name).set(info.get("kv_used_tokens", 0))
        self.kv_total.labels(name).set(info.get("max_total_num_tokens", 0))
        self.kv_evictable.labels(name).set(info.get("kv_evictable_tokens", 0))
        if info.get("spec_verified_rows"):  # counts, so the ratio holds summed over replicas too
            self.spec_server_accept_length.labels(name).set(info["spec_emitted_tokens"] / info["spec_verified_rows"])
        if "spec_verify_steps" in info:
            for kind in ("verify", "tree", "fallback"):
                self.spec_steps.labels(name, kind).set(info.get(f"spec_{kind}_steps", 0))
        if "hicache_lookup_tokens" in info:
            self._update_hicache(info)
        if self.compat is not None:
            self.compat.update_from_server_info(info)

    def _update_hicache(self, info: dict[str, Any]) -> None:
        name = self.model_name
        lookups = max(info["hicache_lookup_tokens"], 1)  # rates from counts: sums over replicas stay right
        for tier in ("device", "host"):
            hits = info.get(f"hicache_{tier}_hit_tokens", 0)
            self.hicache_hit_tokens.labels(name, tier).set(hits)
            self.hicache_hit_rate.labels(name, tier).set(hits / lookups)
        self.hicache_bytes.labels(name, "to_tier").set(info.get("hicache_bytes_written", 0))
        self.hicache_bytes.labels(name, "to_device").set(info.get("hicache_bytes_loaded", 0))
        self.hicache_tier_tokens.labels(name).set(info.get("hicache_host_tokens", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
