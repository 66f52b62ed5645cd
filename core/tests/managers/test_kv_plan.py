"""Admission by the pool's exact future for run-to-length requests, and tail-first order."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.managers.kv_plan import KvPlan, largest_group_fitting, projected_peak, tail_first_limit
from engine.managers.scheduler import check_no_leak
from engine.testing.harness import OutputCollector, make_scheduler, submit


def _peak_by_steps(base: list[int], left: list[int], slack: int) -> int:
    """The peak by walking every future step."""
    horizon = max(left, default=0) + 1
    return max((sum(b + t + slack for b, n in zip(base, left, strict=True) if t <= n) for t in range(horizon)),
               default=0)


def test_projected_peak_equals_walking_every_step() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 12)
        base = [rng.randint(0, 50) for _ in range(n)]
        left = [rng.randint(0, 40) for _ in range(n)]
        slack = rng.choice([0, 4])
        got = projected_peak(np.asarray(base, dtype=np.int64), np.asarray(left, dtype=np.int64), slack)
        assert got == _peak_by_steps(base, left, slack), (base, left, slack)


def test_a_request_that_finishes_first_frees_room_for_a_later_one() -> None:
    # Two running: 100 slots with 10 tokens to go, 100 with 50. Together they peak at 220 slots
    # (step 10); setting every remainder aside at once would claim 260.
    plan = KvPlan()
    plan.add(100, 10, 100)
    plan.add(100, 50, 100)
    assert plan.need() == 20
    # A new 30-token prompt with 5 to go: the peak moves to step 5 (105 + 105 + 35).
    assert plan.extra_need(30, 5, 0) == 245 - 220
    # With 60 to go: 110 + 110 + 40 at step 10.
    assert plan.extra_need(30, 60, 0) == 260 - 220
    # Its first 10 tokens cached (held already): 10 fewer.
    assert plan.extra_need(30, 60, 10) == 260 - 220 - 10


def test_tail_first_admits_the_remainder_first_and_then_the_group_whole() -> None:
    # 8 equal requests, 20 prompt slots and 30 to go (50 at their peak); 320 slots hold six.
    bases, lefts = [20] * 8, [30] * 8
    assert largest_group_fitting(np.asarray(bases), np.asarray(lefts), 320) == 6
    assert tail_first_limit(KvPlan(), bases, lefts, free=320, capacity=320) == 2
    assert tail_first_limit(KvPlan(), bases[:6], lefts[:6], free=320, capacity=320) is None  # all fit
    # The two started: the six fit beside them once the two are 14 steps on (2 x 50 + 6 x 36 at
    # the two's last step), and until then none of the six starts.
    for steps_on, limit in ((0, 0), (13, 0), (14, None)):
        running = KvPlan()
        for _ in range(2):
            running.add(20 + steps_on, 30 - steps_on, 20 + steps_on)
        got = tail_first_limit(running, bases[:6], lefts[:6], free=320 - running.held, capacity=320)
        assert got == limit, (steps_on, got)


def test_no_tail_first_when_the_group_could_only_start_after_the_remainder_ended() -> None:
    # 8 requests of 40 prompt slots and 10 to go: six fit in 320 slots, but beside the other two
    # (100 slots at their end) six 40-slot prompts never fit before those two finish. Starting
    # the two first would change no step count and only make six requests wait instead of two.
    bases, lefts = [40] * 8, [10] * 8
    assert tail_first_limit(KvPlan(), bases, lefts, free=320, capacity=320) is None


def test_no_hold_of_the_last_group_when_it_could_only_start_after_the_running_ended() -> None:
    # Two rounds into a burst of 8 x (40 + 10) in 320 slots: two run (40 slots, 10 to go), six
    # wait, and six fit the empty pool. Beside the two they never fit before the two end, so
    # holding them back to start together saves no step: admission takes what fits.
    running = KvPlan()
    for _ in range(2):
        running.add(40, 10, 40)
    assert tail_first_limit(running, [40] * 6, [10] * 6, free=320 - 80, capacity=320) is None
    # Nor when the longer of two running requests holds 100 slots at its last step (60 to go):
    # 240 + 100 > 320. With 30 to go it holds 70 then, and the six fit beside it (240 + 70):
    # they are held until they fit whole, and start together while it still runs (limit 0).
    for longer, limit in ((60, None), (30, 0)):
        running = KvPlan()
        running.add(40, 10, 40)
        running.add(40, longer, 40)
        assert tail_first_limit(running, [40] * 6, [10] * 6, free=320 - 80, capacity=320) == limit, longer


def _run(llama_ckpt: str, prompts: list[list[int]], max_new: int, overlap: bool, **kwargs: object) -> tuple:
    sched = make_scheduler(llama_ckpt, max_total_tokens=320, **kwargs)
    sched.enable_overlap = overlap
    col = OutputCollector()
    rids = [submit(sched, p, {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}) for p in prompts]
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    check_no_leak(sched)
    return [col.ids[r] for r in rids], sched.decode_steps, sched.num_retractions


@pytest.mark.parametrize("overlap,shared,kwargs,fewer", [
    (False, 0, {}, 10), (True, 0, {}, 10), (True, 12, {}, 5),
    (True, 0, {"chunked_prefill_size": 8, "page_size": 4}, 5),  # prompts in chunks, whole pages
], ids=["sync", "overlap", "overlap-shared-prefix", "overlap-chunks-pages"])
def test_a_queue_larger_than_the_pool_decodes_in_fewer_steps_with_the_same_outputs(
        llama_ckpt: str, overlap: bool, shared: int, kwargs: dict[str, int], fewer: int) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(4, 2048) for _ in range(shared)]
    # With a shared prefix, a finished request's prefix stays cached: the plan must not count
    # those slots as freed (it would admit too many, and decode would have to retract).
    prompts = [prefix + [rng.randrange(4, 2048) for _ in range(20 - shared)] for _ in range(10 if shared else 8)]
    # 8 requests of 20 + 30 slots in a 320-slot pool: six fit at once. Reserving every
    # remainder, six run and then two alone (two waves of 30 steps); tail first, two start,
    # and the six join once the pool holds them beside the two to the end.
    planned, planned_steps, planned_retractions = _run(llama_ckpt, prompts, 30, overlap, **kwargs)
    reserved, reserved_steps, reserved_retractions = _run(llama_ckpt, prompts, 30, overlap, disable_kv_plan=True,
                                                          **kwargs)
    assert planned == reserved
    assert all(len(ids) == 30 for ids in planned)
    assert planned_retractions == reserved_retractions == 0
    assert reserved_steps >= 2 * 29
    # (41 against 58 steps; 53 against 60 with a shared prefix: the queue's own sizes are taken
    # without their cached prefixes, so the group starts later; 53 against 59 with 4-token pages,
    # whose spare pages leave room for fewer.)
    assert planned_steps <= reserved_steps - fewer, (planned_steps, reserved_steps)


def test_no_tail_first_hold_when_request_slots_bound_the_batch(llama_ckpt: str) -> None:
    rng = random.Random(8)
    prompts = [[rng.randrange(4, 2048) for _ in range(20)] for _ in range(8)]
    # Four slots for eight requests: the pool is not what limits the batch, so holding a group
    # back for memory would only leave slots idle. Both admissions run four, then four.
    planned = _run(llama_ckpt, prompts, 30, False, max_running_requests=4)
    reserved = _run(llama_ckpt, prompts, 30, False, max_running_requests=4, disable_kv_plan=True)
    assert planned == reserved


def test_a_burst_admitted_over_many_rounds_fills_the_pool_as_without_the_plan(llama_ckpt: str) -> None:
    # 24 x (16 + 4) in 330 slots, 4 prompts a round (64-token chunks): 16 fit at once. Rounds
    # after the first see running requests; the 16 still waiting fit the empty pool but not
    # beside them, so they must not be held until the first ones end (two waves of 8 and 16
    # instead of 16 and 8: the same steps, twice as many requests waiting).
    rng = random.Random(9)
    prompts = [[rng.randrange(4, 2048) for _ in range(16)] for _ in range(24)]
    most = []
    for disable in (False, True):
        sched = make_scheduler(llama_ckpt, max_total_tokens=330, chunked_prefill_size=64, max_prefill_tokens=64,
                               disable_kv_plan=disable)
        sched.enable_overlap = False
        col = OutputCollector()
        rids = [submit(sched, p, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}) for p in prompts]
        running = 0
        while sched.step():
            running = max(running, len(sched.running_batch.reqs))
            col.collect(sched)
        col.collect(sched)
        check_no_leak(sched)
        most.append((running, sched.decode_steps, [col.ids[r] for r in rids]))
    assert most[0] == most[1]
    assert most[0][0] >= 15, most[0][:2]
