from __future__ import annotations


from engine.managers.policy import PolicyContext
from engine.managers.schedule_batch import Req
from engine.sampling.sampling_params import SamplingParams
from engine.testing import SchedulePolicyConformance
from engine_policy_priority import PriorityPolicy

_PREEMPT = PolicyContext(enable_preemption=True)


class TestPriority(SchedulePolicyConformance):
    policy_name = "priority"


def _req(rid: str, priority: int) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(max_new_tokens=8), set(), priority=priority)


def _rids(reqs: list[Req]) -> list[str]:
    return [r.rid for r in reqs]


def test_higher_priority_first_fcfs_within_a_level() -> None:
    reqs = [_req("a", 0), _req("b", 2), _req("c", 0), _req("d", -1), _req("e", 2), _req("f", 1)]
    ordered = PriorityPolicy().order(list(reversed(reqs)), PolicyContext())
    assert _rids(ordered) == ["b", "e", "f", "a", "c", "d"]


def test_no_preemption_unless_enabled() -> None:
    running, waiting = [_req("low", 0)], [_req("high", 5)]
    assert PriorityPolicy().preempt(running, waiting, PolicyContext(enable_preemption=False)) == []


def test_preempts_lowest_first_bounded_by_urgent_waiting() -> None:
    running = [_req("r_mid", 2), _req("r_low", 0), _req("r_top", 5), _req("r_low2", 1)]
    waiting = [_req("w_hi", 4), _req("w_hi2", 3)]
    victims = PriorityPolicy().preempt(running, waiting, _PREEMPT)
    # Two waiting requests outrank someone: at most two victims, lowest priority first.
    assert _rids(victims) == ["r_low", "r_low2"]


def test_each_victim_is_outranked_by_its_own_waiting_request() -> None:
    running = [_req("r0", 0), _req("r3", 3)]
    waiting = [_req("w4", 4), _req("w1", 1)]
    # w4 displaces r0; w1 does not outrank r3, so r3 keeps running.
    assert _rids(PriorityPolicy().preempt(running, waiting, _PREEMPT)) == ["r0"]


def test_equal_priority_never_preempts() -> None:
    running, waiting = [_req("r", 2)], [_req("w", 2), _req("w2", 1)]
    assert PriorityPolicy().preempt(running, waiting, _PREEMPT) == []


def test_latest_arrival_is_preempted_first_within_a_level() -> None:
    older, newer = _req("older", 0), _req("newer", 0)
    victims = PriorityPolicy().preempt([older, newer], [_req("w", 9)], _PREEMPT)
    assert _rids(victims) == ["newer"]


def test_empty_sides_preempt_nothing() -> None:
    assert PriorityPolicy().preempt([], [_req("w", 9)], _PREEMPT) == []
    assert PriorityPolicy().preempt([_req("r", 0)], [], _PREEMPT) == []


def test_scheduler_preempts_for_urgent_request(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from engine.managers.scheduler import check_no_leak
    from engine.testing.checkpoints import make_tiny_checkpoint
    from engine.testing.harness import OutputCollector, generate_greedy, make_scheduler, submit

    path = make_tiny_checkpoint(str(tmp_path / "m"), "LlamaForCausalLM")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    reference = generate_greedy(make_scheduler(path), prompts, 12, ignore_eos=True)
    sched = make_scheduler(path, schedule_policy="priority", enable_priority_preemption=True, max_running_requests=2)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    col = OutputCollector()
    low = [submit(sched, p, params, priority=0) for p in prompts[:2]]
    for _ in range(3):
        sched.step()
        col.collect(sched)
    urgent = submit(sched, prompts[2], params, priority=5)
    sched.step()
    col.collect(sched)
    running = {r.rid for r in sched.running_batch.reqs}
    assert urgent in running and sched.num_retractions == 1
    while sched.step():
        col.collect(sched)
    col.collect(sched)
    assert [col.ids[r] for r in low + [urgent]] == reference
    check_no_leak(sched)
