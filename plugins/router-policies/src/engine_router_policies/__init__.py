"""Registration of the built-in router policies (import-light: the policies load when selected).

- ``cache-aware``: the replica whose (approximate) cached prefixes match the prompt best, when
  the match is long enough and the replicas are not unevenly loaded; else the least loaded.
- ``round-robin``: replicas in turn.
- ``shortest-queue``: the replica with the fewest requests in flight.
"""

from __future__ import annotations

from engine.hookspecs import PluginOption, RouterPolicySpec, hookimpl

PLUGIN = "router_policies"


@hookimpl
def register_router_policies(register):  # type: ignore[no-untyped-def]
    register(RouterPolicySpec(
        name="cache-aware", factory="engine_router_policies.cache_aware:CacheAwarePolicy",
        description="Best prefix match over an approximate radix tree per replica, balanced by load"))
    register(RouterPolicySpec(name="round-robin", factory="engine_router_policies.simple:RoundRobinPolicy",
                              description="Replicas in turn"))
    register(RouterPolicySpec(name="shortest-queue", factory="engine_router_policies.simple:ShortestQueuePolicy",
                              description="The replica with the fewest requests in flight"))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    # Defaults follow SGLang's router (sgl-router): cache threshold 0.3, balance thresholds 64 and 1.5.
    register(PluginOption(PLUGIN, "cache_threshold", 0.3,
                          "cache-aware: route by prefix match only when the best replica's match covers "
                          "more than this fraction of the prompt"))
    register(PluginOption(PLUGIN, "balance_abs_threshold", 64,
                          "cache-aware: the replicas count as unevenly loaded (and the least loaded one gets "
                          "the request) when the busiest has more than this many in-flight requests more than "
                          "the idlest ..."))
    register(PluginOption(PLUGIN, "balance_rel_threshold", 1.5,
                          "... and more than this many times as many"))
    register(PluginOption(PLUGIN, "max_tree_tokens", 1 << 22,
                          "cache-aware: tokens each replica's approximate radix tree keeps; least recently "
                          "used leaves are evicted beyond it"))
