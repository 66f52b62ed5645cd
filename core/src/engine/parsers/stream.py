"""Turning a parser's view of the whole output into deltas, for streaming.

Parsers answer "what is the content, and what are the calls, given this much text?"
(``parse_partial``). A stream re-asks after every piece and sends what grew. This only works
when every answer extends the previous one (prefix-stable): a parser must hold back text that
may still change meaning (the start of a tag, an unfinished call) instead of sending it and
taking it back. The conformance kits check that property on every chunk boundary.
"""

from __future__ import annotations


class ParserStreamError(RuntimeError):
    """A parser took back text it had already given (a bug in the parser)."""


class GrowingText:
    """One growing string of a stream (content, reasoning, a call's arguments): what is new."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.sent = ""

    def advance(self, now: str) -> str:
        """The part of ``now`` not yet sent; ``now`` must extend what was sent."""
        if not now.startswith(self.sent):
            raise ParserStreamError(f"the parser changed {self.what} it had already streamed: "
                                    f"{self.sent[-40:]!r} became {now[:len(self.sent)][-40:]!r}")
        new = now[len(self.sent):]
        self.sent = now
        return new
