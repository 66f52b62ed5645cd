"""The plugin contract: hook specifications and the specs plugins register.

Every implementation the engine runs (attention backends, quantization methods,
model architectures, schedule policies, hardware platforms) arrives through
these hooks from a distribution that declares an entry point in the group
``engine.plugins``. A plugin module implements any subset of the hooks::

    from engine.hookspecs import hookimpl, AttentionBackendSpec

    @hookimpl
    def register_attention_backends(register):
        register(AttentionBackendSpec(name="mine", factory="my_pkg.backend:create"))

Rules (hook API version ``HOOK_API_VERSION``):

- Registration is cheap. Importing a plugin module must not import CUDA
  libraries, compile kernels or touch a device: ``factory`` is a ``"module:attr"``
  string imported only when the implementation is selected.
- Hooks only ever gain arguments; an implementation may accept fewer arguments
  than its spec (pluggy passes only the ones it names).
- Factories, like hooks, only ever gain arguments: the engine passes an optional
  argument (``options=``) only to a factory whose signature names it (or takes
  ``**kwargs``), so factories written for an older API keep working.
- None of these hooks is ``firstresult``: every plugin is asked, and each calls
  ``register`` zero or more times. Return values are ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

PROJECT_NAME = "engine"
ENTRY_POINT_GROUP = "engine.plugins"

#: Version of this hook API. Bumped when a hook, a spec field or a factory argument is added.
#: 1: the five registration hooks and their spec classes.
#: 2: factories of quantization methods, schedule policies and platforms, and model classes,
#:    receive their plugin's options as the keyword ``options``; attention backends get them
#:    in ``AttentionContext.options`` as before. ``Platform.default_attention_backend`` receives
#:    ``available`` (the enabled attention backend names). A ``PluginOption`` must be declared
#:    under the declaring plugin's own (entry-point) name.
#: 3: ``AttentionBackendSpec.kv_cache_dtypes`` and ``AttentionLayerInfo.k_scale``/``v_scale``
#:    (FP8 KV cache); the KV pool's ``set_kv_buffer`` takes the scales.
#: 4: ``register_grammar_backends`` / ``GrammarBackendSpec`` (structured output; the backend
#:    interface is ``engine.constrained.GrammarBackend``).
#:    ``register_router_policies`` / ``RouterPolicySpec`` (which data-parallel replica serves a
#:    request; the policy interface is ``engine.router.RouterPolicy``).
#:    ``register_tool_call_parsers`` / ``ToolCallParserSpec`` and ``register_reasoning_parsers`` /
#:    ``ReasoningParserSpec`` (``engine.parsers.ToolCallParser`` / ``ReasoningParser``).
#: 5: ``register_speculative_algorithms`` / ``SpeculativeAlgorithmSpec`` (speculative decoding;
#:    the proposer interface is ``engine.speculative.Proposer``).
#: 5 (also): ``PlatformSpec.tested_on_hardware``; ``Platform.device_count``, ``fp8_dtype``,
#:    ``unsupported_attention_reason``/``unsupported_quant_reason``, streams/events/graphs
#:    (``create_stream``, ``stream_context``, ``create_event``, ``create_graph``,
#:    ``graph_capture``) and ``pin_host_memory``, all with defaults (API-4 platforms still load).
#: 6: ``Proposer.release(rid, reason)`` is called on every end of a request (finished, aborted)
#:    and on every retraction, with the reason (a ``release(rid)`` without it is still called);
#:    ``Proposer.on_request_end(RequestEnd)`` receives each ended request's prompt and output ids.
#: 6 (also): ``PluginOption.accepts`` (types an option takes besides its default's).
#: 7: ``register_lora_backends`` / ``LoraBackendSpec`` (LoRA adapters' segmented shrink/expand;
#:    the backend interface is ``engine.lora.backend.LoraBackend``).
#: 8: ``AttentionBackendSpec.kv_layouts`` and ``AttentionLayerInfo.kv_layout`` (the KV layouts a
#:    backend reads: "mha", and "mla" for multi-head latent attention models).
#:    ``register_kv_transfer_backends`` / ``KvTransferSpec`` (prefill/decode disaggregation's KV
#:    transfer; the backend interface is ``engine.disaggregation.KvTransferBackend``).
#:    ``register_kv_storage_tiers`` / ``KvStorageTierSpec`` (where the hierarchical prefix cache
#:    keeps KV evicted from the device pool; the tier interface is
#:    ``engine.mem_cache.kv_tier.KvStorageTier``).
HOOK_API_VERSION = 8

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: A factory is either ``"module.path:attribute"`` (imported lazily) or a callable.
Factory = str | Callable[..., Any]


@dataclass(frozen=True)
class AttentionBackendSpec:
    """An attention implementation over the paged KV pool.

    ``factory(ctx: engine.attention.AttentionContext) -> engine.attention.AttentionBackend``.
    """

    name: str
    factory: Factory
    description: str = ""
    #: device types (``Platform.device_type``: "cpu", "cuda", ...) it runs on. The default is
    #: ``("cuda",)``: a backend for any other device must list it, or the engine refuses to
    #: select it there (and the conformance kit fails when run on that device).
    device_types: tuple[str, ...] = ("cuda",)
    #: page sizes it supports; empty means any.
    page_sizes: tuple[int, ...] = ()
    #: whether its decode path can be captured in CUDA graphs.
    supports_cuda_graph: bool = False
    #: ``--kv-cache-dtype`` values it accepts ("auto": the activation dtype; "fp8_e4m3",
    #: "fp8_e5m2": float8 K/V with per-layer scales, see ``engine.attention.base``). Since hook API 3.
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    #: KV-cache layouts it reads: "mha" (K and V per KV head, ``MHATokenToKVPool``) and "mla"
    #: (one latent row per token, V its leading ``v_head_dim`` dims, ``MLATokenToKVPool``; see
    #: ``engine.attention.base``). The engine refuses, before loading weights, a model whose
    #: layout (its class's ``kv_layout``) the backend does not list. Since hook API 8.
    kv_layouts: tuple[str, ...] = ("mha",)


@dataclass(frozen=True)
class QuantMethodSpec:
    """A quantization method (or family) for linear and MoE layers.

    ``factory(quant_config: dict, options: dict = ...) -> engine.layers.quantization.QuantizationConfig``,
    where ``quant_config`` is the checkpoint's ``quantization_config`` (empty dict when
    the method is chosen with ``--quant`` for an unquantized checkpoint) and ``options``
    the plugin's options (hook API 2; optional).
    """

    name: str
    factory: Factory
    description: str = ""
    #: device types it runs on; default ``("cuda",)``, like ``AttentionBackendSpec.device_types``.
    device_types: tuple[str, ...] = ("cuda",)
    #: ``quant_method`` values in a checkpoint's ``quantization_config`` this handles.
    checkpoint_methods: tuple[str, ...] = ()
    #: device types where its kernels decode faster than the unquantized model; elsewhere among
    #: ``device_types`` it runs a reference path (memory saved, not time), which start-up says
    #: once. None: every device type it runs on.
    fast_device_types: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Model architectures, keyed by the ``architectures`` names of a HF config.json.

    ``factory`` resolves to a class (or a callable returning one) constructed as
    ``cls(config: transformers.PretrainedConfig, quant_config: QuantizationConfig | None,
    options: dict = ...)`` (``options``: the plugin's options, hook API 2; optional)
    and exposing ``forward(input_ids, positions, forward_batch) -> LogitsProcessorOutput``
    and ``load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> None``.
    A model that pools (``--task embed|score``) also exposes
    ``forward_hidden(input_ids, positions, forward_batch) -> Tensor[num_tokens, hidden]``; an
    encoder sets ``uses_kv_cache = False``; a scoring model sets ``pooling_head`` and
    ``pooling_size``, optionally ``score_pooling`` and ``pooling_input`` (docs/embeddings.md).
    """

    name: str
    architectures: tuple[str, ...]
    factory: Factory
    description: str = ""


