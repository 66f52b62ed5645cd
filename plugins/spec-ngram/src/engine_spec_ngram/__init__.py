"""The ``ngram`` speculative proposer: prompt lookup over each request's own tokens.

Registration only; the proposer lives in ``engine_spec_ngram.proposer`` and is imported when
``--speculative-algorithm ngram`` selects it.
"""

from __future__ import annotations

from engine.hookspecs import PluginOption, SpeculativeAlgorithmSpec, hookimpl


@hookimpl
def register_speculative_algorithms(register):  # type: ignore[no-untyped-def]
    register(SpeculativeAlgorithmSpec(
        name="ngram", factory="engine_spec_ngram.proposer:create",
        description="Prompt lookup: continues the latest earlier occurrence of the request's last n tokens"))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    register(PluginOption("ngram", "max_ngram", 4, "longest suffix (tokens) looked up in the request's history"))
    register(PluginOption("ngram", "min_ngram", 1, "shortest suffix looked up before proposing nothing"))
    register(PluginOption("ngram", "window", 8192, "only the last this many tokens of a request are searched"))
