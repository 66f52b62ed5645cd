"""Which plugin provides each component of a run, decided and checked before the model loads.

``select_components`` is the one place that turns ``ServerArgs`` plus the checkpoint's
config into a platform, an attention backend, a quantization method, a model plugin and
a schedule policy, with every check that needs no weights: the backend runs on the
platform and supports the page size, the quant method runs on the device and with the
activation dtype, the architecture's plugin is enabled. The main process runs it in
``preflight`` (errors in a second, not after a 15 s load); the scheduler process runs the
same function to build the components, so the two can never disagree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import engine.plugins as plugins
from engine.errors import ConfigError, ModelLoadError, PluginError
from engine.hookspecs import call_with_accepted
from engine.preflight import check_attention_on_platform, names_for_device

if TYPE_CHECKING:
    import torch

    from engine.config import ServerArgs
    from engine.layers.quantization import QuantizationConfig
    from engine.plugins import PluginInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Selected:
    """One chosen implementation and the plugin it comes from."""

    #: registry kind: "platform", "attention", "quantization", "model", "policy".
    kind: str
    #: the name users select it by (for models: the architecture).
    name: str
    #: the registered spec (AttentionBackendSpec, ...).
    spec: Any
    #: the plugin that registered it; None for an instance handed in by a test.
    plugin: PluginInfo | None
    #: the plugin's options (declared defaults overridden by the user's), passed to its factory.
    options: dict[str, Any] = field(default_factory=dict)

    def source(self) -> str:
        """``plugserve-attention-triton 0.1.0``."""
        return f"{self.plugin.distribution} {self.plugin.version}" if self.plugin else "not from a plugin"

    def describe(self) -> str:
        """``triton (plugserve-attention-triton 0.1.0)``."""
        return f"{self.name} ({self.source()})"


@dataclass
class Selection:
    """Everything ``select_components`` chose, ready to build."""

    platform: Any  # engine.platforms.Platform instance
    platform_choice: Selected
    attention: Selected
    model: Selected
    policy: Selected
    #: None when the run is unquantized.
    quant: Selected | None
    quant_config: QuantizationConfig | None
    #: activation dtype (``--dtype`` resolved against the checkpoint and platform).
    dtype: torch.dtype

    def create_model(self, hf_config: Any) -> Any:
        """The model plugin's module, built as ``cls(hf_config, quant_config[, options])``."""
        cls = plugins.model_class_of(self.model.spec, self.model.name)
        return call_with_accepted(cls, hf_config, self.quant_config, options=self.model.options)

    def create_policy(self) -> Any:
        policy = plugins.create(self.policy.spec.factory, options=self.policy.options)
        policy.cache_aware = self.policy.spec.cache_aware
        return policy

    def log_lines(self) -> list[str]:
        """One line per component, for the start-up log (the platform's with ``describe()``)."""
        quant = "none"
        if self.quant is not None and self.quant_config is not None:
            ignored = self.quant_config.ignored_layers()
            quant = self.quant.describe() + (f", left unquantized: {', '.join(ignored)}" if ignored else "")
        dtype = str(self.dtype).replace("torch.", "")
        return [
            f"platform: {self.platform_choice.describe()} — {self.platform.describe()}",
            f"attention: {self.attention.describe()}",
            f"quant: {quant}; activation dtype {dtype}",
            f"model: {self.model.spec.name} for {self.model.name} ({self.model.source()})",
            f"policy: {self.policy.describe()}",
        ]


