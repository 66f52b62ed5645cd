"""The start-up checks that need neither the checkpoint nor a device: every component a flag
names is installed, enabled and runs on the platform's device type.

``engine config show`` runs ``check_without_checkpoint``; start-up (``entrypoints.launch.preflight``)
runs it and then ``engine.selection.select_components`` with the checkpoint's config, which
uses the attention checks below again for the backend it picks. Nothing here imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import engine.plugins as plugins
from engine.errors import ConfigError, PluginError

if TYPE_CHECKING:
    from engine.config import ServerArgs
    from engine.hookspecs import AttentionBackendSpec


def check_without_checkpoint(args: ServerArgs, before_probe: Callable[[], object] | None = None) -> None:
    """The start-up checks that need neither the checkpoint nor its weights, as one-line
    ``EngineError``s naming the flag, the value and what is accepted: required plugins, plugin
    options, and every component named by a flag (``--attention``, ``--quant``, ``--platform``,
    ``--schedule-policy``, ``--router-policy``) is installed, enabled and runs on the platform's
    device type. ``engine config show`` runs exactly this; start-up runs it, then
    ``select_components`` with the checkpoint's config.

    Naming a device-bound component (``--attention``/``--quant``) without ``--platform`` probes
    which platform claims the machine, which imports the platform plugins' implementations (and
    torch); everything else reads registered specs only. ``before_probe`` is called right before
    a probe (``engine serve`` imports torch there its own way, ``child_process.allow_forked_children``).
    """
    from engine.config import ServerArgs as _Defaults
    from engine.config import check_required_plugins

    check_required_plugins(args.required_plugins)
    plugins.check_plugin_options(args.plugin_options, args.disable_plugin)
    check_paths(args)
    for name, _ in enabled_frontends(args):
        frontend_entry_point(name)
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
        if before_probe is not None:
            before_probe()
        spec, _ = plugins.choose_platform(None, disabled, args.plugin_options)
        platform_name, device = spec.name, spec.device_type
    if attention is not None:
        check_attention_on_platform(attention, device, platform_name, reg, args.page_size, args.kv_cache_dtype)
    if quant is not None and device not in quant.device_types:
        raise ConfigError(f"--quant: quantization method '{quant.name}' does not run on platform '{platform_name}' "
                          f"(runs on: {', '.join(quant.device_types)}); methods for {device}: "
                          f"{names_for_device(reg, 'quantization', device)}")


# Frontends beside HTTP (engine.entrypoints.frontend): name -> (the ServerArgs field that turns it
# on, the distribution providing it). The name is the entry point's in FRONTEND_GROUP.
FRONTENDS = {"grpc": ("grpc_port", "plugserve-grpc")}
FRONTEND_GROUP = "engine.frontends"


def enabled_frontends(args: ServerArgs) -> list[tuple[str, int]]:
    """(name, port) of each frontend whose flag is set."""
    return [(name, getattr(args, flag)) for name, (flag, _) in FRONTENDS.items() if getattr(args, flag, None)]


def frontend_entry_points(name: str | None = None) -> list[Any]:
    """The installed frontends' entry points in ``FRONTEND_GROUP`` (only ``name``'s when given),
    sorted by name, none loaded."""
    from importlib_metadata import entry_points

    found = entry_points(group=FRONTEND_GROUP) if name is None else entry_points(group=FRONTEND_GROUP, name=name)
    return sorted(found, key=lambda e: e.name)


def frontend_entry_point(name: str) -> Any:
    """The entry point of frontend ``name`` (not loaded); a one-line error naming the flag and the
    distribution to install when none is installed."""
    found = frontend_entry_points(name)
    if not found:
        flag, dist = FRONTENDS[name]
        raise PluginError(f"--{flag.replace('_', '-')}: serving {name} needs the {dist} distribution, which is not "
                          f"installed; pip install {dist} (in a clone of the repository: pip install -e plugins/{name})")
    return found[0]


_ACCEPTED_MODEL = "accepted: a Hugging Face model directory (with config.json), or a GGUF file (.gguf)"


def check_paths(args: ServerArgs) -> None:
    """Every path a flag names exists and is of a kind the engine loads; a Hugging Face
    directory's config.json also splits ``--tp-size`` x ``--pp-size`` ways (read as JSON: no
    transformers import)."""
    for flag, path in (("--model-path", args.model_path),
                       ("--speculative-draft-model-path", args.speculative_draft_model_path)):
        if path:
            check_model_path(flag, path)
    if args.tokenizer_path and not os.path.isdir(args.tokenizer_path):
        what = "no such directory" if not os.path.exists(args.tokenizer_path) else "not a directory"
        raise ConfigError(f"--tokenizer-path: {what}: {args.tokenizer_path}; accepted: a directory with the "
                          "tokenizer's files (tokenizer.json or tokenizer_config.json)")
    if args.model_path and os.path.isfile(os.path.join(args.model_path, "config.json")):
        check_split_from_config_json(args, args.model_path)


def check_devices(args: ServerArgs, before_probe: Callable[[], object] | None = None) -> None:
    """This node has a device for each of its ranks (``--tp-size`` x ``--pp-size`` / ``--nnodes``
    x ``--dp-size``). Probes the platform (imports torch; ``before_probe`` is called first), so it
    runs only when a node has several ranks; the CPU platform runs any number of ranks on its one
    device."""
    replica = 1 if getattr(args, "enable_dp_attention", False) else args.tp_size * args.pp_size  # DP attention: one rank each
    per_node = replica // max(1, args.nnodes) * args.dp_size
    if per_node <= 1:
        return
    if before_probe is not None:
        before_probe()
    spec, platform = plugins.choose_platform(args.platform, args.disable_plugin, args.plugin_options)
    if platform.device_type == "cpu":
        return
    count = platform.device_count()
    if count < per_node:
        raise ConfigError(f"--tp-size {args.tp_size} x --pp-size {args.pp_size} x --dp-size {args.dp_size}: "
                          f"needs {per_node} devices on this node; platform '{spec.name}' sees {count}")


def check_model_path(flag: str, path: str) -> None:
    """``path`` is a directory with config.json or GGUF files, or a GGUF file (checked by its
    magic bytes, so a GGUF named otherwise is told apart from a file of another kind)."""
    if not os.path.exists(path):
        raise ConfigError(f"{flag}: no such file or directory: {path}; {_ACCEPTED_MODEL}")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")) or any(n.endswith(".gguf") for n in os.listdir(path)):
            return
        raise ConfigError(f"{flag}: {path} has no config.json and no .gguf file; {_ACCEPTED_MODEL}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if magic != b"GGUF":
        raise ConfigError(f"{flag}: {path} is a file but not a GGUF file; {_ACCEPTED_MODEL}")
    if not path.endswith(".gguf"):
        raise ConfigError(f"{flag}: {path} is a GGUF file without the .gguf suffix; rename it to end in .gguf")


def check_split_from_config_json(args: ServerArgs, model_dir: str) -> None:
    """``--tp-size``/``--pp-size``/``--ep-size`` against the model's shape in ``model_dir``/config.json,
    read as plain JSON; a config that nests its text model's shape is left to start-up's check."""
    import json
    from types import SimpleNamespace

    if (args.tp_size == 1 and args.pp_size == 1 and args.ep_size == 1) or \
            not os.path.isfile(os.path.join(model_dir, "config.json")):
        return  # nothing to split, or no config.json: load_hf_config reports that
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model-path: cannot read {model_dir}/config.json: {exc}") from None
    if not isinstance(data, dict) or "num_attention_heads" not in data or "num_hidden_layers" not in data:
        return
    check_model_parallel(SimpleNamespace(**data), args.tp_size, args.pp_size, args.ep_size)


def check_model_parallel(hf_config: Any, tp_size: int, pp_size: int, ep_size: int = 1) -> None:
    """Raises ``ConfigError`` (one line) when the model cannot be split ``tp_size`` x ``pp_size`` ways.

    The vocabulary never limits ``tp_size``: embedding and LM head rows are padded to a multiple
    of it (the padding rows are zero and their logits are cut off).
    """
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    intermediate = getattr(hf_config, "intermediate_size", None)

    def fits(tp: int) -> bool:
        kv_ok = kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0
        return heads % tp == 0 and kv_ok and (intermediate is None or int(intermediate) % tp == 0)

    if not fits(tp_size):
        accepted = ", ".join(str(t) for t in range(1, heads + 1) if fits(t))
        what = f"{heads} attention heads, {kv_heads} KV heads"
        if intermediate is not None:
            what += f", MLP size {intermediate}"
        raise ConfigError(f"--tp-size: invalid value {tp_size} for this model ({what}): each must split "
                          f"evenly across ranks (KV heads may instead be replicated when fewer than ranks); "
                          f"accepted: {accepted}")
    _check_expert_parallel(hf_config, tp_size, ep_size)
    layers = int(hf_config.num_hidden_layers)
    if pp_size > layers:
        raise ConfigError(f"--pp-size: invalid value {pp_size}; accepted: at most the model's {layers} layers "
                          "(each pipeline stage needs one)")


def _check_expert_parallel(hf_config: Any, tp_size: int, ep_size: int) -> None:
    """A mixture-of-experts model splits its experts ``ep_size`` ways and each expert's
    intermediate features ``tp_size / ep_size`` ways (engine.layers.moe.layer)."""
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
    if not experts:
        return
    experts = int(experts)
    if experts % ep_size:
        accepted = ", ".join(str(e) for e in range(1, tp_size + 1) if tp_size % e == 0 and experts % e == 0)
        raise ConfigError(f"--ep-size: invalid value {ep_size} for this model ({experts} experts): the experts must "
                          f"split evenly across expert-parallel ranks; accepted: {accepted}")
    inter = getattr(hf_config, "moe_intermediate_size", None) or getattr(hf_config, "intermediate_size", None)
    if inter is not None and int(inter) % (tp_size // ep_size):
        raise ConfigError(f"--tp-size {tp_size} with --ep-size {ep_size}: each expert's {inter} intermediate features "
                          f"must split evenly over {tp_size // ep_size} ranks; raise --ep-size or lower --tp-size")


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


def speed_notes(selection: Any) -> list[str]:
    """Start-up warnings for a selected method that brings no speed on the selected platform:
    fp8 weights on a device without fp8 arithmetic (``Platform.fp8_dtype()`` is None, the CPU
    among them) are dequantized in every linear on every step, which saves memory, not time; a
    method whose spec lists ``fast_device_types`` without the platform's device type runs its
    reference path. ``selection`` is ``engine.selection.Selection``."""
    quant = selection.quant
    if quant is None:
        return []
    methods = {quant.name, *getattr(quant.spec, "checkpoint_methods", ())}
    if "fp8" in methods and selection.platform.fp8_dtype() is None:
        return [f"quant {quant.name}: platform '{selection.platform_choice.name}' has no fp8 arithmetic, so every "
                "linear dequantizes its fp8 weights on every step: this saves weight memory but decodes slower "
                "than the unquantized model here"]
    fast = getattr(quant.spec, "fast_device_types", None)
    device = selection.platform.device_type
    if fast is not None and device not in fast:
        return [f"quant {quant.name}: on {device} it runs its torch reference path (fast kernels on: "
                f"{', '.join(fast)}), which saves weight memory but decodes slower than the unquantized "
                "model here"]
    return []


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


__all__ = ["check_backend_selectable", "check_devices", "check_kv_cache_dtype", "check_model_parallel",
           "check_model_path", "check_paths", "check_split_from_config_json", "check_without_checkpoint",
           "names_for_device", "parser_log_lines", "speed_notes"]