@dataclass(frozen=True)
class SchedulePolicySpec:
    """An order for the scheduler's waiting queue.

    ``factory(options: dict = ...) -> engine.managers.policy.SchedulePolicy``
    (``options``: the plugin's options, hook API 2; optional).
    """

    name: str
    factory: Factory
    description: str = ""
    #: the policy reads prefix-match lengths; the scheduler computes them first.
    cache_aware: bool = False


@dataclass(frozen=True)
class PlatformSpec:
    """A hardware platform.

    ``factory(options: dict = ...) -> engine.platforms.Platform`` (``options``: the
    plugin's options, hook API 2; optional). A platform whose ``is_available()``
    is True claims the machine; a ``fallback`` platform (cpu) is chosen only when
    no other platform claims it.
    """

    name: str
    factory: Factory
    device_type: str
    description: str = ""
    fallback: bool = False
    #: where this platform's tests ran on real hardware ("NVIDIA H100, H200"); empty means
    #: only on simulated devices. ``engine plugins list`` shows it. Since hook API 5.
    tested_on_hardware: str = ""


@dataclass(frozen=True)
class GrammarBackendSpec:
    """A grammar backend for structured output (JSON schema, regex, EBNF, structural tags).

    ``factory(tokenizer_info: engine.constrained.TokenizerInfo, options: dict = ...)
    -> engine.constrained.GrammarBackend``; the backend compiles grammar keys into
    compiled grammars and hands out per-request matchers that fill token bitmasks.
    Since hook API 4.
    """

    name: str
    factory: Factory
    description: str = ""
    #: grammar kinds it compiles: a subset of ``("json_schema", "regex", "ebnf",
    #: "structural_tag")`` (the sampling parameters); a request of another kind is a 400
    #: naming the field.
    grammar_kinds: tuple[str, ...] = ("json_schema", "regex", "ebnf")
    #: whether its matchers can roll back accepted tokens (else retraction re-runs the request).
    supports_rollback: bool = False


