"""The KV transfer contract between a prefill server and a decode server.

One ``KvTransferBackend`` runs per scheduler rank. On a prefill server (role ``prefill``) the
scheduler ``publish``es each finished prompt's KV (a ``KvPayload`` in host memory) under the
request's key and the backend serves it to the decode server that asks for that key; on a
decode server (role ``decode``) the scheduler ``fetch``es a key from the prefill server named
in the request and collects finished fetches with ``poll``. Both sides compare ``KvLayout``s
at the handshake: a fetch whose layout differs from the prefill server's fails naming both.

Every operation is non-blocking except ``poll(wait_s)``; every fetch ends (payload, error or
time-out) by its deadline, so a dead peer never hangs a request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROLES = ("prefill", "decode")

#: Pinned host memory (bytes) a GPU prefill server takes at start-up for the host payloads its
#: backend holds until sent, unless the backend sets ``host_pool_bytes`` (the ``host_pool_gb``
#: option of the ``zmq`` and ``torch`` plugins defaults to it): four 4,096-token prompts of an
#: 8B model with 8 KV heads.
HOST_POOL_BYTES = 2 << 30
#: Seconds a payload that finds that pool full waits at most for the backend to let one go,
#: before it takes fresh pinned memory (the wait paces the copies to a slow transfer; a decode
#: server that stopped fetching must not hold the prefill side up for longer).
HOST_POOL_WAIT_S = 0.5


def transfer_key(bootstrap_room: int, rid: str) -> str:
    """The key both servers name one request's KV by: the router's room and the request id
    (both servers expand ``n`` > 1 and batches into the same ids)."""
    return f"{bootstrap_room}:{rid}"


@dataclass(frozen=True)
class KvLayout:
    """What the bytes of one token's KV mean on one side: both sides must agree on all but
    ``page_size`` (tokens travel one by one, so page sizes may differ)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str
    tp_size: int = 1
    page_size: int = 1
    #: the KV pool's kind: "mha" (K and V per head) or "mla" (one latent row; ``v`` is empty).
    kv_layout: str = "mha"

    def mismatch(self, other: KvLayout) -> str | None:
        """Why KV of ``other``'s layout cannot be written into this one (None: it can)."""
        mine, theirs = asdict(self), asdict(other)
        diffs = [f"{k} {theirs[k]} vs {mine[k]}" for k in mine if k != "page_size" and mine[k] != theirs[k]]
        return "; ".join(diffs) or None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KvLayout:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass
class KvPayload:
    """One request's prompt KV in host memory, and the first token the prefill server sampled.

    ``k``: ``[num_layers, num_tokens, num_kv_heads, head_dim]``; ``v`` likewise with
    ``v_head_dim``; both in the KV pool's storage dtype (fp8 pools travel as stored). An "mla"
    pool's V is the leading dims of its K rows: ``v`` is ``[num_layers, num_tokens, 1, 0]`` and
    only K travels. ``meta``
    is JSON-able (the prompt's length; with logprobs, the first token's and the prompt's) and
    must arrive as sent, up to tuples becoming lists.
    """

    first_token: int
    k: torch.Tensor
    v: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass
class KvTransferContext:
    """What a backend is built with (``KvTransferSpec.factory(ctx, options=...)``)."""

    role: str  # "prefill" or "decode"
    layout: KvLayout
    # Prefill: the address the backend listens on for decode servers (--host,
    # --disaggregation-bootstrap-port). Decode: unused (0).
    host: str = "127.0.0.1"
    port: int = 0
    # Seconds a published payload waits for its fetch, and a fetch for its payload.
    timeout_s: float = 60.0
    # The KV pool's device ("cpu", "cuda:0", ...): payloads are host tensors either way.
    device: str = "cpu"
    # The name the backend was selected by (--disaggregation-transfer-backend). Both servers
    # must use the same; a backend compares the two at the handshake ("": unknown, not compared).
    backend: str = ""


class KvTransferBackend(ABC):
    """Moves ``KvPayload``s from a prefill server's rank to a decode server's rank."""

    #: Pinned host memory (bytes) a GPU prefill server takes at start-up for the host payloads
    #: this backend holds until sent (None: ``HOST_POOL_BYTES``; 0: none, every payload
    #: takes fresh memory). Backends whose payloads stay on the device ignore it.
    host_pool_bytes: int | None = None

    def __init__(self, ctx: KvTransferContext) -> None:
        self.ctx = ctx

    # -- prefill side ----------------------------------------------------------------
    @abstractmethod
    def publish(self, key: str, payload: KvPayload) -> None:
        """Offers ``payload`` under ``key`` until a decode server fetches it or
        ``ctx.timeout_s`` passes (then it is dropped). Returns at once."""

    @abstractmethod
    def discard(self, key: str) -> None:
        """Drops a published payload nobody will fetch (unknown keys are ignored)."""

    # -- decode side -----------------------------------------------------------------
    @abstractmethod
    def fetch(self, key: str, host: str, port: int, timeout_s: float) -> None:
        """Starts fetching ``key`` from the prefill server's backend at ``host:port``; its
        result comes from ``poll`` within ``timeout_s`` seconds. Returns at once."""

    @abstractmethod
    def cancel(self, key: str) -> None:
        """Abandons a fetch (its request was aborted); the prefill side may drop the payload.
        No result for ``key`` is returned by ``poll`` afterwards."""

    @abstractmethod
    def poll(self, wait_s: float = 0.0) -> list[tuple[str, KvPayload | str]]:
        """Finished fetches: ``(key, payload)``, or ``(key, error message)`` for a fetch that
        failed (layout mismatch, time-out, peer error). Waits up to ``wait_s`` for the first."""

    # -- both ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for /get_server_info (bytes moved, transfers, failures)."""
        return {}

    def close(self) -> None:  # noqa: B027 (optional: a backend holding nothing keeps it)
        """Stops the backend's threads and sockets (idempotent)."""