def select_components(args: ServerArgs, hf_config: Any, platform: Any | None = None) -> Selection:
    """Chooses and checks every component; raises ``EngineError`` naming what would work.

    Args:
        args: the run's configuration.
        hf_config: the checkpoint's config (``load_hf_config``).
        platform: an already-built platform (tests); default: ``--platform`` or auto-detected.
    """
    from engine.model_executor.dtypes import resolve_dtype

    disabled = args.disable_plugin
    reg = plugins.get_registry(disabled)
    opts = args.plugin_options
    if platform is None:
        spec, platform = plugins.choose_platform(args.platform, disabled, opts)
        platform_choice = _selected(reg, "platform", spec.name, spec, opts)
    else:
        spec = reg.entries["platform"].get(platform.name)
        platform_choice = _selected(reg, "platform", platform.name, spec.spec if spec else None, opts)
    arch = hf_config.architectures[0]
    model_spec = plugins.get_model_spec(arch, disabled)
    model_owner = next(e.plugin for e in reg.entries["model"].values() if e.spec is model_spec)
    model = Selected("model", arch, model_spec, model_owner, reg.options_for(model_owner.name, opts))
    policy_spec = plugins.get_schedule_policy(args.schedule_policy, disabled)
    policy = _selected(reg, "policy", policy_spec.name, policy_spec, opts)
    # The model class's KV layout ("mla": multi-head latent attention) limits the backends.
    kv_layout = str(getattr(plugins.model_class_of(model_spec, arch), "kv_layout", "mha"))
    attention = _select_attention(args, platform, reg, kv_layout, arch)
    dtype = resolve_dtype(args.dtype, hf_config, platform.default_dtype())
    quant, quant_config = _select_quant(args, hf_config, platform, reg, dtype)
    return Selection(platform, platform_choice, attention, model, policy, quant, quant_config, dtype)


def _selected(reg: Any, kind: str, name: str, spec: Any, opts: dict[str, Any]) -> Selected:
    owner = reg.provider(kind, name)
    return Selected(kind, name, spec, owner, reg.options_for(owner.name, opts) if owner else {})


def _select_attention(args: ServerArgs, platform: Any, reg: Any, kv_layout: str = "mha",
                      architecture: str = "") -> Selected:
    from engine.attention.selection import check_kv_layout, reads_kv_layout

    disabled = args.disable_plugin
    device = platform.device_type
    # Enabled backends for this device that read the model's KV layout.
    readers = [n for n in reg.names("attention") if device in reg.entries["attention"][n].spec.device_types
               and reads_kv_layout(reg.entries["attention"][n].spec, kv_layout)]
    if args.attention:
        name = args.attention
        spec = reg.get("attention", name, "attention backend")
    elif kv_layout != "mha":
        # The platform picks its default among the backends that read the layout.
        name = str(call_with_accepted(platform.default_attention_backend, available=tuple(readers)))
        spec = reg.get("attention", name, "attention backend")
    else:
        name = plugins.default_attention_backend(platform, disabled)
        try:
            spec = reg.get("attention", name, "attention backend")
        except PluginError as exc:
            raise PluginError(f"{exc}; platform '{platform.name}' picks it when --attention is not given: "
                              f"choose one with --attention (backends for platform '{platform.name}': "
                              f"{names_for_device(reg, 'attention', device)})") from None
    check_attention_on_platform(spec, device, platform.name, reg, args.page_size, args.kv_cache_dtype)
    check_kv_layout(spec, kv_layout, architecture, readers,
                    "" if args.attention else f"platform '{platform.name}' picks it by default")
    refusal = _platform_refusal(platform, "unsupported_attention_reason", name)
    if refusal:
        usable = _supported_on(platform, reg, "attention", "supported_attention_backends")
        raise ConfigError(f"--attention: platform '{platform.name}' cannot run attention backend '{name}': "
                          f"{refusal}; backends for platform '{platform.name}': {usable}")
    return _selected(reg, "attention", name, spec, args.plugin_options)


def _platform_refusal(platform: Any, method: str, name: str) -> str | None:
    """The platform's reason against ``name`` (hook API 5; older platforms refuse nothing)."""
    check = getattr(platform, method, None)
    return check(name) if check is not None else None


def _supported_on(platform: Any, reg: Any, kind: str, method: str) -> str:
    """The ``kind`` implementations for the platform's device type that it does not refuse."""
    names = [n for n in reg.names(kind) if platform.device_type in reg.entries[kind][n].spec.device_types]
    keep = getattr(platform, method, None)
    return ", ".join(keep(names) if keep is not None else names) or "none"


