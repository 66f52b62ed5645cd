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
names what is installed (for a disabled plugin: which plugin and distribution would
provide it, and what disabled it); nothing falls back silently. ``options_for`` gives
a plugin's options (declared defaults overridden by the user's) to its factories.

The registry itself (``PluginRegistry``, ``PluginInfo``) lives in ``engine.plugin_registry``;
both can be imported from here too.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from engine.errors import ConfigError, PluginError, did_you_mean
from engine.hookspecs import (
    ENTRY_POINT_GROUP,
    AttentionBackendSpec,
    Factory,
    GrammarBackendSpec,
    KvStorageTierSpec,
    KvTransferSpec,
    LoraBackendSpec,
    ModelSpec,
    PlatformSpec,
    PluginOption,
    QuantMethodSpec,
    ReasoningParserSpec,
    RouterPolicySpec,
    SchedulePolicySpec,
    SpeculativeAlgorithmSpec,
    ToolCallParserSpec,
    call_with_accepted,
    resolve_factory,
)
from engine.plugin_registry import (
    ALLOWLIST_ENV,
    DISABLE_ENV,
    PluginInfo,
    PluginRegistry,
    _one_line,
    _split_env,
)

# -- process-wide registry -------------------------------------------------
_lock = threading.Lock()
_registries: dict[tuple[frozenset[str], frozenset[str], frozenset[str] | None, tuple[str, ...]], PluginRegistry] = {}
_installed: dict[str, tuple[str, str]] | None = None
#: plugin objects added in-process (``in_process_plugins``), loaded after the entry points.
_in_process: list[tuple[str, Any]] = []


def get_registry(disabled: Iterable[str] = ()) -> PluginRegistry:
    """The registry for this process (loaded once per allowlist/disabled combination and set of
    in-process plugins)."""
    dis = frozenset(disabled)
    env = _split_env(os.environ.get(DISABLE_ENV))
    allow_env = os.environ.get(ALLOWLIST_ENV)
    allow = _split_env(allow_env) if allow_env is not None else None
    with _lock:
        key = (dis, env, allow, tuple(name for name, _ in _in_process))
        if key not in _registries:
            _registries[key] = PluginRegistry(disabled=dis, allowlist=allow, env_disabled=env,
                                              extra_plugins=list(_in_process))
        return _registries[key]


@contextlib.contextmanager
def in_process_plugins(*plugins: tuple[str, Any]) -> Iterator[None]:
    """Inside the block, every registry also holds ``plugins``: ``(name, object)`` pairs whose
    objects carry hook implementations, as an entry point's module would (a benchmark's own
    proposer, say). Lookups, start-up checks and factories then take the ordinary path; after the
    block the registries are as before."""
    with _lock:
        _in_process.extend(plugins)
    try:
        yield
    finally:
        names = {name for name, _ in plugins}
        with _lock:
            _in_process[:] = [p for p in _in_process if p[0] not in names]
            for key in [k for k in _registries if names & set(k[3])]:
                del _registries[key]


def installed_plugins() -> dict[str, tuple[str, str]]:
    """Entry-point name -> (distribution, version) of every installed plugin, none of them loaded."""
    global _installed
    with _lock:
        if _installed is None:
            from importlib_metadata import entry_points

            _installed = {ep.name: (ep.dist.name if ep.dist else "?", ep.dist.version if ep.dist else "?")
                          for ep in entry_points(group=ENTRY_POINT_GROUP)}
        return dict(_installed)


def check_plugin_names(names: Iterable[str], label: str) -> None:
    """Each of ``names`` must name an installed plugin (``label`` names the flag in the error)."""
    resolve_plugin_names(names, label)


def resolve_plugin_names(names: Iterable[str], label: str) -> list[str]:
    """The plugin (entry-point) names ``names`` stand for: a plugin's own name, or the name users
    select one of its implementations by (``hermes`` for the plugin ``toolparser_hermes``, which
    ``--tool-call-parser hermes`` selects) when exactly one plugin registers that name. Anything
    else is a ``PluginError`` naming ``label``, the installed plugins and the closest match."""
    installed = installed_plugins()
    out: list[str] = []
    for name in names:
        if name in installed:
            out.append(name)
            continue
        # Registration is cheap (no implementation is imported): load every plugin's names.
        reg = get_registry(())
        owners = sorted({entry.plugin.name for by_name in reg.entries.values()
                         for n, entry in by_name.items() if n == name})
        if len(owners) == 1:
            out.append(owners[0])
            continue
        if len(owners) > 1:
            raise PluginError(f"{label}: '{name}' is registered by several plugins ({', '.join(owners)}); "
                              "name the plugin")
        known = set(installed) | {n for by_name in reg.entries.values() for n in by_name}
        raise PluginError(f"{label}: unknown plugin '{name}'; installed: {', '.join(sorted(installed)) or 'none'}"
                          f"{did_you_mean(name, known)}")
    return out


