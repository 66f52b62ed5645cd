"""Where a benchmark run's time went on the server: the scheduler's counters, sampled.

``engine bench offline`` (in-process) and ``engine bench serving`` (over HTTP, from
``/get_server_info``) both take the scheduler's counters before the timed run, every
``SAMPLE_INTERVAL_S`` during it and after it, and report the same breakdown: prefill and decode
seconds, decode steps and their mean batch, decode time by batch-size band, when the last
request was admitted, and a coarse timeline of running and waiting requests.
"""

from __future__ import annotations

from typing import Any

#: Seconds between the scheduler samples the timed run takes (running and waiting requests, counters).
SAMPLE_INTERVAL_S = 0.5
#: Decode batch-size bands the run's decode time is split into (lower bounds).
BATCH_BANDS = (1, 64, 256, 512, 768, 1024)
#: The counters a sample keeps; a server that reports ``decode_steps`` reports them all.
SAMPLED = ("num_running_reqs", "num_waiting_reqs", "kv_usage", "decode_steps", "decode_rows", "decode_time_s",
           "graph_decode_steps", "extend_tokens", "extend_time_s")


def has_counters(info: dict[str, Any]) -> bool:
    """Whether a server-info reply carries the scheduler's counters (this engine's servers do)."""
    return "decode_steps" in info and "extend_tokens" in info


def sample_point(t: float, info: dict[str, Any]) -> dict[str, float]:
    """One point of the run's timeline: ``t`` (s) and the scheduler's ``SAMPLED`` counters."""
    return {"t": t, **{k: float(info.get(k, 0) or 0) for k in SAMPLED}}


def step_breakdown(before: dict[str, Any], after: dict[str, Any], duration: float) -> dict[str, Any]:
    """Where the timed run went, from the scheduler's counters (differences over the run)."""
    def diff(key: str) -> Any:
        return after.get(key, 0) - before.get(key, 0)

    steps = diff("decode_steps")
    return {
        "retractions": diff("num_retractions"), "decode_steps": steps,
        "overlapped_decode_steps": diff("overlapped_decode_steps"),
        "mean_decode_batch": diff("decode_rows") / steps if steps else 0.0,
        "mean_decode_step_ms": 1e3 * diff("decode_time_s") / steps if steps else 0.0,
        "extend_tokens": diff("extend_tokens"),
        "extend_time_s": diff("extend_time_s"), "decode_time_s": diff("decode_time_s"),
        "prefill_time_share": diff("extend_time_s") / duration if duration > 0 else 0.0,
        "graph_decode_steps": diff("graph_decode_steps"),
    }


