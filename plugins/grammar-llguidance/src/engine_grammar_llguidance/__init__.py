"""The ``llguidance`` grammar backend (``--grammar-backend llguidance``).

Registration only: llguidance is imported when the backend is selected.
"""

from __future__ import annotations

from engine.hookspecs import GrammarBackendSpec, hookimpl


@hookimpl
def register_grammar_backends(register):  # type: ignore[no-untyped-def]
    register(GrammarBackendSpec(
        name="llguidance", factory="engine_grammar_llguidance.backend:LLGuidanceBackend",
        description="llguidance (Rust): JSON schema, regex, Lark/GBNF grammars",
        grammar_kinds=("json_schema", "regex", "ebnf"), supports_rollback=True))
