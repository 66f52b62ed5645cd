"""The server-side breakdown of a benchmark run, from sampled scheduler counters."""

from __future__ import annotations

from engine.bench.server_stats import run_breakdown


def _info(running: int, waiting: int, steps: int, rows: int, extend: int, decode_s: float) -> dict[str, float]:
    return {"num_running_reqs": running, "num_waiting_reqs": waiting, "kv_usage": 0.5, "decode_steps": steps,
            "decode_rows": rows, "decode_time_s": decode_s, "graph_decode_steps": steps, "extend_tokens": extend,
            "extend_time_s": 1.0}


def test_a_run_whose_scheduler_went_idle_before_its_clients_finished() -> None:
    # 4 requests: prefilled by 1 s, 10 decode steps of 4 rows by 2 s, the scheduler idle from the
    # 2.5 s sample on, while the run (its last streamed token) ended at 4 s.
    before = _info(0, 0, 0, 0, 0, 0.0)
    samples = [{"t": 0.5, **_info(2, 2, 0, 0, 64, 0.0)}, {"t": 1.0, **_info(4, 0, 0, 0, 128, 0.0)},
               {"t": 1.5, **_info(4, 0, 5, 20, 128, 0.4)}, {"t": 2.0, **_info(4, 0, 10, 40, 128, 0.8)},
               {"t": 2.5, **_info(0, 0, 10, 40, 128, 0.8)}, {"t": 3.0, **_info(0, 0, 10, 40, 128, 0.8)}]
    after = _info(0, 0, 10, 40, 128, 0.8)
    result = run_breakdown(before, samples, after, 4.0)
    assert result["decode_steps"] == 10 and result["mean_decode_batch"] == 4.0
    assert result["all_admitted_s"] == 1.0 and result["max_running"] == 4
    assert result["scheduler_done_s"] == 2.5
    assert sum(b["steps"] for b in result["decode_by_batch"]) == 10
    # Never idle before the end: no such time.
    assert run_breakdown(before, samples[:4], after, 2.2)["scheduler_done_s"] is None
