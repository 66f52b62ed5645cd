"""The plugin registry: what the installed plugins registered, by kind and name.

``engine.plugins`` (the facade the rest of the engine calls) keeps one ``PluginRegistry`` per
process and per allowlist/disabled combination; this module holds the registry itself, the record
of each discovered plugin (``PluginInfo``) and the install hints for built-in names
(``KNOWN_DISTRIBUTIONS``). ``PluginRegistry``, ``PluginInfo`` and the two environment
variables' names can be imported from ``engine.plugins`` too.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

import engine.hookspecs as hookspecs
from engine.errors import PluginError, did_you_mean
from engine.hookspecs import ENTRY_POINT_GROUP, SPEC_KINDS, PluginOption

ALLOWLIST_ENV = "ENGINE_PLUGINS"
DISABLE_ENV = "ENGINE_DISABLE_PLUGINS"

# Distributions that provide the built-in names, for install hints in errors.
KNOWN_DISTRIBUTIONS: dict[tuple[str, str], str] = {
    ("attention", "torch_native"): "plugserve-attention-torch-native",
    ("attention", "triton"): "plugserve-attention-triton",
    ("attention", "flashinfer"): "plugserve-attention-flashinfer",
    ("platform", "cpu"): "plugserve-platform-cpu",
    ("platform", "cuda"): "plugserve-platform-cuda",
    ("platform", "rocm"): "plugserve-platform-rocm",
    ("platform", "xpu"): "plugserve-platform-xpu",
    ("platform", "npu"): "plugserve-platform-npu",
    ("quantization", "fp8"): "plugserve-quant-fp8",
    ("quantization", "w8a8_int8"): "plugserve-quant-int8",
    ("grammar", "xgrammar"): "plugserve-grammar-xgrammar",
    ("grammar", "llguidance"): "plugserve-grammar-llguidance",
    ("tool-parser", "hermes"): "plugserve-toolparser-hermes",
    ("tool-parser", "llama3"): "plugserve-toolparser-llama3",
    ("tool-parser", "mistral"): "plugserve-toolparser-mistral",
    ("reasoning-parser", "qwen3"): "plugserve-reasoning-qwen3",
    ("reasoning-parser", "deepseek-r1"): "plugserve-reasoning-deepseek-r1",
    ("router", "cache-aware"): "plugserve-router-policies",
    ("router", "round-robin"): "plugserve-router-policies",
    ("router", "shortest-queue"): "plugserve-router-policies",
    ("speculative", "ngram"): "plugserve-spec-ngram",
    ("speculative", "draft"): "plugserve-spec-draft",
    ("lora-backend", "torch_native"): "plugserve-lora-torch-native",
    ("lora-backend", "triton"): "plugserve-lora-triton",
    ("kv-transfer", "zmq"): "plugserve-kvtransfer-zmq",
    ("kv-transfer", "torch"): "plugserve-kvtransfer-torch",
    ("kv-tier", "host"): "plugserve-kvtier-host",
    ("kv-tier", "file"): "plugserve-kvtier-file",
}


@dataclass
class PluginInfo:
    """One discovered plugin (an entry point) and what it registered."""

    name: str
    distribution: str
    version: str
    status: str = "ok"  # ok | broken | disabled
    error: str = ""
    # what disabled it, for errors: "--disable-plugin NAME", "ENGINE_DISABLE_PLUGINS=...", ...
    disabled_by: str = ""
    kinds: dict[str, list[str]] = field(default_factory=dict)  # kind -> registered names

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "error": self.error,
            "disabled_by": self.disabled_by,
            "registers": self.kinds,
        }


@dataclass
class Registered:
    spec: Any
    plugin: PluginInfo


def _split_env(value: str | None) -> frozenset[str]:
    return frozenset(p.strip() for p in (value or "").split(",") if p.strip())


class PluginRegistry:
    """Everything the installed plugins registered, by kind and name."""

    def __init__(
        self,
        disabled: Iterable[str] = (),
        allowlist: Iterable[str] | None = None,
        extra_plugins: Iterable[tuple[str, Any]] = (),
        load_entry_points: bool = True,
        env_disabled: Iterable[str] = (),
    ) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs.EngineHookSpecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.entries: dict[str, dict[str, Registered]] = {kind: {} for kind, _ in SPEC_KINDS.values()}
        # name collisions: kind -> name -> plugins that registered it
        self.conflicts: dict[str, dict[str, list[str]]] = {}
        # --disable-plugin and ENGINE_DISABLE_PLUGINS are kept apart only to say which one disabled a plugin.
        self.env_disabled = frozenset(env_disabled)
        self.disabled = frozenset(disabled) | self.env_disabled
        self.allowlist = frozenset(allowlist) if allowlist is not None else None
        self._shadow: PluginRegistry | None = None
        if load_entry_points:
            self._load_entry_points()
        for name, obj in extra_plugins:
            self._register_object(name, obj, "(in-process)", "")
        self.pm.check_pending()
        self._collect()

    # -- discovery ---------------------------------------------------------
    def _load_entry_points(self) -> None:
        from importlib_metadata import entry_points

        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if ep.name in self.plugins:
                continue  # the same distribution seen twice on sys.path
            try:
                dist = ep.dist.name if ep.dist else "?"
                version = ep.dist.version if ep.dist else "?"
            except Exception as exc:  # its metadata vanished: a pip (un)install running right now
                self.plugins[ep.name] = PluginInfo(ep.name, "?", "?", status="broken",
                                                   error=f"unreadable package metadata: {_one_line(exc)}")
                continue
            why = self._disabled_reason(ep.name)
            if why:
                self.plugins[ep.name] = PluginInfo(ep.name, dist, version, status="disabled", disabled_by=why)
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # a broken plugin must not take the engine down
                self.plugins[ep.name] = PluginInfo(
                    ep.name, dist, version, status="broken", error=_one_line(exc)
                )
                continue
            self._register_object(ep.name, obj, dist, version)

    def _disabled_reason(self, name: str) -> str:
        if name in self.env_disabled:
            return f"{DISABLE_ENV}={','.join(sorted(self.env_disabled))}"
        if name in self.disabled:  # the rest of ``disabled`` came from --disable-plugin
            return f"--disable-plugin {name}"
        if self.allowlist is not None and name not in self.allowlist:
            return f"not in {ALLOWLIST_ENV}={','.join(sorted(self.allowlist))}"
        return ""

    def _register_object(self, name: str, obj: Any, dist: str, version: str) -> None:
        info = PluginInfo(name, dist, version)
        try:
            self.pm.register(obj, name=name)
        except Exception as exc:
            info.status, info.error = "broken", _one_line(exc)
        self.plugins[name] = info

    def _collect(self) -> None:
        for spec_cls, (kind, hook_name) in SPEC_KINDS.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                info = self.plugins[impl.plugin_name]
                if info.status != "ok":
                    continue
                collected: list[Any] = []

                def register(spec: Any, _cls: type = spec_cls, _out: list[Any] = collected,
                             _owner: str = info.name) -> None:
                    if not isinstance(spec, _cls):
                        raise TypeError(f"{hook_name} expects {_cls.__name__}, got {type(spec).__name__}")
                    if isinstance(spec, PluginOption) and spec.plugin != _owner:
                        # Options reach the factories of the plugin named here; a foreign name reaches nobody.
                        raise ValueError(f"option '{spec.plugin}.{spec.key}' must be declared under this "
                                         f"plugin's own name '{_owner}'")
                    _out.append(spec)

                kwargs = {"register": register}
                try:
                    impl.function(*[kwargs[a] for a in impl.argnames])
                except Exception as exc:
                    info.status, info.error = "broken", f"{hook_name}: {_one_line(exc)}"
                    self._forget(info)
                    continue
                for spec in collected:
                    self._add(kind, spec, info)

    def _add(self, kind: str, spec: Any, info: PluginInfo) -> None:
        key = f"{spec.plugin}.{spec.key}" if isinstance(spec, PluginOption) else spec.name
        existing = self.entries[kind].get(key)
        if existing is not None and existing.plugin.name != info.name:
            self.conflicts.setdefault(kind, {}).setdefault(key, [existing.plugin.name]).append(info.name)
        self.entries[kind][key] = Registered(spec, info)
        info.kinds.setdefault(kind, []).append(key)

    def _forget(self, info: PluginInfo) -> None:
        for kind, names in info.kinds.items():
            for name in names:
                self.entries[kind].pop(name, None)
        info.kinds.clear()

    # -- lookup ------------------------------------------------------------
    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def get(self, kind: str, name: str, label: str) -> Any:
        """The spec registered under ``name``, or a ``PluginError`` naming what is installed."""
        if name in self.conflicts.get(kind, {}):
            owners = ", ".join(self.conflicts[kind][name])
            raise PluginError(f"{label} '{name}' is registered by several plugins ({owners}); disable all but one with --disable-plugin")
        entry = self.entries[kind].get(name)
        if entry is not None:
            return entry.spec
        installed = self.names(kind)
        hint = did_you_mean(name, installed + [n for (k, n) in KNOWN_DISTRIBUTIONS if k == kind])
        disabled_owner = self.disabled_provider(kind, lambda spec: spec.name == name)
        if disabled_owner is not None:
            raise PluginError(f"{label} '{name}' is provided by plugin {disabled_owner.name!r} "
                              f"({disabled_owner.distribution} {disabled_owner.version}), which is disabled "
                              f"({disabled_owner.disabled_by})")
        dist = KNOWN_DISTRIBUTIONS.get((kind, name))
        unusable = [p for p in self.plugins.values() if p.status != "ok" and dist and p.distribution == dist]
        if unusable:
            p = unusable[0]
            why = f"broken: {p.error}" if p.status == "broken" else "disabled"
            raise PluginError(f"{label} '{name}' comes from plugin '{p.name}', which is {why}")
        install = f"; pip install {dist}" if dist else ""
        broken = [p.name for p in self.plugins.values() if p.status == "broken"]
        broken_note = f"; broken plugins: {', '.join(broken)} (see 'engine plugins list')" if broken else ""
        return _raise(
            f"unknown {label} '{name}'; installed: {', '.join(installed) or 'none'}{hint}{install}{broken_note}"
        )

    def disabled_provider(self, kind: str, matches: Any) -> PluginInfo | None:
        """The disabled plugin that would register a ``kind`` spec for which ``matches(spec)``.

        Disabled plugins are not loaded for running; only when an error needs to say who
        provides a name are they loaded, once, into a separate registry (registration is
        cheap by contract). Returns None when no disabled plugin provides it.
        """
        disabled = [p.name for p in self.plugins.values() if p.status == "disabled"]
        if not disabled:
            return None
        if self._shadow is None:
            try:
                self._shadow = PluginRegistry(allowlist=disabled)
            except Exception:  # a disabled plugin may well be unloadable: then nobody is named
                return None
        for entry in self._shadow.entries[kind].values():
            if matches(entry.spec):
                return self.plugins[entry.plugin.name]
        return None

    def provider(self, kind: str, name: str) -> PluginInfo | None:
        """The plugin that registered ``name`` (None for an unregistered name)."""
        entry = self.entries[kind].get(name)
        return entry.plugin if entry is not None else None

    def options_for(self, plugin: str, plugin_options: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """``plugin``'s declared option defaults, overridden by the user's ``plugin_options``."""
        declared = {e.spec.key: e.spec.default for e in self.entries["option"].values() if e.spec.plugin == plugin}
        return {**declared, **dict(plugin_options.get(plugin) or {})}


def _raise(message: str) -> Any:
    raise PluginError(message)


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    if os.environ.get("ENGINE_DEBUG_PLUGINS"):
        text += " | " + traceback.format_exc().replace("\n", " | ")
    return text