@dataclass(frozen=True)
class RouterPolicySpec:
    """How the router spreads requests over the ``--dp-size`` replicas (``--router-policy NAME``).

    ``factory(num_replicas: int, options: dict = ...) -> engine.router.RouterPolicy``; one
    instance per server, called in the main process for every request. Since hook API 4.
    """

    name: str
    factory: Factory
    description: str = ""


@dataclass(frozen=True)
class ToolCallParserSpec:
    """A tool-call format (``--tool-call-parser NAME``): reads calls out of a model's output.

    ``factory(options: dict = ...) -> engine.parsers.ToolCallParser``; built once per server
    (parsers are stateless: each streamed response gets its own ``parser.stream()``).
    Since hook API 4.
    """

    name: str
    factory: Factory
    description: str = ""


@dataclass(frozen=True)
class ReasoningParserSpec:
    """A reasoning format (``--reasoning-parser NAME``): splits ``reasoning_content`` off.

    ``factory(options: dict = ...) -> engine.parsers.ReasoningParser``; built once per server.
    Since hook API 4.
    """

    name: str
    factory: Factory
    description: str = ""


@dataclass(frozen=True)
class SpeculativeAlgorithmSpec:
    """A speculative-decoding proposer (``--speculative-algorithm NAME``).

    ``factory(ctx: engine.speculative.ProposerContext, options: dict = ...)
    -> engine.speculative.Proposer``; one instance per scheduler process. The proposer turns
    the running requests into draft tokens; the core verifies them in one target forward and
    keeps the longest agreeing prefix (``docs/speculative.md``). Since hook API 5.
    """

    name: str
    factory: Factory
    description: str = ""
    #: draft shapes it returns: ``("chain",)`` (a list of tokens per request); trees are a
    #: later extension of the same interface.
    draft_shapes: tuple[str, ...] = ("chain",)
    #: it runs a second model: ``--speculative-draft-model-path`` is required.
    needs_draft_model: bool = False
    #: it reads the target's hidden states (EAGLE): every target forward captures them
    #: (``Proposer.target_hidden_layers`` says which) and the proposer gets the kept positions'
    #: through ``Proposer.on_target_hidden``. Decode steps outside speculation then run eagerly.
    needs_hidden_states: bool = False


@dataclass(frozen=True)
class LoraBackendSpec:
    """A LoRA backend (``--lora-backend NAME``): the segmented shrink/expand products of the
    adapters of one batch.

    ``factory(options: dict = ...) -> engine.lora.backend.LoraBackend``; one instance per
    scheduler rank, shared by every LoRA-wrapped layer. Since hook API 7.
    """

    name: str
    factory: Factory
    #: device types it runs on; default ``("cuda",)``, like ``AttentionBackendSpec.device_types``.
    device_types: tuple[str, ...] = ("cuda",)
    description: str = ""


