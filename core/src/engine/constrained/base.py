"""The grammar-backend interface: what a structured-output library plugs in.

A backend turns a ``GrammarKey`` (what the request asked for: a JSON schema, a regex, an
EBNF grammar, a structural tag or "any JSON") into a compiled grammar, and hands out one
``GrammarMatcher`` per request. Every step the engine asks each constrained request's
matcher to fill its row of a batched token bitmask, applies the whole bitmask to the logits
in one op, samples, and feeds the batch's sampled tokens back in one ``accept_tokens`` call
(the default asks each matcher's ``accept_token`` in turn).

The bitmask layout is fixed by the engine, not by a library: ``int32[batch, ceil(V / 32)]``,
bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed (xgrammar and llguidance
both use it natively; a library with another format converts in ``fill_bitmask``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import EngineError

#: Grammar kinds a key may have: the names of the sampling parameters that carry them. OpenAI's
#: ``json_object`` is the schema ``{"type": "object"}``.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


class GrammarError(EngineError):
    """A grammar cannot be compiled; ``field`` names the request field it came from."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GrammarKey:
    """What a request constrains its output to; the compile cache's key."""

    #: one of ``GRAMMAR_KINDS``.
    kind: str
    #: the schema (JSON text), regex, EBNF text or structural-tag JSON.
    text: str

    @property
    def field(self) -> str:
        """The sampling parameter it came from (for error messages)."""
        return self.kind

    @classmethod
    def of(cls, sampling_params: Any) -> GrammarKey | None:
        """The key of a request's ``SamplingParams``, or None when it is unconstrained."""
        grammar = sampling_params.grammar
        return None if grammar is None else cls(*grammar)


@dataclass
class TokenizerInfo:
    """What a backend needs to know about the model's vocabulary."""

    #: the Hugging Face tokenizer (``PreTrainedTokenizerBase``); backends build their own
    #: token tables from it.
    tokenizer: Any
    #: width of the model's logits (may exceed the tokenizer's size: padded embeddings); the
    #: bitmask covers this many tokens and ids past the tokenizer's are never allowed.
    vocab_size: int
    #: the ids that end generation (EOS of config.json and generation_config.json): a grammar
    #: that is complete allows these.
    stop_token_ids: tuple[int, ...] = ()
    #: where the tokenizer came from (a cache key for backends that persist tables).
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class GrammarMatcher(abc.ABC):
    """One request's position in its grammar."""

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advances by one sampled token; False when the grammar does not allow it (the state
        is then unchanged)."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into ``bitmask[row]`` (``int32[B, ceil(V/32)]`` on the CPU):
        every word of the row, whatever it held before (the scheduler reuses the buffer)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has ended (a stop token was accepted after a complete match)."""

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens (only when the spec says
        ``supports_rollback``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back")

    @abc.abstractmethod
    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (parallel samples, speculative drafts)."""


class GrammarBackend(abc.ABC):
    """A structured-output library behind the engine's interface.

    ``compile`` runs on the engine's compile thread pool (it must be thread-safe); the
    engine caches what it returns by key, so a backend need not cache. ``validate`` runs in
    the HTTP process before a request is queued and should be cheap (no token tables).
    """

    def __init__(self, tokenizer_info: TokenizerInfo) -> None:
        self.tokenizer_info = tokenizer_info

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def validate(self, key: GrammarKey) -> None:
        """Raises ``GrammarError`` naming the problem when ``key`` cannot compile. The default
        compiles it."""
        self.compile(key)

    @abc.abstractmethod
    def compile(self, key: GrammarKey) -> Any:
        """The compiled grammar of ``key`` (opaque to the engine); ``GrammarError`` when invalid."""

    @abc.abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar."""

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fills ``bitmask[rows[i]]`` from ``matchers[i]``: one step of a whole batch. The default
        asks each matcher in turn; a library with a parallel batch fill overrides it."""
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)

    def accept_tokens(self, matchers: Sequence[GrammarMatcher], token_ids: Sequence[int]) -> list[bool]:
        """Feeds ``token_ids[i]`` to ``matchers[i]``: the sampled tokens of one step of a whole
        batch, one matcher per request (never the same matcher twice). Returns what each
        ``accept_token`` would: False where refused, that matcher's state then unchanged. The
        default asks each matcher in turn; a library with a batch acceptance overrides it."""
        if len(matchers) != len(token_ids):
            raise ValueError(f"accept_tokens: {len(matchers)} matchers but {len(token_ids)} token ids")
        return [matcher.accept_token(token_id) for matcher, token_id in zip(matchers, token_ids)]

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Sets the logits of disallowed tokens to -inf in place, for the whole batch at once
        (``bitmask`` already on ``logits``' device). A backend may use its library's kernel."""
        apply_token_bitmask(logits, bitmask)


# -- bitmask helpers (the engine's format) --------------------------------------------------
def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A CPU bitmask with every token allowed (pinned where the platform pins host buffers: it is
    copied to the device every step)."""
    from engine.platforms import pin_host_memory

    pin = pin_host_memory()
    return torch.full((batch_size, bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``bool[B, vocab_size]``: True where allowed."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The portable batched mask: one ``masked_fill_`` over ``logits[B, V]``. Columns past the
    bitmask's width (padded logits) are disallowed."""
    width = min(logits.shape[-1], bitmask.shape[-1] * 32)
    allowed = unpack_bitmask(bitmask, width)
    logits[:, :width].masked_fill_(~allowed, float("-inf"))
    if logits.shape[-1] > width:
        logits[:, width:] = float("-inf")


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a bitmask row allows (tests and debugging)."""
    return unpack_bitmask(bitmask_row.view(1, -1), vocab_size)[0].nonzero().view(-1).tolist()
