"""What the live view (``/dashboard``) shows, computed in the HTTP process.

``LiveView`` observes every finished request (the tokenizer manager's ``on_finish``) and keeps
the recent ones and their latencies; ``snapshot`` turns one scheduler ``server_info`` reply and
one ``requests`` reply (``engine.managers.timeline``) into the feed's event: load, KV use,
throughput since the previous event, latency percentiles over a sliding window, and the
in-flight requests. ``timeline`` is one request's stages, in-flight or recently finished.
All times here are ``time.perf_counter()`` seconds, the clock the scheduler's stages use too.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

from engine.metrics_compat import first_token_time

# Latency percentiles cover requests finished in this many seconds.
WINDOW_S = 300.0
# Finished requests whose timeline stays available (picked from the table or by id).
RECENT_FINISHED = 200
_MAX_SAMPLES = 20_000


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by linear interpolation; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class LiveView:
    """The live view's memory: recent finished requests, latency samples, the previous counters."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        # (finish time, ttft or None, mean inter-token latency or None)
        self.samples: deque[tuple[float, float | None, float | None]] = deque(maxlen=_MAX_SAMPLES)
        self.finished: dict[str, dict[str, Any]] = {}
        self._prev: tuple[float, float, float] | None = None  # (time, extend_tokens, decode_rows)
        self.prompt_tokens = 0
        self.cached_tokens = 0

    # -- observers ------------------------------------------------------------------
    def observe_finished(self, state: Any) -> None:
        """Records a finished request (a tokenizer manager ``ReqState``)."""
        meta = state.meta
        completion = int(meta.get("completion_tokens", len(state.output_ids)))
        prompt = int(meta.get("prompt_tokens", len(state.prompt_ids)))
        self.prompt_tokens += prompt
        self.cached_tokens += int(meta.get("cached_tokens", 0))
        ttft = itl = None
        first = first_token_time(state)
        if first is not None:
            ttft = first - state.created
            if state.last_time is not None and completion > 1:
                itl = (state.last_time - first) / (completion - 1)
        end = state.last_time if state.last_time is not None else time.perf_counter()
        self.samples.append((end, ttft, itl))
        self.finished[state.rid] = {
            "rid": state.rid, "state": "finished", "created": state.created, "first_token": first,
            "end": end, "prompt_tokens": prompt, "output_tokens": completion,
            "cached_tokens": int(meta.get("cached_tokens", 0)), "stages": list(meta.get("stages") or []),
            "finish_reason": (state.finished_reason or {}).get("type")}
        while len(self.finished) > RECENT_FINISHED:
            self.finished.pop(next(iter(self.finished)))

    # -- the feed -------------------------------------------------------------------
    def snapshot(self, info: dict[str, Any], live: list[dict[str, Any]], states: dict[str, Any],
                 now: float | None = None) -> dict[str, Any]:
        """One feed event from a ``server_info`` reply, the ``requests`` replies' rows and the
        tokenizer manager's in-flight states (by request id)."""
        now = time.perf_counter() if now is None else now
        extend, rows = float(info.get("extend_tokens", 0)), float(info.get("decode_rows", 0))
        prefill_tps = decode_tps = 0.0
        if self._prev is not None and now > self._prev[0]:
            dt = now - self._prev[0]
            prefill_tps = max(0.0, extend - self._prev[1]) / dt
            decode_tps = max(0.0, rows - self._prev[2]) / dt
        self._prev = (now, extend, rows)
        recent = [s for s in self.samples if s[0] >= now - self.window_s]
        ttfts = [s[1] for s in recent if s[1] is not None]
        itls = [s[2] for s in recent if s[2] is not None]
        total = info.get("max_total_num_tokens", 0)
        host_total = info.get("hicache_host_capacity_tokens")
        event: dict[str, Any] = {
            "time": time.time(), "running": info.get("num_running_reqs", 0), "queued": info.get("num_waiting_reqs", 0),
            "grammar_queued": info.get("num_grammar_queue_reqs", 0),
            "decode_batch_size": sum(int(r.get("decode_batch_size", 0)) for r in live if "decode_batch_size" in r),
            "kv_usage": info.get("kv_usage", 0.0), "kv_used_tokens": info.get("kv_used_tokens", 0),
            "kv_total_tokens": total, "kv_evictable_tokens": info.get("kv_evictable_tokens", 0),
            "host_kv_usage": (info.get("hicache_host_tokens", 0) / host_total) if host_total else None,
            "cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
            "prefill_tokens_per_s": prefill_tps, "decode_tokens_per_s": decode_tps,
            "window_s": self.window_s, "finished_in_window": len(recent),
            "ttft": {f"p{int(q * 100)}": percentile(ttfts, q) for q in (0.5, 0.9, 0.99)},
            "itl": {f"p{int(q * 100)}": percentile(itls, q) for q in (0.5, 0.9, 0.99)},
            "requests": self.in_flight(live, states, now),
            "recent": [{"rid": r["rid"], "finish_reason": r["finish_reason"], "output_tokens": r["output_tokens"],
                        "latency_s": r["end"] - r["created"]} for r in list(self.finished.values())[-20:]][::-1],
        }
        return event

    @staticmethod
    def in_flight(live: list[dict[str, Any]], states: dict[str, Any], now: float) -> list[dict[str, Any]]:
        """The table rows: every request the tokenizer manager holds, with the scheduler's state
        (``queued`` until the scheduler has seen it), oldest first."""
        rows_by_rid = {row["rid"]: row for reply in live for row in reply.get("requests", [])}
        table = []
        for rid, state in list(states.items()):
            row = rows_by_rid.get(rid, {})
            table.append({"rid": rid, "state": row.get("state", "queued"), "age_s": now - state.created,
                          "prompt_tokens": row.get("prompt_tokens", len(state.prompt_ids)),
                          "output_tokens": max(row.get("output_tokens", 0), len(state.output_ids)),
                          "cached_tokens": row.get("cached_tokens", 0)})
        table.sort(key=lambda r: -r["age_s"])
        return table

    def timeline(self, rid: str, live: list[dict[str, Any]], states: dict[str, Any],
                 now: float | None = None) -> dict[str, Any] | None:
        """One request's stages as seconds since it arrived; None for an unknown id."""
        now = time.perf_counter() if now is None else now
        state = states.get(rid)
        if state is not None:
            row = next((r for reply in live for r in reply.get("requests", []) if r["rid"] == rid), {})
            record = {"rid": rid, "state": row.get("state", "queued"), "created": state.created,
                      "first_token": state.first_token_time, "end": None, "stages": row.get("stages", []),
                      "prompt_tokens": row.get("prompt_tokens", len(state.prompt_ids)),
                      "output_tokens": max(row.get("output_tokens", 0), len(state.output_ids)),
                      "cached_tokens": row.get("cached_tokens", 0),
                      "finish_reason": None}
        elif rid in self.finished:
            record = self.finished[rid]
        else:
            return None
        created = record["created"]
        events = [{"stage": "arrived", "t": 0.0, "tokens": record["prompt_tokens"]}]
        events += [{"stage": name, "t": max(0.0, t - created), "tokens": tokens} for name, t, tokens in record["stages"]]
        if record["first_token"] is not None and not any(e["stage"] == "first_token" for e in events):
            events.append({"stage": "first_token", "t": record["first_token"] - created, "tokens": 1})
        if record["end"] is not None:
            events.append({"stage": "finished", "t": record["end"] - created, "tokens": record["output_tokens"]})
        events.sort(key=lambda e: e["t"])
        out = {k: record[k] for k in ("rid", "state", "prompt_tokens", "output_tokens", "cached_tokens",
                                      "finish_reason")}
        out["age_s"] = (record["end"] or now) - created
        out["events"] = events
        return out