@dataclass(frozen=True)
class KvTransferSpec:
    """A KV transfer backend of prefill/decode disaggregation (``--disaggregation-transfer-backend
    NAME``): moves a request's prompt KV from a prefill server's rank to a decode server's.

    ``factory(ctx: engine.disaggregation.KvTransferContext, options: dict = ...) ->
    engine.disaggregation.KvTransferBackend``; one instance per scheduler rank of a server
    started with ``--disaggregation-mode``. Since hook API 8.
    """

    name: str
    factory: Factory
    #: device types whose KV pools it moves; default ``("cpu", "cuda")``.
    device_types: tuple[str, ...] = ("cpu", "cuda")
    description: str = ""


@dataclass(frozen=True)
class KvStorageTierSpec:
    """A KV storage tier of the hierarchical prefix cache (``--hicache-storage-backend NAME``):
    holds KV evicted from the device pool until a later prefix match loads it back.

    ``factory(layout: engine.mem_cache.kv_tier.KvLayout, num_tokens: int, options: dict = ...)
    -> engine.mem_cache.kv_tier.KvStorageTier``; one instance per scheduler rank (each holds its
    rank's shard of the KV heads). Since hook API 8.
    """

    name: str
    factory: Factory
    description: str = ""
    #: device types whose KV pools it backs; default ``("cpu", "cuda")``.
    device_types: tuple[str, ...] = ("cpu", "cuda")


@dataclass(frozen=True)
class PluginOption:
    """An option a plugin adds under its name (YAML ``plugin_options: {name: {key: value}}``).

    ``plugin`` must be the declaring plugin's entry-point name: the engine hands the
    values (defaults overridden by the user's) to that plugin's factories.
    """

    plugin: str
    key: str
    #: used when the user sets nothing; its type (when not None) is the accepted type.
    default: Any
    help: str = ""
    #: types accepted besides the default's, for options such as ``"auto"`` or a number; the
    #: plugin's factory still checks the value's range (hook API 6).
    accepts: tuple[type, ...] = ()


Register = Callable[[Any], None]


class EngineHookSpecs:
    """Hook specifications of the ``engine`` project."""

    @hookspec
    def register_attention_backends(self, register: Callable[[AttentionBackendSpec], None]) -> None:
        """Register attention backends by calling ``register(AttentionBackendSpec(...))``.

        Args:
            register: call once per backend.

        Not firstresult. Since hook API 1.
        """

    @hookspec
    def register_quantization_methods(self, register: Callable[[QuantMethodSpec], None]) -> None:
        """Register quantization methods by calling ``register(QuantMethodSpec(...))``.

        Not firstresult. Since hook API 1.
        """

    @hookspec
    def register_models(self, register: Callable[[ModelSpec], None]) -> None:
        """Register model architectures by calling ``register(ModelSpec(...))``.

        Not firstresult. Since hook API 1.
        """

    @hookspec
    def register_schedule_policies(self, register: Callable[[SchedulePolicySpec], None]) -> None:
        """Register schedule policies by calling ``register(SchedulePolicySpec(...))``.

        Not firstresult. Since hook API 1.
        """

    @hookspec
    def register_platforms(self, register: Callable[[PlatformSpec], None]) -> None:
        """Register hardware platforms by calling ``register(PlatformSpec(...))``.

        Not firstresult. Since hook API 1.
        """

    @hookspec
    def register_grammar_backends(self, register: Callable[[GrammarBackendSpec], None]) -> None:
        """Register grammar backends by calling ``register(GrammarBackendSpec(...))``.

        Not firstresult. Since hook API 4.
        """

    @hookspec
    def register_router_policies(self, register: Callable[[RouterPolicySpec], None]) -> None:
        """Register data-parallel router policies by calling ``register(RouterPolicySpec(...))``.

        Not firstresult. Since hook API 4.
        """

    @hookspec
    def register_tool_call_parsers(self, register: Callable[[ToolCallParserSpec], None]) -> None:
        """Register tool-call parsers by calling ``register(ToolCallParserSpec(...))``.

        Not firstresult. Since hook API 4.
        """

    @hookspec
    def register_reasoning_parsers(self, register: Callable[[ReasoningParserSpec], None]) -> None:
        """Register reasoning parsers by calling ``register(ReasoningParserSpec(...))``.

        Not firstresult. Since hook API 4.
        """

    @hookspec
    def register_speculative_algorithms(self, register: Callable[[SpeculativeAlgorithmSpec], None]) -> None:
        """Register speculative-decoding proposers by calling ``register(SpeculativeAlgorithmSpec(...))``.

        Not firstresult. Since hook API 5.
        """

    @hookspec
    def register_lora_backends(self, register: Callable[[LoraBackendSpec], None]) -> None:
        """Register LoRA backends by calling ``register(LoraBackendSpec(...))``.

        Not firstresult. Since hook API 7.
        """

    @hookspec
    def register_kv_transfer_backends(self, register: Callable[[KvTransferSpec], None]) -> None:
        """Register KV transfer backends by calling ``register(KvTransferSpec(...))``.

        Not firstresult. Since hook API 8.
        """

    @hookspec
    def register_kv_storage_tiers(self, register: Callable[[KvStorageTierSpec], None]) -> None:
        """Register KV storage tiers by calling ``register(KvStorageTierSpec(...))``.

        Not firstresult. Since hook API 8.
        """

    @hookspec
    def register_plugin_options(self, register: Callable[[PluginOption], None]) -> None:
        """Declare options under the plugin's name by calling ``register(PluginOption(...))``.

        Users set them in YAML under ``plugin_options: {<plugin>: {<key>: value}}`` or with
        ``--plugin-option <plugin>.<key>=<value>``; unknown keys are an error before the
        model loads. The plugin's factories receive the values (hook API 2).

        Not firstresult. Since hook API 1; ``PluginOption.plugin`` must be the plugin's own
        name since hook API 2.
        """


