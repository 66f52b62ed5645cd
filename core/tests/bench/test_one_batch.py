"""``engine bench one-batch``'s loop: overlapped and synchronous decode produce the same tokens;
its result rows say how the model was split."""

from __future__ import annotations

import json

import pytest

from engine.bench.one_batch import bench_one_batch, run_one
from engine.config import ServerArgs
from engine.managers.scheduler import Scheduler


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory) -> Scheduler:
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("one-batch")), "LlamaForCausalLM")
    args = ServerArgs.from_dict({"model_path": path, "max_total_tokens": 4096})
    return Scheduler(args, path)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_overlapped_decode_matches_synchronous(scheduler: Scheduler, batch_size: int) -> None:
    sync = run_one(scheduler, batch_size, 12, 9, seed=5, overlap=False)
    lapped = run_one(scheduler, batch_size, 12, 9, seed=5, overlap=True)
    assert lapped.overlap and not sync.overlap
    assert [len(o) for o in sync.output_ids] == [9] * batch_size
    assert lapped.output_ids == sync.output_ids
    assert "output_ids" not in lapped.to_dict() and lapped.to_dict()["overlap"] is True


def test_kv_is_returned_after_each_run(scheduler: Scheduler) -> None:
    free = scheduler.runner.token_to_kv_pool_allocator.available_size()
    run_one(scheduler, 2, 10, 5, overlap=True)
    assert scheduler.runner.token_to_kv_pool_allocator.available_size() == free


def test_large_prefill_runs_in_groups_with_the_same_tokens(scheduler: Scheduler) -> None:
    # 4 prompts of 12 tokens with an 8192-token chunk: one group; with a 24-token chunk: two groups.
    whole = run_one(scheduler, 4, 12, 3, seed=9, overlap=False)
    saved = scheduler.args.chunked_prefill_size
    scheduler.args.chunked_prefill_size = 24
    try:
        grouped = run_one(scheduler, 4, 12, 3, seed=9, overlap=False)
    finally:
        scheduler.args.chunked_prefill_size = saved
    assert grouped.output_ids == whole.output_ids


def test_result_row_names_the_parallel_sizes(scheduler: Scheduler, tmp_path) -> None:
    out = tmp_path / "rows.jsonl"
    bench_one_batch(scheduler.args, [2], [8], [3], result_file=str(out), warmup=False)
    row = json.loads(out.read_text().splitlines()[-1])
    assert (row["tp_size"], row["pp_size"], row["ep_size"]) == (1, 1, 1)
    assert (row["batch_size"], row["input_len"], row["output_len"]) == (2, 8, 3)


def test_warmup_runs_each_measured_shape_first(scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.bench.one_batch as one_batch

    calls: list[tuple[int, int, int]] = []
    real = one_batch.run_one

    def recording(sched, batch_size, input_len, output_len, **kw):
        calls.append((batch_size, input_len, output_len))
        return real(sched, batch_size, input_len, output_len, **kw)

    monkeypatch.setattr(one_batch, "run_one", recording)
    bench_one_batch(scheduler.args, [1, 2], [8, 5], [3], warmup=True)
    # Every (batch size, input length) untimed first (prefill plus one decode step), then the timed runs.
    assert calls == [(1, 8, 2), (1, 5, 2), (2, 8, 2), (2, 5, 2), (1, 8, 3), (1, 5, 3), (2, 8, 3), (2, 5, 3)]