def reset_registry() -> None:
    """Forgets loaded registries (after installing or removing a plugin in-process)."""
    import importlib

    global _installed
    with _lock:
        _registries.clear()
        _installed = None
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
    off = reg.disabled_provider("model", lambda spec: architecture in spec.architectures)
    if off is not None:
        raise PluginError(f"architecture '{architecture}' is provided by plugin {off.name!r} "
                          f"({off.distribution} {off.version}), which is disabled ({off.disabled_by})")
    known = model_architectures(disabled)
    raise PluginError(
        f"no installed model plugin provides architecture '{architecture}'; "
        f"supported: {', '.join(known) or 'none'}{did_you_mean(architecture, known)}"
    )


def get_model_class(architecture: str, disabled: Iterable[str] = ()) -> Any:
    return model_class_of(get_model_spec(architecture, disabled), architecture)


def model_class_of(spec: ModelSpec, architecture: str) -> Any:
    """The class a model spec builds for ``architecture``."""
    factory = resolve_factory(spec.factory)
    # A factory may be the class itself or a function(architecture) returning it.
    if isinstance(factory, type):
        return factory
    return factory(architecture)


def platforms(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("platform")


def get_platform_spec(name: str, disabled: Iterable[str] = ()) -> PlatformSpec:
    return get_registry(disabled).get("platform", name, "platform")


def grammar_backends(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("grammar")


def get_grammar_backend(name: str, disabled: Iterable[str] = ()) -> GrammarBackendSpec:
    return get_registry(disabled).get("grammar", name, "grammar backend")


def create_grammar_backend(name: str, tokenizer_info: Any, disabled: Iterable[str] = (),
                           plugin_options: dict[str, dict[str, Any]] | None = None) -> Any:
    """An ``engine.constrained.GrammarBackend`` instance of the grammar backend ``name``,
    built for ``tokenizer_info`` with its plugin's options (hook API 4)."""
    reg = get_registry(disabled)
    spec = reg.get("grammar", name, "grammar backend")
    entry = reg.entries["grammar"][name]
    return create(spec.factory, tokenizer_info, options=reg.options_for(entry.plugin.name, plugin_options or {}))


def router_policies(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("router")


def get_router_policy(name: str, disabled: Iterable[str] = ()) -> RouterPolicySpec:
    return get_registry(disabled).get("router", name, "router policy")


def create_router_policy(name: str, num_replicas: int, disabled: Iterable[str] = (),
                         plugin_options: dict[str, dict[str, Any]] | None = None) -> Any:
    """An ``engine.router.RouterPolicy`` of the router policy ``name`` for ``num_replicas``
    replicas, built with its plugin's options (hook API 4)."""
    reg = get_registry(disabled)
    spec = reg.get("router", name, "router policy")
    entry = reg.entries["router"][name]
    return create(spec.factory, num_replicas, options=reg.options_for(entry.plugin.name, plugin_options or {}))


def tool_call_parsers(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("tool-parser")


def get_tool_call_parser(name: str, disabled: Iterable[str] = ()) -> ToolCallParserSpec:
    return get_registry(disabled).get("tool-parser", name, "tool-call parser")


def create_tool_call_parser(name: str, disabled: Iterable[str] = (),
                            plugin_options: dict[str, dict[str, Any]] | None = None) -> Any:
    """The ``engine.parsers.ToolCallParser`` registered as ``name``, built with its plugin's options."""
    return _create_parser("tool-parser", name, "tool-call parser", disabled, plugin_options)


def reasoning_parsers(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("reasoning-parser")


def get_reasoning_parser(name: str, disabled: Iterable[str] = ()) -> ReasoningParserSpec:
    return get_registry(disabled).get("reasoning-parser", name, "reasoning parser")


def create_reasoning_parser(name: str, disabled: Iterable[str] = (),
                            plugin_options: dict[str, dict[str, Any]] | None = None) -> Any:
    """The ``engine.parsers.ReasoningParser`` registered as ``name``, built with its plugin's options."""
    return _create_parser("reasoning-parser", name, "reasoning parser", disabled, plugin_options)


def speculative_algorithms(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("speculative")


def get_speculative_algorithm(name: str, disabled: Iterable[str] = ()) -> SpeculativeAlgorithmSpec:
    return get_registry(disabled).get("speculative", name, "speculative algorithm")


def create_proposer(name: str, ctx: Any, disabled: Iterable[str] = (),
                    plugin_options: dict[str, dict[str, Any]] | None = None) -> Any:
    """The ``engine.speculative.Proposer`` of the speculative algorithm ``name``, built for
    ``ctx`` (an ``engine.speculative.ProposerContext``) with its plugin's options (hook API 5)."""
    reg = get_registry(disabled)
    spec = reg.get("speculative", name, "speculative algorithm")
    entry = reg.entries["speculative"][name]
    return create(spec.factory, ctx, options=reg.options_for(entry.plugin.name, plugin_options or {}))


def lora_backends(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("lora-backend")


def get_lora_backend(name: str, disabled: Iterable[str] = ()) -> LoraBackendSpec:
    return get_registry(disabled).get("lora-backend", name, "LoRA backend")


def default_lora_backend(device_type: str, disabled: Iterable[str] = ()) -> str:
    """``--lora-backend auto``: ``triton`` on CUDA and ROCm devices where it is installed (and
    enabled), else ``torch_native``."""
    names = lora_backends(disabled)
    if device_type in ("cuda", "rocm", "hip") and "triton" in names:
        return "triton"
    return "torch_native"


def create_lora_backend(name: str, device_type: str, disabled: Iterable[str] = (),
                        plugin_options: dict[str, dict[str, Any]] | None = None) -> Any:
    """The ``engine.lora.backend.LoraBackend`` of the LoRA backend ``name`` (``auto`` chooses by
    device type), built with its plugin's options (hook API 7). A backend that does not list
    ``device_type`` is refused, naming the ones that run there."""
    if name == "auto":
        name = default_lora_backend(device_type, disabled)
    reg = get_registry(disabled)
    spec = reg.get("lora-backend", name, "LoRA backend")
    if device_type not in spec.device_types:
        here = [n for n, e in reg.entries["lora-backend"].items() if device_type in e.spec.device_types]
        raise PluginError(f"--lora-backend: '{name}' does not run on {device_type} devices "
                          f"(it runs on {', '.join(spec.device_types)}); here: {', '.join(here) or 'none installed'}")
    entry = reg.entries["lora-backend"][name]
    return create(spec.factory, options=reg.options_for(entry.plugin.name, plugin_options or {}))


def kv_transfer_backends(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("kv-transfer")


def get_kv_transfer_backend(name: str, disabled: Iterable[str] = ()) -> KvTransferSpec:
    return get_registry(disabled).get("kv-transfer", name, "KV transfer backend")


def create_kv_transfer_backend(name: str, ctx: Any, device_type: str, disabled: Iterable[str] = (),
                               plugin_options: dict[str, dict[str, Any]] | None = None) -> Any:
    """The ``engine.disaggregation.KvTransferBackend`` of the KV transfer backend ``name``, built
    for ``ctx`` (an ``engine.disaggregation.KvTransferContext``) with its plugin's options (hook
    API 8). A backend that does not list ``device_type`` is refused, naming the ones that do."""
    reg = get_registry(disabled)
    spec = reg.get("kv-transfer", name, "KV transfer backend")
    if device_type not in spec.device_types:
        here = [n for n, e in reg.entries["kv-transfer"].items() if device_type in e.spec.device_types]
        raise PluginError(f"--disaggregation-transfer-backend: '{name}' does not move KV of {device_type} devices "
                          f"(it moves {', '.join(spec.device_types)}); here: {', '.join(here) or 'none installed'}")
    entry = reg.entries["kv-transfer"][name]
    return create(spec.factory, ctx, options=reg.options_for(entry.plugin.name, plugin_options or {}))


def kv_storage_tiers(disabled: Iterable[str] = ()) -> list[str]:
    return get_registry(disabled).names("kv-tier")


def get_kv_storage_tier(name: str, disabled: Iterable[str] = ()) -> KvStorageTierSpec:
    return get_registry(disabled).get("kv-tier", name, "KV storage tier")


def create_kv_storage_tier(name: str, layout: Any, num_tokens: int, disabled: Iterable[str] = (),
                           plugin_options: dict[str, dict[str, Any]] | None = None) -> Any:
    """The ``engine.mem_cache.kv_tier.KvStorageTier`` named ``name`` for a rank's ``layout`` (a
    ``KvLayout``), holding ``num_tokens`` token slots, with its plugin's options (hook API 8). A
    tier that does not list the pool's device type is refused, naming the ones that do."""
    reg = get_registry(disabled)
    spec = reg.get("kv-tier", name, "KV storage tier")
    device_type = layout.device_type
    if device_type not in spec.device_types:
        here = [n for n, e in reg.entries["kv-tier"].items() if device_type in e.spec.device_types]
        raise PluginError(f"--hicache-storage-backend: '{name}' does not back KV pools on {device_type} devices "
                          f"(it backs {', '.join(spec.device_types)}); here: {', '.join(here) or 'none installed'}")
    entry = reg.entries["kv-tier"][name]
    return create(spec.factory, layout, num_tokens, options=reg.options_for(entry.plugin.name, plugin_options or {}))


def _create_parser(kind: str, name: str, label: str, disabled: Iterable[str],
                   plugin_options: dict[str, dict[str, Any]] | None) -> Any:
    reg = get_registry(disabled)
    spec = reg.get(kind, name, label)
    entry = reg.entries[kind][name]
    return create(spec.factory, options=reg.options_for(entry.plugin.name, plugin_options or {}))


def declared_options(kind: str, name: str, disabled: Iterable[str] = ()) -> dict[str, Any]:
    """The option defaults declared by the plugin that registered ``kind`` ``name``: what the
    engine hands that implementation when the user sets none (the conformance kit builds with it)."""
    reg = get_registry(disabled)
    return reg.options_for(reg.entries[kind][name].plugin.name, {})


def plugin_options(disabled: Iterable[str] = ()) -> dict[str, PluginOption]:
    return {k: e.spec for k, e in get_registry(disabled).entries["option"].items()}


def check_plugin_options(plugin_options: dict[str, dict[str, Any]], disabled: Iterable[str] = ()) -> None:
    """Every ``plugin_options`` entry must name an enabled plugin and an option it declares,
    with a value of the default's type. Start-up and ``engine config show`` both run this."""
    reg = get_registry(disabled)
    declared = {k: e.spec for k, e in reg.entries["option"].items()}
    for plugin, values in plugin_options.items():
        info = reg.plugins.get(plugin)
        if info is None:
            raise ConfigError(f"plugin_options: unknown plugin '{plugin}'; installed: "
                              f"{', '.join(sorted(reg.plugins)) or 'none'}{did_you_mean(plugin, reg.plugins)}")
        if info.status != "ok":
            why = info.disabled_by or info.error
            raise ConfigError(f"plugin_options: plugin '{plugin}' is {info.status} ({why}); its options cannot be set")
        mine = sorted(k for k, spec in declared.items() if spec.plugin == plugin)
        for key, value in values.items():
            spec = declared.get(f"{plugin}.{key}")
            if spec is None:
                raise ConfigError(f"plugin_options: unknown option '{plugin}.{key}'; declared: "
                                  f"{', '.join(mine) or f'none by {plugin}'}{did_you_mean(f'{plugin}.{key}', mine)}")
            if not any(_same_kind(value, kind) for kind in (spec.default, *spec.accepts)):
                names = [type(spec.default).__name__, *(t.__name__ for t in spec.accepts)]
                raise ConfigError(f"plugin_options: {plugin}.{key}: invalid value {value!r}; expected "
                                  f"{' or '.join(names)} like the default {spec.default!r}")


def _same_kind(value: Any, kind: Any) -> bool:
    """Whether ``value`` has the type of ``kind`` (a default value, or a type from ``accepts``);
    bools are never numbers, and ints are accepted where floats are."""
    kind_type = kind if isinstance(kind, type) else type(kind)
    if kind is None or value is None:
        return True
    if kind_type is bool or isinstance(value, bool):
        return isinstance(value, bool) and kind_type is bool
    if kind_type is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind_type)


def create(factory: Factory, *args: Any, options: dict[str, Any]) -> Any:
    """Calls a plugin factory, passing ``options`` only if it accepts them (hook API 2)."""
    return call_with_accepted(resolve_factory(factory), *args, options=options)


def choose_platform(name: str | None = None, disabled: Iterable[str] = (),
                    plugin_options: dict[str, dict[str, Any]] | None = None) -> tuple[PlatformSpec, Any]:
    """(spec, instance) of the platform to run on.

    With ``name`` the named platform must be available. Without it, exactly one
    non-fallback platform may claim the machine; a fallback one (cpu) is chosen only
    when none does; two claimants is an error that asks for ``--platform``. Each
    platform's factory receives its plugin's options.
    """
    reg = get_registry(disabled)
    opts = plugin_options or {}

    def build(entry_name: str) -> Any:
        entry = reg.entries["platform"][entry_name]
        return create(entry.spec.factory, options=reg.options_for(entry.plugin.name, opts))

    if name is not None:
        spec = reg.get("platform", name, "platform")
        platform = build(name)
        if not platform.is_available():
            raise PluginError(f"platform '{name}' is not available on this machine: {platform.unavailable_reason()}")
        return spec, platform
    claimants, fallbacks = [], []
    for entry_name, entry in reg.entries["platform"].items():
        platform = build(entry_name)
        if platform.is_available():
            (fallbacks if entry.spec.fallback else claimants).append((entry.spec, platform))
    if len(claimants) > 1:
        names = ", ".join(s.name for s, _ in claimants)
        raise PluginError(f"several platforms claim this machine ({names}); choose one with --platform")
    if claimants:
        return claimants[0]
    if len(fallbacks) == 1:
        return fallbacks[0]
    if not fallbacks:
        raise PluginError(
            f"no available platform; installed: {', '.join(reg.names('platform')) or 'none'}; pip install plugserve-platform-cpu"
        )
    names = ", ".join(s.name for s, _ in fallbacks)
    raise PluginError(f"several fallback platforms ({names}); choose one with --platform")


def platform_statuses(disabled: Iterable[str] = (),
                      plugin_options: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One dict per registered platform: ``name``, ``plugin``, ``device_type``, ``available``,
    ``reason`` (why not, e.g. a missing vendor library), ``tested_on_hardware`` ("" = only on
    simulated devices) and ``selected`` (what auto-detection picks here). Probing a platform
    may import its vendor library (``torch_npu``), never initialise a device."""
    reg = get_registry(disabled)
    opts = plugin_options or {}
    try:
        picked: str | None = choose_platform(None, disabled, plugin_options)[0].name
        conflict = ""
    except PluginError as exc:
        picked, conflict = None, str(exc)
    rows = []
    for name, entry in sorted(reg.entries["platform"].items()):
        try:
            platform = create(entry.spec.factory, options=reg.options_for(entry.plugin.name, opts))
            available = bool(platform.is_available())
            reason = "" if available else platform.unavailable_reason()
        except Exception as exc:  # a platform whose probe raises is reported, not fatal to the listing
            available, reason = False, f"probe failed: {_one_line(exc)}"
        rows.append({
            "name": name, "plugin": entry.plugin.name, "device_type": entry.spec.device_type,
            "available": available, "reason": reason or (conflict if available and picked is None else ""),
            "tested_on_hardware": getattr(entry.spec, "tested_on_hardware", ""),
            "selected": name == picked,
        })
    return rows


def select_platform(name: str | None = None, disabled: Iterable[str] = (),
                    plugin_options: dict[str, dict[str, Any]] | None = None) -> Any:
    """The platform instance ``choose_platform`` picks."""
    return choose_platform(name, disabled, plugin_options)[1]


def default_attention_backend(platform: Any, disabled: Iterable[str] = ()) -> str:
    """The platform's default attention backend, told which backends are enabled (hook API 2)."""
    return str(call_with_accepted(platform.default_attention_backend, available=tuple(attention_backends(disabled))))


def list_plugins(disabled: Iterable[str] = ()) -> list[PluginInfo]:
    return sorted(get_registry(disabled).plugins.values(), key=lambda p: p.name)
