"""Typed facade over the pluggy plugin manager.

The rest of the engine calls these functions (``get_attention_backend``,
``get_model_class``, ``select_platform``...) and never ``pm.hook`` directly.

Discovery: every entry point in the group ``engine.plugins`` is a module (or
object) holding hook implementations. Loading is lazy, happens once per process
and per (allowlist, disabled) pair, and yields the same registry in every
process. Control:

- ``ENGINE_PLUGINS=a,b``: allowlist of plugin names (entry-point names) to load;
- ``ENGINE_DISABLE_PLUGINS=a,b`` or ``--disable-plugin a``: plugins not to load;
- a plugin that fails to import or to register is listed as broken with its error.

Selecting an unknown, broken or disabled implementation is a ``PluginError`` that
names what is installed; nothing falls back silently.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from engine import hookspecs
from engine.errors import PluginError, did_you_mean
from engine.hookspecs import (
    ENTRY_POINT_GROUP,
    SPEC_KINDS,
    AttentionBackendSpec,
    ModelSpec,
    PlatformSpec,
    PluginOption,
    QuantMethodSpec,
    SchedulePolicySpec,
    resolve_factory,
)

ALLOWLIST_ENV = "ENGINE_PLUGINS"
DISABLE_ENV = "ENGINE_DISABLE_PLUGINS"

# Distributions that provide the built-in names, for install hints in errors.
KNOWN_DISTRIBUTIONS: dict[tuple[str, str], str] = {
    ("attention", "torch_native"): "plugserve-attention-torch-native",
    ("attention", "triton"): "plugserve-attention-triton",
    ("attention", "flashinfer"): "plugserve-attention-flashinfer",
    ("platform", "cpu"): "plugserve-platform-cpu",
    ("platform", "cuda"): "plugserve-platform-cuda",
    ("quantization", "fp8"): "plugserve-quant-fp8",
    ("quantization", "w8a8_int8"): "plugserve-quant-int8",
}


@dataclass
class PluginInfo:
    """One discovered plugin (an entry point) and what it registered."""

    name: str
    distribution: str
    version: str
    status: str = "ok"  # ok | broken | disabled
    error: str = ""
    kinds: dict[str, list[str]] = field(default_factory=dict)  # kind -> registered names

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "error": self.error,
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
    ) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs.EngineHookSpecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.entries: dict[str, dict[str, Registered]] = {kind: {} for kind, _ in SPEC_KINDS.values()}
        # name collisions: kind -> name -> plugins that registered it
        self.conflicts: dict[str, dict[str, list[str]]] = {}
        self.disabled = frozenset(disabled)
        self.allowlist = frozenset(allowlist) if allowlist is not None else None
        if load_entry_points:
            self._load_entry_points()
        for name, obj in extra_plugins:
            self._register_object(name, obj, "(in-process)", "")
        self.pm.check_pending()
        self._collect()

    # -- discovery ---------------------------------------------------------
    def _load_entry_points(self) -> None:
        try:
            from importlib_metadata import entry_points
        except ImportError:  # the stdlib's is enough on Python >= 3.10
            from importlib.metadata import entry_points  # type: ignore[assignment]

        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            if ep.name in self.plugins:
                continue  # the same distribution seen twice on sys.path
            if ep.name in self.disabled or (self.allowlist is not None and ep.name not in self.allowlist):
                self.plugins[ep.name] = PluginInfo(ep.name, dist, version, status="disabled")
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # a broken plugin must not take the engine down
                self.plugins[ep.name] = PluginInfo(
                    ep.name, dist, version, status="broken", error=_one_line(exc)
                )
                continue
            self._register_object(ep.name, obj, dist, version)

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

                def register(spec: Any, _cls: type = spec_cls, _out: list[Any] = collected) -> None:
                    if not isinstance(spec, _cls):
                        raise TypeError(f"{hook_name} expects {_cls.__name__}, got {type(spec).__name__}")
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


def _raise(message: str) -> Any:
    raise PluginError(message)


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    if os.environ.get("ENGINE_DEBUG_PLUGINS"):
        text += " | " + traceback.format_exc().replace("\n", " | ")
    return text


# -- process-wide registry -------------------------------------------------
_lock = threading.Lock()
_registries: dict[tuple[frozenset[str], frozenset[str] | None], PluginRegistry] = {}


def get_registry(disabled: Iterable[str] = ()) -> PluginRegistry:
    """The registry for this process (loaded once per allowlist/disabled combination)."""
    dis = frozenset(disabled) | _split_env(os.environ.get(DISABLE_ENV))
    allow_env = os.environ.get(ALLOWLIST_ENV)
    allow = _split_env(allow_env) if allow_env is not None else None
    key = (dis, allow)
    with _lock:
        if key not in _registries:
            _registries[key] = PluginRegistry(disabled=dis, allowlist=allow)
        return _registries[key]


def reset_registry() -> None:
    """Forgets loaded registries (after installing or removing a plugin in-process)."""
    import importlib

    with _lock:
        _registries.clear()
    importlib.invalidate_caches()


# -- typed accessors -------------------------------------------------------
def attention_backends(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("attention")


def get_attention_backend(name: str, disabled: Iterable[str] = ()) -> AttentionBackendSpec:
    return get_registry(disabled).get("attention", name, "attention backend")


def quantization_methods(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("quantization")


def get_quantization_method(name: str, disabled: Iterable[str] = ()) -> QuantMethodSpec:
    return get_registry(disabled).get("quantization", name, "quantization method")


def find_quantization_for_checkpoint(method: str, disabled: Iterable[str] = ()) -> QuantMethodSpec:
    """The quant plugin that handles a checkpoint's ``quantization_config.quant_method``."""
    reg = get_registry(disabled)
    for entry in reg.entries["quantization"].values():
        if method == entry.spec.name or method in entry.spec.checkpoint_methods:
            return entry.spec
    return reg.get("quantization", method, "quantization method (from the checkpoint's quantization_config)")


