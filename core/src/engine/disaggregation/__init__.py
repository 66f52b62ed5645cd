"""Prefill/decode disaggregation (``--disaggregation-mode prefill|decode``).

A prefill server computes a prompt's KV and its first token, then hands the KV to the
transfer backend under the request's key; a decode server fetches that KV by the same key,
writes it into its own pool and continues the request from the first token. The router
(``engine.disaggregation.router``, ``engine router --prefill URL --decode URL``) sends each
request to one server of each kind with a shared ``bootstrap_room`` and streams the decode
server's answer. KV transfer is a plugin kind (``engine.disaggregation.transfer`` is the
contract; ``register_kv_transfer_backends`` / ``KvTransferSpec`` the hook).
docs/disaggregation.md explains the design.
"""

from engine.disaggregation.transfer import (
    KvLayout,
    KvPayload,
    KvTransferBackend,
    KvTransferContext,
    transfer_key,
)

__all__ = ["KvLayout", "KvPayload", "KvTransferBackend", "KvTransferContext", "transfer_key"]
