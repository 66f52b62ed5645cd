"""The hierarchical cache in the in-process scheduler (tiny random Llama, CPU): a multi-turn
workload on a device pool too small for it. With the host tier on, a returning conversation's
prefix comes back from host memory (counted as a host hit, reported as cached tokens) and the
greedy output equals an unlimited pool's; with it off, the prefix is recomputed."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from engine.config import ServerArgs
from engine.errors import ConfigError, PluginError
from engine.managers.scheduler import check_no_leak
from engine.metrics import ServerMetrics
from engine.testing.harness import OutputCollector, make_scheduler, submit

CONVERSATIONS, TURNS, HISTORY, USER, NEW = 3, 2, 48, 8, 4


def multi_turn(sched: Any) -> tuple[list[list[int]], list[int]]:
    """Round-robin turns, one request at a time; returns every turn's output and cached tokens."""
    rng = random.Random(7)
    history = [[rng.randrange(4, 2048) for _ in range(HISTORY)] for _ in range(CONVERSATIONS)]
    outputs, cached = [], []
    for _ in range(TURNS):
        for c in range(CONVERSATIONS):
            prompt = history[c] + [rng.randrange(4, 2048) for _ in range(USER)]
            rid = submit(sched, prompt, {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True})
            col = OutputCollector()
            while sched.step():
                col.collect(sched)
            col.collect(sched)
            outputs.append(col.ids[rid])
            cached.append(col.meta[rid]["cached_tokens"])
            history[c] = prompt + col.ids[rid]
    return outputs, cached


@pytest.fixture(scope="module")
def reference(llama_ckpt: str) -> list[list[int]]:
    return multi_turn(make_scheduler(llama_ckpt))[0]


# The pool holds about two conversations' KV: the first is evicted before it returns.
SMALL = dict(max_total_tokens=128)


@pytest.mark.parametrize("settings", [
    {"hicache_write_policy": "write_back"},
    # Pages, and prompts split into chunks cached between them (cache_unfinished_req).
    {"hicache_write_policy": "write_through", "page_size": 4, "chunked_prefill_size": 16},
], ids=["write_back", "write_through-pages-chunks"])
def test_returning_conversation_is_served_from_host_memory(llama_ckpt: str, reference: list[list[int]],
                                                           settings: dict[str, Any]) -> None:
    sched = make_scheduler(llama_ckpt, enable_hierarchical_cache=True, **settings, **SMALL)
    outputs, cached = multi_turn(sched)
    assert outputs == reference
    stats = sched.stats()
    # Every second-turn prompt starts with its conversation's whole first turn, now in the tier.
    assert all(c >= HISTORY for c in cached[CONVERSATIONS:]), cached
    assert stats["hicache_host_hit_tokens"] >= CONVERSATIONS * HISTORY
    assert stats["hicache_bytes_loaded"] > 0 and stats["hicache_bytes_written"] > 0
    check_no_leak(sched)
    metrics = ServerMetrics("tiny")
    metrics.update_from_server_info(stats)
    text = metrics.render().decode()
    host_hits = stats["hicache_host_hit_tokens"]
    assert f'engine_hicache_hit_tokens{{model_name="tiny",tier="host"}} {float(host_hits)}' in text
    assert f'engine_hicache_bytes_moved{{direction="to_device",model_name="tiny"}} {float(stats["hicache_bytes_loaded"])}' in text
    assert sched.flush_cache() and sched.tree_cache.host_size() == 0


def test_without_the_tier_the_prefix_is_recomputed(llama_ckpt: str, reference: list[list[int]]) -> None:
    sched = make_scheduler(llama_ckpt, **SMALL)
    outputs, cached = multi_turn(sched)
    assert outputs == reference
    assert cached[CONVERSATIONS] == 0  # the first conversation's history was evicted and dropped
    assert "hicache_host_hit_tokens" not in sched.stats()


@pytest.mark.parametrize("values,message", [
    ({"hicache_storage_backend": "nowhere"}, "--hicache-storage-backend: unknown KV storage tier 'nowhere'; installed: "),
    ({"hicache_ratio": -1}, "--hicache-ratio: invalid value -1.0; accepted: a number > 0"),
    ({"hicache_size": -2}, "--hicache-size: invalid value -2.0"),
    ({"hicache_write_policy": "sometimes"}, "--hicache-write-policy: invalid value 'sometimes'; accepted: write_through, write_back"),
    ({"disable_radix_cache": True}, "--enable-hierarchical-cache: needs the radix cache"),
])
def test_bad_settings_are_refused_before_the_model_loads(values: dict[str, Any], message: str) -> None:
    with pytest.raises((ConfigError, PluginError), match=re.escape(message)):
        ServerArgs.from_dict({"enable_hierarchical_cache": True, **values})
