"""The hook API 1 surface, as recorded from the engine of that release, is still all there.

The five corpus plugins use part of it; this checks the rest of what docs/plugins.md of hook API 1
offered a plugin: the hooks and their argument, the spec dataclasses with their fields in order
(a plugin may pass them positionally) and defaults, the import paths of the layer SDK and of the
contracts, and the kit attributes authors set. Later hook API versions only add to it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest

from engine import hookspecs

# (field, default) in declaration order; REQUIRED: no default.
REQUIRED = object()
SPEC_FIELDS = {
    "AttentionBackendSpec": [("name", REQUIRED), ("factory", REQUIRED), ("description", ""), ("device_types", ("cuda",)),
                             ("page_sizes", ()), ("supports_cuda_graph", False)],
    "QuantMethodSpec": [("name", REQUIRED), ("factory", REQUIRED), ("description", ""), ("device_types", ("cuda",)),
                        ("checkpoint_methods", ())],
    "ModelSpec": [("name", REQUIRED), ("architectures", REQUIRED), ("factory", REQUIRED), ("description", "")],
    "SchedulePolicySpec": [("name", REQUIRED), ("factory", REQUIRED), ("description", ""), ("cache_aware", False)],
    "PlatformSpec": [("name", REQUIRED), ("factory", REQUIRED), ("device_type", REQUIRED), ("description", ""),
                     ("fallback", False)],
    "PluginOption": [("plugin", REQUIRED), ("key", REQUIRED), ("default", REQUIRED), ("help", "")],
}
HOOKS = ("register_attention_backends", "register_quantization_methods", "register_models",
         "register_schedule_policies", "register_platforms", "register_plugin_options")
# Where hook API 1 plugins imported each name from (the built-in plugins of that release did the same).
IMPORTS = {
    "engine.hookspecs": ["hookimpl", "resolve_factory", *SPEC_FIELDS],
    "engine.attention": ["AttentionBackend", "AttentionContext", "AttentionLayerInfo"],
    "engine.platforms": ["Platform"],
    "engine.managers.policy": ["SchedulePolicy", "PolicyContext"],
    "engine.layers.activation": ["SiluAndMul"],
    "engine.layers.layernorm": ["RMSNorm"],
    "engine.layers.linear": ["ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
                             "ReplicatedLinear", "RowParallelLinear", "UnquantizedLinearMethod", "set_weight_attrs"],
    "engine.layers.quantization": ["QuantizationConfig", "LinearMethodBase", "FusedMoEMethodBase"],
    "engine.layers.logits_processor": ["LogitsProcessor", "LogitsProcessorOutput"],
    "engine.layers.radix_attention": ["RadixAttention"],
    "engine.layers.rotary_embedding": ["get_rope"],
    "engine.layers.vocab_parallel_embedding": ["ParallelLMHead", "VocabParallelEmbedding"],
    "engine.model_executor.forward_batch": ["ForwardBatch", "ForwardMode"],
    "engine.distributed": ["get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank"],
    "engine.testing": ["AttentionBackendConformance", "ModelConformance", "PlatformConformance",
                       "QuantMethodConformance", "SchedulePolicyConformance"],
    "engine.testing.checkpoints": ["make_tiny_checkpoint", "load_hf_model", "hf_greedy", "hf_last_logits"],
}
KIT_ATTRIBUTES = {
    "AttentionBackendConformance": ["backend_name", "device", "dtypes", "page_sizes", "atol", "num_heads",
                                    "num_kv_heads", "head_dim"],
    "ModelConformance": ["architecture", "config_overrides", "server_args", "logits_atol", "max_new_tokens",
                         "device", "dtype", "tie_tolerance"],
    "SchedulePolicyConformance": ["policy_name"],
    "PlatformConformance": ["platform_name"],
    "QuantMethodConformance": ["method_name", "max_rel_error", "device", "dtype"],
}


@pytest.mark.parametrize("spec", sorted(SPEC_FIELDS))
def test_spec_fields_keep_their_order_and_defaults(spec: str) -> None:
    fields = dataclasses.fields(getattr(hookspecs, spec))
    old = SPEC_FIELDS[spec]
    assert [f.name for f in fields[: len(old)]] == [name for name, _ in old], (
        f"{spec}: hook API 1 fields {[n for n, _ in old]} must stay first and in order; now {[f.name for f in fields]}")
    for field, (name, default) in zip(fields, old):
        got = REQUIRED if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING \
            else field.default
        assert got == default, f"{spec}.{name}: default {got!r}, hook API 1 had {default!r}"
    for field in fields[len(old):]:
        assert field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING, (
            f"{spec}.{field.name} was added without a default: a hook API 1 plugin does not pass it")


@pytest.mark.parametrize("hook", HOOKS)
def test_hooks_take_register(hook: str) -> None:
    params = list(inspect.signature(getattr(hookspecs.EngineHookSpecs, hook)).parameters)
    assert params[:2] == ["self", "register"], f"{hook}{params}"


@pytest.mark.parametrize("module", sorted(IMPORTS))
def test_import_paths(module: str) -> None:
    mod = importlib.import_module(module)
    missing = [name for name in IMPORTS[module] if not hasattr(mod, name)]
    assert not missing, f"{module} no longer has {missing}"


@pytest.mark.parametrize("kit", sorted(KIT_ATTRIBUTES))
def test_kit_attributes(kit: str) -> None:
    import engine.testing

    cls = getattr(engine.testing, kit)
    missing = [name for name in KIT_ATTRIBUTES[kit] if not hasattr(cls, name)]
    assert not missing, f"{kit} no longer reads {missing}"


# The methods a hook API 1 subclass had to implement. A base class may gain methods with defaults;
# a new abstract one would make every older subclass impossible to instantiate.
ABSTRACT = {
    ("engine.attention", "AttentionBackend"): {"init_forward_metadata", "forward_extend", "forward_decode"},
    ("engine.platforms", "Platform"): {"is_available", "distributed_backend", "memory_info",
                                       "default_attention_backend"},
    ("engine.managers.policy", "SchedulePolicy"): {"order"},
    ("engine.layers.quantization", "QuantizationConfig"): {"from_config", "get_linear_method"},
    ("engine.layers.quantization", "LinearMethodBase"): {"create_weights", "apply"},
    ("engine.layers.quantization", "FusedMoEMethodBase"): {"create_weights", "apply"},
}


@pytest.mark.parametrize(("module", "name"), sorted(ABSTRACT))
def test_base_classes_gain_no_abstract_methods(module: str, name: str) -> None:
    cls = getattr(importlib.import_module(module), name)
    added = set(cls.__abstractmethods__) - ABSTRACT[(module, name)]
    assert not added, f"{name} gained abstract methods {sorted(added)}: give them a default implementation"
