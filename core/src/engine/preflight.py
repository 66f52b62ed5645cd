"""The start-up checks that need neither the checkpoint nor a device: every component a flag
names is installed, enabled and runs on the platform's device type.

``engine config show`` runs ``check_without_checkpoint``; start-up (``entrypoints.launch.preflight``)
runs it and then ``engine.selection.select_components`` with the checkpoint's config, which
uses the attention checks below again for the backend it picks. Nothing here imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import engine.plugins as plugins
from engine.errors import ConfigError, PluginError

if TYPE_CHECKING:
    from engine.config import ServerArgs
    from engine.hookspecs import AttentionBackendSpec


def check_without_checkpoint(args: ServerArgs) -> None:
    """The start-up checks that need neither the checkpoint nor its weights, as one-line
    ``EngineError``s naming the flag, the value and what is accepted: required plugins, plugin
    options, and every component named by a flag (``--attention``, ``--quant``, ``--platform``,
    ``--schedule-policy``, ``--router-policy``) is installed, enabled and runs on the platform's
    device type. ``engine config show`` runs exactly this; start-up runs it, then
    ``select_components`` with the checkpoint's config.

    Naming a device-bound component (``--attention``/``--quant``) without ``--platform`` probes
    which platform claims the machine, which imports the platform plugins' implementations (and
    torch); everything else reads registered specs only.
    """
    from engine.config import ServerArgs as _Defaults
    from engine.config import check_required_plugins

    check_required_plugins(args.required_plugins)
    plugins.check_plugin_options(args.plugin_options, args.disable_plugin)
    disabled = args.disable_plugin
    reg = plugins.get_registry(disabled)

    def lookup(flag: str, kind: str, name: str, what: str) -> Any:
        try:
            return reg.get(kind, name, what)
        except PluginError as exc:
            raise PluginError(f"{flag}: {exc}") from None

    # The router policy matters with several replicas, or when it is named explicitly.
    if args.dp_size > 1 or args.router_policy != _Defaults.router_policy:
        lookup("--router-policy", "router", args.router_policy, "router policy")
    lookup("--schedule-policy", "policy", args.schedule_policy, "schedule policy")
    attention = lookup("--attention", "attention", args.attention, "attention backend") if args.attention else None
    quant = lookup("--quant", "quantization", args.quant, "quantization method") if args.quant else None
    platform_spec = lookup("--platform", "platform", args.platform, "platform") if args.platform else None
    if attention is None and quant is None:
        return
    if platform_spec is not None:
        platform_name, device = platform_spec.name, platform_spec.device_type
    elif _runs_on_every_platform(reg, attention, quant):
        # Whichever platform claims the machine, the named components run on its device type:
        # no probe (probing imports the platforms' implementations and torch), and what is left
        # to check does not depend on the device.
        if attention is not None:
            check_backend_selectable(attention, attention.device_types[0], args.page_size, args.kv_cache_dtype)
        return
    else:
        spec, _ = plugins.choose_platform(None, disabled, args.plugin_options)
        platform_name, device = spec.name, spec.device_type
    if attention is not None:
        check_attention_on_platform(attention, device, platform_name, reg, args.page_size, args.kv_cache_dtype)
    if quant is not None and device not in quant.device_types:
        raise ConfigError(f"--quant: quantization method '{quant.name}' does not run on platform '{platform_name}' "
                          f"(runs on: {', '.join(quant.device_types)}); methods for {device}: "
                          f"{names_for_device(reg, 'quantization', device)}")


def _runs_on_every_platform(reg: Any, *components: Any) -> bool:
    """Whether every given component spec (``None``: not named) lists the device type of every
    enabled platform plugin, read from their specs."""
    devices = {reg.entries["platform"][name].spec.device_type for name in reg.names("platform")}
    named = [c for c in components if c is not None]
    return bool(devices) and all(device in c.device_types for c in named for device in devices)


def parser_log_lines(args: ServerArgs) -> list[str]:
    """Start-up log lines naming the tool-call and reasoning parsers in use (they run in the
    main process, so the scheduler's component lines do not name them), e.g.
    ``tool-call parser: hermes (plugserve-toolparser-hermes 0.1.0)``."""
    reg = plugins.get_registry(args.disable_plugin)
    lines = []
    for label, kind, name in (("tool-call parser", "tool-parser", args.tool_call_parser),
                              ("reasoning parser", "reasoning-parser", args.reasoning_parser)):
        if name is None:
            continue
        owner = reg.provider(kind, name)
        source = f"{owner.distribution} {owner.version}" if owner is not None else "not from a plugin"
        lines.append(f"{label}: {name} ({source})")
    return lines


def names_for_device(reg: Any, kind: str, device: str) -> str:
    """The ``kind`` implementations whose spec lists ``device``, for error messages (``"none"`` if none)."""
    return ", ".join(n for n in reg.names(kind) if device in reg.entries[kind][n].spec.device_types) or "none"


def check_attention_on_platform(spec: AttentionBackendSpec, device: str, platform_name: str, reg: Any,
                                page_size: int, kv_cache_dtype: str) -> None:
    """``check_backend_selectable``; a backend that does not run on the platform's device type
    is refused naming the backends that do."""
    try:
        check_backend_selectable(spec, device, page_size, kv_cache_dtype)
    except ConfigError as exc:
        if device in spec.device_types:
            raise
        raise ConfigError(f"{exc}; backends for platform '{platform_name}': "
                          f"{names_for_device(reg, 'attention', device)}") from None


def check_backend_selectable(spec: AttentionBackendSpec, device_type: str, page_size: int,
                             kv_cache_dtype: str = "auto") -> None:
    """Raises ``ConfigError`` unless ``spec`` declares ``device_type`` and accepts ``page_size``
    and ``kv_cache_dtype``.

    Args:
        spec: the backend's registered spec (``device_types`` defaults to ``("cuda",)``).
        device_type: ``Platform.device_type`` of the selected platform (``torch.device.type``).
        page_size: ``--page-size``.
        kv_cache_dtype: ``--kv-cache-dtype`` (``kv_cache_dtypes`` defaults to ``("auto",)``).
    """
    if device_type not in spec.device_types:
        raise ConfigError(
            f"--attention: backend '{spec.name}' does not run on {device_type} "
            f"(it supports: {', '.join(spec.device_types)})"
        )
    if spec.page_sizes and page_size not in spec.page_sizes:
        raise ConfigError(f"--page-size: invalid value {page_size} for attention backend '{spec.name}'; "
                          f"accepted: {', '.join(map(str, spec.page_sizes))}")
    check_kv_cache_dtype(spec, kv_cache_dtype)


def check_kv_cache_dtype(spec: AttentionBackendSpec, kv_cache_dtype: str) -> None:
    """Raises ``ConfigError`` unless the backend declares ``kv_cache_dtype`` in its spec."""
    accepted = getattr(spec, "kv_cache_dtypes", ("auto",))
    if kv_cache_dtype not in accepted:
        raise ConfigError(f"--kv-cache-dtype: attention backend '{spec.name}' does not support {kv_cache_dtype!r} "
                          f"(it supports: {', '.join(accepted)})")


__all__ = ["check_backend_selectable", "check_kv_cache_dtype", "check_without_checkpoint", "names_for_device",
           "parser_log_lines"]
