"""The ``xgrammar`` grammar backend (the default ``--grammar-backend``).

Registration only: xgrammar is imported when the backend is selected.
"""

from __future__ import annotations

from engine.hookspecs import GrammarBackendSpec, PluginOption, hookimpl


@hookimpl
def register_grammar_backends(register):  # type: ignore[no-untyped-def]
    register(GrammarBackendSpec(
        name="xgrammar", factory="engine_grammar_xgrammar.backend:XGrammarBackend",
        description="xgrammar: JSON schema, regex, EBNF/GBNF, structural tags",
        grammar_kinds=("json_schema", "regex", "ebnf", "structural_tag"), supports_rollback=True))


@hookimpl
def register_plugin_options(register):  # type: ignore[no-untyped-def]
    register(PluginOption("xgrammar", "any_whitespace", False,
                          "JSON may hold any whitespace between tokens (off: compact JSON, so a small "
                          "model cannot loop on spaces)"))
    register(PluginOption("xgrammar", "compile_threads", 2, "threads xgrammar uses inside one compile"))
    register(PluginOption("xgrammar", "fill_threads", 0, "threads filling a batch's token bitmask "
                          "(0: min(8, CPU count); 1: row by row, no thread pool)"))
    register(PluginOption("xgrammar", "accept_threads", 0, "threads accepting a batch's sampled tokens "
                          "(slices of 8 rows or more; 0: min(8, CPU count); 1: one batch call, no pool)"))