def schedule_policies(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("policy")


def get_schedule_policy(name: str, disabled: Iterable[str] = ()) -> SchedulePolicySpec:
    return get_registry(disabled).get("policy", name, "schedule policy")


def model_architectures(disabled: Iterable[str] = ()) -> list[str]:
    reg = get_registry(disabled)
    return sorted({a for e in reg.entries["model"].values() for a in e.spec.architectures})


def get_model_spec(architecture: str, disabled: Iterable[str] = ()) -> ModelSpec:
    """The model plugin spec that implements a HF ``architectures`` name."""
    reg = get_registry(disabled)
    owners = [e for e in reg.entries["model"].values() if architecture in e.spec.architectures]
    if len(owners) > 1:
        names = ", ".join(e.plugin.name for e in owners)
        raise PluginError(f"architecture '{architecture}' is provided by several plugins ({names}); disable all but one with --disable-plugin")
    if owners:
        return owners[0].spec
    known = model_architectures(disabled)
    raise PluginError(
        f"no installed model plugin provides architecture '{architecture}'; "
        f"supported: {', '.join(known) or 'none'}{did_you_mean(architecture, known)}"
    )


def get_model_class(architecture: str, disabled: Iterable[str] = ()) -> Any:
    factory = resolve_factory(get_model_spec(architecture, disabled).factory)
    # A factory may be the class itself or a function(architecture) returning it.
    if isinstance(factory, type):
        return factory
    return factory(architecture)


def platforms(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("platform")


def get_platform_spec(name: str, disabled: Iterable[str] = ()) -> PlatformSpec:
    return get_registry(disabled).get("platform", name, "platform")


def plugin_options(disabled: Iterable[str] = ()) -> dict[str, PluginOption]:
    return {k: e.spec for k, e in get_registry(disabled).entries["option"].items()}


def select_platform(name: str | None = None, disabled: Iterable[str] = ()) -> Any:
    """Instantiates the platform to run on.

    With ``name`` the named platform must be available. Without it, exactly one
    non-fallback platform may claim the machine; a fallback one (cpu) is chosen only
    when none does; two claimants is an error that asks for ``--platform``.
    """
    reg = get_registry(disabled)
    if name is not None:
        spec = reg.get("platform", name, "platform")
        platform = resolve_factory(spec.factory)()
        if not platform.is_available():
            raise PluginError(f"platform '{name}' is not available on this machine: {platform.unavailable_reason()}")
        return platform
    claimants, fallbacks = [], []
    for entry in reg.entries["platform"].values():
        platform = resolve_factory(entry.spec.factory)()
        if platform.is_available():
            (fallbacks if entry.spec.fallback else claimants).append((entry.spec.name, platform))
    if len(claimants) > 1:
        names = ", ".join(n for n, _ in claimants)
        raise PluginError(f"several platforms claim this machine ({names}); choose one with --platform")
    if claimants:
        return claimants[0][1]
    if len(fallbacks) == 1:
        return fallbacks[0][1]
    if not fallbacks:
        raise PluginError(
            f"no available platform; installed: {', '.join(reg.names('platform')) or 'none'}; pip install plugserve-platform-cpu"
        )
    names = ", ".join(n for n, _ in fallbacks)
    raise PluginError(f"several fallback platforms ({names}); choose one with --platform")


def list_plugins(disabled: Iterable[str] = ()) -> list[PluginInfo]:
    return sorted(get_registry(disabled).plugins.values(), key=lambda p: p.name)
