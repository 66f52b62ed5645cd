"""The proposer interface of speculative decoding (the ``speculative`` plugin kind).

A proposer guesses the next few tokens of each running request; the core checks the guesses
against the target model in one forward and keeps the longest prefix the target agrees with
(``engine.speculative.verify``). A proposer is never trusted: whatever it returns, the output
is the target's (greedy: token for token; sampling: in distribution). A good proposer only
makes decoding faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

#: Why a request left the proposer's view (``Proposer.release``): it ended normally (EOS, a stop
#: condition, ``max_new_tokens``), it was aborted (by the client, a disconnect, an error), or it
#: was retracted to free KV memory (it comes back later under the same ``rid`` and is prefilled
#: again from its prompt and output so far).
ReleaseReason = Literal["finished", "aborted", "retracted"]


@dataclass
class DraftTree:
    """Draft tokens with parent links (topological order: a parent comes before its children)."""

    tokens: list[int]
    parents: list[int]  # parents[i]: index into tokens of node i's parent, or -1 = the request's last token


@dataclass
class DraftRequest:
    """What a proposer sees of one running request."""

    #: request id (stable over the request's life; retraction keeps it).
    rid: str
    #: the prompt tokens.
    prompt_ids: Sequence[int]
    #: tokens generated so far; the last one has been sampled but not yet fed to the target.
    output_ids: Sequence[int]
    #: most draft tokens wanted for this request this step (0: propose nothing).
    max_draft: int


@dataclass
class RequestEnd:
    """A request that ended (``Proposer.on_request_end``): what it was asked and what it answered."""

    #: request id (the same one ``propose`` saw).
    rid: str
    #: the prompt tokens.
    prompt_ids: Sequence[int]
    #: every token the request generated (its final output; after an abort, what it had so far).
    output_ids: Sequence[int]
    #: ``"finished"`` or ``"aborted"`` (a retraction is not an end: the request resumes).
    reason: ReleaseReason
    #: the finish reason as the API reports it (``{"type": "stop" | "length" | "abort", ...}``).
    finish_reason: dict[str, Any] | None = None


@dataclass
class ProposerContext:
    """Built once per scheduler process and handed to the proposer's factory."""

    #: ``--speculative-num-steps``: draft depth (model-based proposers run this many steps).
    num_steps: int
    #: most draft tokens verified per request and step (a chain: ``num_draft_tokens - 1``
    #: drafts after the last accepted token).
    num_draft_tokens: int
    #: ``--speculative-eagle-topk``: branching of tree proposers (1 = a chain).
    eagle_topk: int
    #: the target model's vocabulary size (draft ids must be below it).
    vocab_size: int
    #: the target's device (``torch.device``).
    device: Any
    #: the target's checkpoint directory and ``--speculative-draft-model-path`` (or None).
    target_model_path: str
    draft_model_path: str | None = None
    #: the server's ``ServerArgs`` (read-only), for proposers that build a model of their own.
    server_args: Any = None
    #: the target's ``ModelRunner`` (read-only; EAGLE-style proposers read its weights).
    target_runner: Any = None
    #: free-form extras.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TargetHidden:
    """The target's hidden states of one request from one target forward, at positions whose KV
    was kept (prefill chunks, plain decode steps, and the accepted part of a verify step)."""

    rid: str
    #: position of the first row.
    start: int
    #: ``[n, D]``: positions ``start .. start + n - 1``; ``D`` is the hidden size, or three times
    #: it for EAGLE-3 layer outputs (``Proposer.target_hidden_layers``).
    hidden: Any


class Proposer:
    """Base class of proposers. Subclasses implement ``propose``; the rest is optional."""

    #: Which hidden states of the target the proposer reads, when its spec sets
    #: ``needs_hidden_states``: ``()`` the LM head's input (the final hidden states, EAGLE-1/2),
    #: decoder layer ids: those layers' outputs concatenated (EAGLE-3). Read once, after the
    #: factory returns; the core then hands them over through ``on_target_hidden``.
    target_hidden_layers: tuple[int, ...] = ()

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int] | DraftTree]:
        """Draft tokens for each request: one entry per request, in order, each at most
        ``req.max_draft`` tokens (an empty list proposes nothing for that request).

        An entry is a chain (a list: element 0 is the guess for the token after
        ``output_ids[-1]``, element 1 the token after that, ...) or a ``DraftTree`` (several
        guesses per position; a chain is the tree with ``parents == [-1, 0, 1, ...]``). Trees
        are verified with a tree attention mask where the attention backend has one
        (``supports_tree_mask``); elsewhere each tree is cut to its longest root-to-leaf chain.
        """
        raise NotImplementedError

    def on_verified(self, reqs: Sequence[DraftRequest], num_accepted: Sequence[int]) -> None:
        """Called after verification: ``num_accepted[i]`` drafts of request i were kept (the
        target then added one token of its own). Model-based proposers roll their KV back here."""

    def on_target_hidden(self, states: Sequence[TargetHidden]) -> None:
        """After each target forward (only for a spec with ``needs_hidden_states``): the
        hidden states of the positions it computed and kept, per request. A request's states
        arrive in position order; a start at or before positions already received replaces
        them from there on (a request retracted and prefilled again); a start past them means
        a gap (a prefix-cache hit: the cached prefix was not computed)."""

    def release(self, rid: str, reason: ReleaseReason = "finished") -> None:
        """The request left the running batch: it finished, was aborted, or was retracted
        (``reason``); drop any state kept for it. Called once for every request that ends and
        once per retraction, also for requests that were never proposed for (one that finished
        in its prefill, or ran only in batches above ``--speculative-max-batch-size``), so look
        ``rid`` up with a default. A retracted request comes back under the same ``rid``.

        A proposer written before ``reason`` existed (``release(self, rid)``) is called without
        it (since hook API 6)."""

    def on_request_end(self, end: RequestEnd) -> None:
        """A request ended (finished or aborted), with its prompt and final output: a proposer
        that learns across requests (a suffix index of past outputs) adds them here. Called
        once per request, before ``release(rid, reason)``. Since hook API 6."""


__all__ = ["DraftRequest", "DraftTree", "Proposer", "ProposerContext", "ReleaseReason", "RequestEnd", "TargetHidden"]
