"""``--metrics-compat``: the series SGLang's and vLLM's published Grafana dashboards query exist,
parse with prometheus_client's own text parser, carry ``model_name`` and the projects' bucket
layouts, and move with the requests and scheduler numbers fed in (no server, no model)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.managers.request_state import ReqState
from engine.metrics import ServerMetrics
from engine.metrics_compat import (
    SGLANG_E2E_BUCKETS,
    VLLM_TTFT_BUCKETS,
    request_phases,
    token_count_buckets,
)

# What examples/monitoring/grafana/dashboards/json/sglang-dashboard.json queries (SGLang).
SGLANG_DASHBOARD = ["sglang:e2e_request_latency_seconds", "sglang:time_to_first_token_seconds",
                    "sglang:num_running_reqs", "sglang:gen_throughput", "sglang:cache_hit_rate",
                    "sglang:num_queue_reqs"]
# Further series SGLang documents (docs/references/production_metrics.md).
SGLANG_DOCUMENTED = ["sglang:prompt_tokens", "sglang:generation_tokens", "sglang:token_usage",
                     "sglang:time_per_output_token_seconds", "sglang:num_used_tokens"]
# What examples/online_serving/prometheus_grafana/grafana.json queries (vLLM).
VLLM_DASHBOARD = ["vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
                  "vllm:time_per_output_token_seconds", "vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                  "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_success",
                  "vllm:request_max_num_generation_tokens", "vllm:request_queue_time_seconds",
                  "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                  "vllm:num_preemptions", "vllm:inter_token_latency_seconds", "vllm:prefix_cache_queries",
                  "vllm:prefix_cache_hits", "vllm:request_inference_time_seconds"]


def _finished(created: float = 100.0) -> ReqState:
    state = ReqState("r1", [1, 2, 3, 4])
    state.created = created
    state.first_token_time = created + 0.2
    state.last_time = created + 1.2
    state.finished_reason = {"type": "stop"}
    state.meta.update(prompt_tokens=4, completion_tokens=11, cached_tokens=2,
                      stages=[("queued", created + 0.01, 0), ("scheduled", created + 0.05, 0),
                              ("prefill_chunk", created + 0.05, 4)])
    return state


def _families(metrics: ServerMetrics) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


INFO = {"num_running_reqs": 3, "num_waiting_reqs": 2, "kv_usage": 0.25, "kv_used_tokens": 25,
        "max_total_num_tokens": 100, "num_retractions": 1, "decode_rows": 10}


def test_all_exports_both_projects_dashboard_series() -> None:
    metrics = ServerMetrics("tiny", "all", max_model_len=64)
    metrics.observe_finished(_finished())
    metrics.update_from_server_info(INFO)
    metrics.update_from_server_info({**INFO, "num_retractions": 4, "decode_rows": 30})
    families = _families(metrics)
    for name in SGLANG_DASHBOARD + SGLANG_DOCUMENTED + VLLM_DASHBOARD:
        assert name in families, name
        for sample in families[name].samples:  # type: ignore[attr-defined]
            assert sample.labels["model_name"] == "tiny", (name, sample)
    assert "engine_num_running_reqs" in families  # the engine's own names stay

    def value(sample_name: str, **labels: str) -> float:
        for family in families.values():
            for s in family.samples:  # type: ignore[attr-defined]
                if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        raise AssertionError(f"no sample {sample_name} {labels}")

    assert value("vllm:num_requests_running") == 3 and value("sglang:num_queue_reqs") == 2
    assert value("vllm:kv_cache_usage_perc") == 0.25 and value("sglang:token_usage") == 0.25
    assert value("vllm:num_preemptions_total") == 4  # the scheduler's own total
    assert value("sglang:gen_throughput") > 0
    assert value("vllm:request_success_total", finished_reason="stop") == 1
    assert value("sglang:cache_hit_rate") == 0.5 and value("vllm:prefix_cache_hits_total") == 2
    # SGLang's e2e layout: 1.2 s falls in the le=1.5 bucket, not le=1.0.
    assert value("sglang:e2e_request_latency_seconds_bucket", le="1.0") == 0
    assert value("sglang:e2e_request_latency_seconds_bucket", le="1.5") == 1
    assert value("vllm:request_queue_time_seconds_sum") == pytest.approx(0.04)
    assert value("vllm:time_per_output_token_seconds_sum") == pytest.approx(0.1)  # 1.0 s over 10 gaps
    les = [float(s.labels["le"]) for s in families["vllm:time_to_first_token_seconds"].samples  # type: ignore[attr-defined]
           if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    assert tuple(les) == VLLM_TTFT_BUCKETS
    les = [float(s.labels["le"]) for s in families["sglang:e2e_request_latency_seconds"].samples  # type: ignore[attr-defined]
           if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    assert tuple(les) == SGLANG_E2E_BUCKETS


@pytest.mark.parametrize("flavour,present,absent", [("sglang", "sglang:", "vllm:"), ("vllm", "vllm:", "sglang:"),
                                                     ("none", "engine_", "sglang:")])
def test_one_flavour_only(flavour: str, present: str, absent: str) -> None:
    text = ServerMetrics("m", flavour).render().decode()
    assert present in text and absent not in text and "engine_" in text


def test_phases_and_token_buckets() -> None:
    phases = request_phases(_finished(0.0))
    assert phases == pytest.approx({"queue": 0.04, "prefill": 0.15, "inference": 1.15, "decode": 1.0})
    assert token_count_buckets(64) == (1, 2, 5, 10, 20, 50)
    assert token_count_buckets(1) == (1,)


def test_grafana_dashboard_queries_existing_series() -> None:
    """docs/grafana/engine.json: valid JSON whose every ``engine_*`` series is one /metrics exports."""
    import json
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "engine.json"
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    referenced = {re.sub(r"_(total|bucket|sum|count)$", "", name) for e in exprs for name in re.findall(r"engine_\w+", e)}
    families = set(_families(ServerMetrics("m")))
    assert referenced and referenced <= families, referenced - families
    assert all('model_name=~"$model_name"' in e or "label_values" in e for e in exprs)