def _select_quant(args: ServerArgs, hf_config: Any, platform: Any, reg: Any,
                  dtype: torch.dtype) -> tuple[Selected | None, QuantizationConfig | None]:
    """The checkpoint's ``quantization_config`` or ``--quant`` (both given must agree), built."""
    ckpt = getattr(hf_config, "quantization_config", None)
    if ckpt is not None and not isinstance(ckpt, dict):
        ckpt = ckpt.to_dict()
    disabled = args.disable_plugin
    if ckpt:
        method = str(ckpt.get("quant_method", ""))
        spec = plugins.find_quantization_for_checkpoint(method, disabled)
        if args.quant and args.quant != spec.name and args.quant not in spec.checkpoint_methods:
            raise ModelLoadError(f"--quant {args.quant} conflicts with the checkpoint's quantization_config (quant_method '{method}')")
    elif args.quant:
        spec = plugins.get_quantization_method(args.quant, disabled)
    else:
        default = _default_gguf_method(args, platform, reg)
        if default is None:
            return None, None
        spec = default
    device = platform.device_type
    if device not in spec.device_types:
        raise ConfigError(f"quantization method '{spec.name}' does not run on platform '{platform.name}' "
                          f"(runs on: {', '.join(spec.device_types)}); methods for {device}: {names_for_device(reg, 'quantization', device)}")
    refusal = _platform_refusal(platform, "unsupported_quant_reason", spec.name)
    if refusal:
        usable = _supported_on(platform, reg, "quantization", "supported_quant_methods")
        raise ConfigError(f"quantization method '{spec.name}' does not run on platform '{platform.name}': {refusal}; "
                          f"methods for platform '{platform.name}': {usable}")
    selected = _selected(reg, "quantization", spec.name, spec, args.plugin_options)
    quant_config = plugins.create(spec.factory, dict(ckpt or {}), options=selected.options)
    _check_gguf_blocks_source(args, quant_config)
    accepted = list(quant_config.supported_act_dtypes())
    if dtype not in accepted:
        names = ", ".join(str(d).replace("torch.", "") for d in accepted)
        resolved = str(dtype).replace("torch.", "")
        given = f"--dtype {args.dtype}" + (f" (resolved to {resolved})" if args.dtype == "auto" else "")
        raise ConfigError(f"{given}: quantization method '{spec.name}' cannot run activations in {resolved}; accepted: {names}")
    return selected, quant_config


def _default_gguf_method(args: ServerArgs, platform: Any, reg: Any) -> Any:
    """The ``gguf`` method's spec where a GGUF with no --quant keeps its blocks on this device
    (``gguf_loader.default_gguf_quant``, off unless flipped there), else None."""
    from engine.model_executor.gguf_loader import default_gguf_quant

    if args.model_path is None and args.task == "embed":
        return None  # the embedded embedding model is a safetensors checkpoint, not the default GGUF
    name = default_gguf_quant(args.model_path, platform.device_type, args.dtype)
    if name is None or name in args.disable_plugin:
        return None
    try:
        return reg.get("quantization", name, "quantization method")
    except PluginError:  # not installed: the GGUF runs dequantized
        return None


def _check_gguf_blocks_source(args: ServerArgs, quant_config: Any) -> None:
    """A method that reads GGUF blocks (``loads_gguf_blocks``) needs a GGUF checkpoint: said here,
    before any process starts, rather than when the scheduler loads the weights."""
    if not getattr(quant_config, "loads_gguf_blocks", False) or args.load_format == "dummy" or args.model_path is None:
        return
    from engine.model_executor.gguf_loader import find_gguf, gguf_source, not_a_gguf_error

    # A GGUF file (or a directory holding one), or the engine's conversion of one.
    if find_gguf(args.model_path) is None and gguf_source(args.model_path) is None:
        raise not_a_gguf_error(quant_config.name, args.model_path)