#: spec class -> (kind name used in listings and errors, hook name)
SPEC_KINDS: dict[type, tuple[str, str]] = {
    AttentionBackendSpec: ("attention", "register_attention_backends"),
    QuantMethodSpec: ("quantization", "register_quantization_methods"),
    ModelSpec: ("model", "register_models"),
    SchedulePolicySpec: ("policy", "register_schedule_policies"),
    PlatformSpec: ("platform", "register_platforms"),
    GrammarBackendSpec: ("grammar", "register_grammar_backends"),
    RouterPolicySpec: ("router", "register_router_policies"),
    ToolCallParserSpec: ("tool-parser", "register_tool_call_parsers"),
    ReasoningParserSpec: ("reasoning-parser", "register_reasoning_parsers"),
    SpeculativeAlgorithmSpec: ("speculative", "register_speculative_algorithms"),
    LoraBackendSpec: ("lora-backend", "register_lora_backends"),
    KvTransferSpec: ("kv-transfer", "register_kv_transfer_backends"),
    KvStorageTierSpec: ("kv-tier", "register_kv_storage_tiers"),
    PluginOption: ("option", "register_plugin_options"),
}


def call_with_accepted(fn: Callable[..., Any], *args: Any, **optional: Any) -> Any:
    """``fn(*args, **optional)``, leaving out the optional keywords ``fn`` does not accept.

    This is how the factory API grows without breaking older plugins (the pluggy rule
    applied to factories): an argument added in a later hook-API version reaches only
    the factories whose signature names it or that take ``**kwargs``.
    """
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: pass only what is required
        return fn(*args)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fn(*args, **optional)
    named = {p.name for p in params
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return fn(*args, **{k: v for k, v in optional.items() if k in named})


def resolve_factory(factory: Factory) -> Any:
    """Imports ``"module:attr"`` (dotted attr allowed) or returns a callable as is."""
    if not isinstance(factory, str):
        return factory
    import importlib

    module_name, _, attr = factory.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


__all__ = [
    "ENTRY_POINT_GROUP",
    "HOOK_API_VERSION",
    "AttentionBackendSpec",
    "EngineHookSpecs",
    "GrammarBackendSpec",
    "KvStorageTierSpec",
    "KvTransferSpec",
    "LoraBackendSpec",
    "ModelSpec",
    "PlatformSpec",
    "PluginOption",
    "QuantMethodSpec",
    "ReasoningParserSpec",
    "RouterPolicySpec",
    "SchedulePolicySpec",
    "SpeculativeAlgorithmSpec",
    "ToolCallParserSpec",
    "call_with_accepted",
    "hookimpl",
    "hookspec",
    "resolve_factory",
]