def timeline(before: dict[str, Any], samples: list[dict[str, float]], after: dict[str, Any],
             duration: float) -> dict[str, Any]:
    """What the samples of the timed run show: decode time by batch-size band (each interval
    between two samples counts in the band of its mean batch), when the last request was admitted
    (no request waiting), the most requests running at once, and a coarse timeline."""
    points = [sample_point(0.0, before), *samples,
              sample_point(max(duration, samples[-1]["t"] if samples else 0.0), after)]
    bands: dict[int, list[float]] = {b: [0.0, 0.0, 0.0] for b in BATCH_BANDS}  # steps, rows, seconds
    for a, b in zip(points, points[1:], strict=False):
        steps = b["decode_steps"] - a["decode_steps"]
        if steps > 0:
            rows = b["decode_rows"] - a["decode_rows"]
            band = max(x for x in BATCH_BANDS if x <= max(1.0, rows / steps))
            bands[band][0] += steps
            bands[band][1] += rows
            bands[band][2] += b["decode_time_s"] - a["decode_time_s"]
    # The first sample with nothing waiting after prefill began (before it, the requests may not have arrived).
    admitted = next((p["t"] for p in samples if p["num_waiting_reqs"] == 0
                     and p["extend_tokens"] > points[0]["extend_tokens"]), None)
    # The first sample after which the scheduler had nothing left: what follows is the outputs'
    # way to the client (HTTP streaming), not the scheduler's work.
    last = points[-1]
    done = next((p["t"] for p in samples if p["num_running_reqs"] == 0 and p["num_waiting_reqs"] == 0
                 and p["decode_steps"] == last["decode_steps"] and p["extend_tokens"] == last["extend_tokens"]), None)
    # About 16 rows of (time, running, waiting, KV use, decode steps/s, mean batch) over the run.
    stride = max(1, (len(points) - 1) // 16)
    coarse = []
    for a, b in zip(points[::stride], points[stride::stride], strict=False):
        dt, steps = b["t"] - a["t"], b["decode_steps"] - a["decode_steps"]
        coarse.append([round(b["t"], 2), int(b["num_running_reqs"]), int(b["num_waiting_reqs"]),
                       round(b["kv_usage"], 3), round(steps / dt, 1) if dt > 0 else 0.0,
                       round((b["decode_rows"] - a["decode_rows"]) / steps, 1) if steps else 0.0,
                       round((b["extend_tokens"] - a["extend_tokens"]) / dt) if dt > 0 else 0])
    return {
        "decode_by_batch": [{"batch_from": band, "steps": int(v[0]), "rows": int(v[1]), "time_s": round(v[2], 3)}
                            for band, v in bands.items() if v[0]],
        "all_admitted_s": admitted,
        "scheduler_done_s": done,
        "max_running": int(max((p["num_running_reqs"] for p in samples), default=0)),
        "cuda_graph_max_bs": max(after.get("cuda_graph_batch_sizes") or [0]),
        "timeline": coarse,
    }


def run_breakdown(before: dict[str, Any], samples: list[dict[str, float]], after: dict[str, Any],
                  duration: float) -> dict[str, Any]:
    """``step_breakdown`` and ``timeline`` of one run, as the fields of its result row."""
    return {**step_breakdown(before, after, duration), **timeline(before, samples, after, duration)}


def print_breakdown(result: dict[str, Any], duration: float | None = None) -> None:
    """The server-side part of a result (``run_breakdown``'s fields), as lines under its summary;
    ``duration``: the run's seconds (default: the result's ``duration_s``)."""
    print(f"{'decode steps':<28}{result['decode_steps']:>14}  (mean batch {result['mean_decode_batch']:.1f}, "
          f"{result['mean_decode_step_ms']:.2f} ms, {result['overlapped_decode_steps']} overlapped)")
    print(f"{'prefill tokens computed':<28}{result['extend_tokens']:>14}  ({result['retractions']} retractions)")
    print(f"{'prefill share of time':<28}{result['prefill_time_share']:>14.2f}  "
          f"(prefill {result['extend_time_s']:.1f} s, decode {result['decode_time_s']:.1f} s)")
    graphs, max_bs = result["graph_decode_steps"], result["cuda_graph_max_bs"]
    print(f"{'decode steps from graphs':<28}{graphs:>14}  ("
          + (f"graphs up to batch {max_bs}; " if max_bs else "no graphs; ")
          + f"{result['decode_steps'] - graphs} eager or speculative)")
    admitted = result["all_admitted_s"]
    print(f"{'most running at once':<28}{result['max_running']:>14}  (last request admitted at "
          + (f"{admitted:.1f} s)" if admitted is not None else "the end)"))
    done, duration = result.get("scheduler_done_s"), duration or result.get("duration_s")
    if done is not None and duration:
        print(f"{'scheduler idle from':<28}{done:>14.1f}  s (sampled) of the run's {duration:.1f} s: the rest is "
              "the outputs' way to the client")
    print("decode time by batch size:")
    for band in result["decode_by_batch"]:
        steps = band["steps"]
        print(f"  batch >= {band['batch_from']:<5} {steps:>7} steps  {band['time_s']:8.2f} s  "
              f"mean batch {band['rows'] / steps:7.1f}  {1e3 * band['time_s'] / steps:7.2f} ms/step")
    print("timeline:   t (s)  running  waiting  KV use  decode steps/s  mean batch  prefill tok/s")
    for t, running, waiting, kv, rate, batch, prefill in result["timeline"]:
        print(f"  {t:>12.1f} {running:>8} {waiting:>8} {kv:>7.2f} {rate:>15.1f} {batch:>11.1f} {prefill:>14}")
