"""The scheduler's side of LoRA adapters (docs/lora.md): which adapters are loaded, which
requests use them, loading and unloading at run time, and how many adapters a batch may hold.

Every loaded adapter has a load id (``uid``) besides its name; requests, the device slots and the
radix cache's namespaces know it by that id, so an adapter unloaded while requests still run on
it can be loaded again under the same name at once: the old one stays until its requests finish.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from engine.managers.io_struct import (
    LoadLoraAdapterReqInput,
    LoraAdapterReqOutput,
    UnloadLoraAdapterReqInput,
)

logger = logging.getLogger(__name__)


class LoraMixin:
    """Mixed into ``Scheduler``: ``self.runner.lora`` is the rank's ``LoraManager`` (None: off)."""

    runner: Any
    args: Any
    reqs: dict[str, Any]
    tree_cache: Any

    def _init_lora(self) -> None:
        #: name -> load id of the adapters requests may name.
        self.lora_names: dict[str, int] = {}
        #: load id -> (name, path, pinned), for every adapter held (draining ones included).
        self.lora_loaded: dict[int, tuple[str, str, bool]] = {}
        #: load ids unloaded by name, dropped once no request uses them.
        self.lora_draining: set[int] = set()
        #: load ids by recency of use (oldest first): --max-loaded-loras unloads from the front.
        self.lora_recent: OrderedDict[int, None] = OrderedDict()
        if self.runner.lora is None:
            return
        for name, path in self.args.lora_paths.items():
            reply = self.load_lora_adapter(LoadLoraAdapterReqInput(name, path, pinned=True))
            if not reply.success:
                from engine.errors import ConfigError

                raise ConfigError(f"--lora-paths {name}={path}: {reply.message}")

    # -- requests ---------------------------------------------------------------------
    def _attach_lora(self, req: Any, name: str | None) -> str | None:
        """Gives ``req`` its adapter's load id; the error when the adapter is not served."""
        if name is None:
            return None
        if self.runner.lora is None:
            return (f"lora_path {name!r}: this server serves no LoRA adapters; start it with --lora-paths "
                    "NAME=PATH or --enable-lora")
        uid = self.lora_names.get(name)
        if uid is None:
            loaded = ", ".join(sorted(self.lora_names)) or "none"
            return f"lora_path {name!r}: no adapter of that name is loaded; loaded: {loaded}"
        req.lora_name, req.lora_uid = name, uid
        self.lora_recent.move_to_end(uid)
        return None

    def _lora_in_use(self, uid: int) -> int:
        return sum(1 for r in self.reqs.values() if getattr(r, "lora_uid", None) == uid)

    def _lora_blocks(self, req: Any, batch_reqs: list[Any]) -> bool:
        """Whether admitting ``req`` next to ``batch_reqs`` (running and admitted) would put more
        than --max-loras-per-batch distinct adapters in one batch."""
        if req.lora_uid is None:
            return False
        used = {r.lora_uid for r in batch_reqs if r.lora_uid is not None}
        return req.lora_uid not in used and len(used) >= self.args.max_loras_per_batch

    # -- load and unload -------------------------------------------------------------------
    def load_lora_adapter(self, msg: LoadLoraAdapterReqInput) -> LoraAdapterReqOutput:
        reply = self._load_lora(msg)
        reply.token = msg.token
        return reply

    def _load_lora(self, msg: LoadLoraAdapterReqInput) -> LoraAdapterReqOutput:
        manager = self.runner.lora
        if manager is None:
            return self._lora_reply(False, "LoRA is off on this server; start it with --enable-lora (or --lora-paths)")
        if not msg.name or any(c.isspace() for c in msg.name):
            return self._lora_reply(False, f"lora_name {msg.name!r}: accepted: a non-empty name without spaces")
        if msg.name in self.lora_names:
            path = self.lora_loaded[self.lora_names[msg.name]][1]
            return self._lora_reply(False, f"lora_name {msg.name!r} is already loaded (from {path}); unload it first")
        limit = self.args.max_loaded_loras
        if limit is not None and len(self.lora_names) >= limit and not self._evict_one_lora():
            return self._lora_reply(False, f"--max-loaded-loras {limit}: every loaded adapter is pinned or in use; "
                                           "unload one first")
        from engine.errors import EngineError

        try:
            adapter = manager.load(msg.name, msg.path)
        except EngineError as exc:
            text = str(exc)
            return self._lora_reply(False, text if text.startswith("lora_path") else f"lora_path {msg.path!r}: {text}")
        self.lora_names[msg.name] = adapter.uid
        self.lora_loaded[adapter.uid] = (msg.name, msg.path, msg.pinned)
        self.lora_recent[adapter.uid] = None
        logger.info("LoRA adapter %r loaded from %s (rank %d, scaling %.4g)", msg.name, msg.path, adapter.rank,
                    adapter.scaling)
        return self._lora_reply(True, f"loaded {msg.name!r}")

    def unload_lora_adapter(self, msg: UnloadLoraAdapterReqInput) -> LoraAdapterReqOutput:
        uid = self.lora_names.pop(msg.name, None)
        if uid is None:
            loaded = ", ".join(sorted(self.lora_names)) or "none"
            reply = self._lora_reply(False, f"lora_name {msg.name!r}: no adapter of that name is loaded; loaded: {loaded}")
            reply.token = msg.token
            return reply
        self.lora_draining.add(uid)
        running = self._lora_in_use(uid)
        self._reap_loras()
        note = f"; it is dropped when its {running} running requests finish" if running else ""
        reply = self._lora_reply(True, f"unloaded {msg.name!r}{note}")
        reply.token = msg.token
        return reply

    def _evict_one_lora(self) -> bool:
        """Unloads the least recently used unpinned adapter no request uses; False if none."""
        for uid in list(self.lora_recent):
            name, _, pinned = self.lora_loaded[uid]
            if uid in self.lora_draining or pinned or self._lora_in_use(uid):
                continue
            self.lora_names.pop(name, None)
            self.lora_draining.add(uid)
            self._reap_loras()
            logger.info("LoRA adapter %r unloaded to make room (--max-loaded-loras %s)", name,
                        self.args.max_loaded_loras)
            return True
        return False

    def _reap_loras(self) -> None:
        """Drops the unloaded adapters whose last request has finished: host copy, device slot and
        cached prefixes."""
        for uid in [u for u in self.lora_draining if not self._lora_in_use(u)]:
            self.lora_draining.discard(uid)
            self.lora_loaded.pop(uid, None)
            self.lora_recent.pop(uid, None)
            self.runner.lora.unload(uid)
            drop = getattr(self.tree_cache, "drop_namespace", None)
            if drop is not None:
                drop(uid)

    def _lora_stats(self) -> dict[str, Any]:
        """LoRA counters for /get_server_info (none when LoRA is off): adapters loaded, those
        unloaded but still running, and the adapter in each device slot (None: empty)."""
        manager = self.runner.lora
        if manager is None:
            return {}
        names = {uid: entry[0] for uid, entry in self.lora_loaded.items()}
        return {"lora_adapters": {name: self.lora_loaded[uid][1] for name, uid in self.lora_names.items()},
                "lora_draining": sorted(names[uid] for uid in self.lora_draining),
                "lora_slots": [names.get(uid) if uid is not None else None for uid in manager.slot_uid]}

    def _lora_reply(self, success: bool, message: str) -> LoraAdapterReqOutput:
        loaded = {name: self.lora_loaded[uid][1] for name, uid in self.lora_names.items()}
        return LoraAdapterReqOutput(success=success, message=message, loaded=loaded)
