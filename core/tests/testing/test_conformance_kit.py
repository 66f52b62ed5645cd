"""The conformance kit fails, with a message naming the cause (and the seed), on plugins that are
wrong in each way it claims to check; its draws reproduce."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
from typing import Any

import pytest

from engine import plugins
from engine.hookspecs import AttentionBackendSpec, ModelSpec, PluginOption, QuantMethodSpec, SchedulePolicySpec, hookimpl
from engine.testing import (
    AttentionBackendConformance,
    ModelConformance,
    QuantMethodConformance,
    SchedulePolicyConformance,
)
from engine.testing.conformance._common import KIT_SEED, derive_seed

Failed = pytest.fail.Exception


def _install(monkeypatch: pytest.MonkeyPatch, name: str, **hooks: Any) -> None:
    """Makes a plugin module with ``hooks`` part of the registry the kit (and the engine) reads."""
    module = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(module, hook_name, hookimpl(fn))
    registry = plugins.PluginRegistry(extra_plugins=[(name, module)])
    assert registry.plugins[name].status == "ok", registry.plugins[name].error
    monkeypatch.setattr(plugins, "get_registry", lambda disabled=(): registry)


def test_seeds_do_not_depend_on_the_process() -> None:
    code = "from engine.testing.conformance._common import derive_seed, KIT_SEED; print(derive_seed(KIT_SEED, 'x', 4))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert int(out.stdout) == derive_seed(KIT_SEED, "x", 4) != derive_seed(KIT_SEED, "x", 1)


def test_kit_builds_plugins_with_their_declared_options_as_the_engine_does(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    def make_policy(options: dict[str, Any]) -> Any:  # hook API 2: a factory that needs its options
        from engine_policy_fcfs import FcfsPolicy

        seen.append(options)
        return FcfsPolicy()

    def register_schedule_policies(register: Any) -> None:
        register(SchedulePolicySpec(name="opt_policy", factory=make_policy))

    def register_plugin_options(register: Any) -> None:
        register(PluginOption(plugin="opt_policy", key="depth", default=3, help="a test option"))

    _install(monkeypatch, "opt_policy", register_schedule_policies=register_schedule_policies,
             register_plugin_options=register_plugin_options)

    class Kit(SchedulePolicyConformance):
        policy_name = "opt_policy"

    Kit().test_orders_deterministically()
    assert seen and all(o == {"depth": 3} for o in seen), seen


# -- attention ------------------------------------------------------------------------------
def test_cpu_backend_with_the_default_device_types_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    def register_attention_backends(register: Any) -> None:
        register(AttentionBackendSpec(name="cpu_mine", factory="engine_attention_torch_native.backend:create"))

    _install(monkeypatch, "cpu_mine", register_attention_backends=register_attention_backends)

    class Kit(AttentionBackendConformance):
        backend_name = "cpu_mine"

    with pytest.raises(Failed, match=r"on cpu.*device_types=\('cuda',\) \(the default when a spec names none\)"):
        Kit().test_declares_the_kit_device_and_page_sizes()
    with pytest.raises(Failed, match="would refuse"):
        Kit().test_matches_reference("extend")  # every test checks it first


class _DropsDecodeRowsOfMixed:
    """A backend that gets MIXED batches wrong: decode rows come out as zeros."""

    @staticmethod
    def create(ctx: Any) -> Any:
        from engine_attention_torch_native.backend import TorchNativeAttnBackend

        class Backend(TorchNativeAttnBackend):
            def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, fb: Any, save_kv_cache: bool = True) -> Any:
                out = super().forward_extend(q, k, v, layer, fb, save_kv_cache)
                if fb.forward_mode.is_mixed():
                    first_decode = sum(fb.extend_seq_lens_cpu[: fb.num_extend_reqs])
                    out[first_decode:] = 0
                return out

        return Backend(ctx)


def test_mixed_batches_catch_a_backend_wrong_on_them(monkeypatch: pytest.MonkeyPatch) -> None:
    def register_attention_backends(register: Any) -> None:
        register(AttentionBackendSpec(name="bad_mixed", factory=_DropsDecodeRowsOfMixed.create, device_types=("cpu",)))

    _install(monkeypatch, "bad_mixed", register_attention_backends=register_attention_backends)

    class Kit(AttentionBackendConformance):
        backend_name = "bad_mixed"

    Kit().test_matches_reference("extend")
    Kit().test_matches_reference("decode")
    with pytest.raises(AssertionError, match=r"\(decode, .*mixed, torch.float32, page 1, .*seed \d+\)"):
        Kit().test_mixed_batch_matches_reference()


class _Fp8ScalesIgnored:
    """A backend that declares an fp8 KV cache but reads the pool without its scales."""

    @staticmethod
    def create(ctx: Any) -> Any:
        from engine_attention_torch_native.backend import TorchNativeAttnBackend

        class Backend(TorchNativeAttnBackend):
            def forward(self, q: Any, k: Any, v: Any, layer: Any, fb: Any, save_kv_cache: bool = True) -> Any:
                if save_kv_cache:
                    self.save_kv(layer, fb, k, v)  # stored with the scales...
                unscaled = dataclasses.replace(_info(layer), k_scale=1.0, v_scale=1.0)
                return super().forward(q, k, v, unscaled, fb, save_kv_cache=False)  # ...read without

        return Backend(ctx)


def _info(layer: Any) -> Any:
    from engine.attention import AttentionLayerInfo

    return AttentionLayerInfo(layer.layer_id, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling,
                              layer.logit_cap, layer.sliding_window_size, layer.v_head_dim, layer.k_scale, layer.v_scale)


def test_fp8_kv_case_catches_a_backend_that_ignores_the_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    def register_attention_backends(register: Any) -> None:
        register(AttentionBackendSpec(name="fp8_unscaled", factory=_Fp8ScalesIgnored.create, device_types=("cpu",),
                                      kv_cache_dtypes=("auto", "fp8_e4m3")))

    _install(monkeypatch, "fp8_unscaled", register_attention_backends=register_attention_backends)

    class Kit(AttentionBackendConformance):
        backend_name = "fp8_unscaled"

    Kit().test_matches_reference("decode")  # right without an fp8 pool (scales of 1.0)
    with pytest.raises(AssertionError, match=r"KV fp8_e4m3, seed \d+"):
        Kit().test_fp8_kv_cache_matches_reference("decode")


def test_fp8_kv_case_skips_a_backend_that_does_not_declare_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def register_attention_backends(register: Any) -> None:
        register(AttentionBackendSpec(name="bf16_only", factory="engine_attention_torch_native.backend:create",
                                      device_types=("cpu",)))

    _install(monkeypatch, "bf16_only", register_attention_backends=register_attention_backends)

    class Kit(AttentionBackendConformance):
        backend_name = "bf16_only"

    with pytest.raises(pytest.skip.Exception, match="declares no fp8 KV cache"):
        Kit().test_fp8_kv_cache_matches_reference("extend")


# -- quantization ---------------------------------------------------------------------------
class _RowsReversed:
    """A method that stores its weight with the output rows reversed: fused shards land in each
    other's places."""

    @staticmethod
    def create(config: dict[str, Any]) -> Any:
        from engine.layers import QuantizationConfig, UnquantizedLinearMethod

        class Method(UnquantizedLinearMethod):
            def process_weights_after_loading(self, layer: Any) -> None:
                layer.weight.data = layer.weight.data.flip(0)

        class Config(QuantizationConfig):
            @classmethod
            def from_config(cls, config: dict[str, Any]) -> Config:
                return cls()

            def get_linear_method(self, layer: Any, prefix: str) -> Any:
                return Method()

        return Config()


def test_fused_shards_out_of_place_fail_naming_the_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    def register_quantization_methods(register: Any) -> None:
        register(QuantMethodSpec(name="reversed", factory=_RowsReversed.create, device_types=("cpu",)))

    _install(monkeypatch, "reversed", register_quantization_methods=register_quantization_methods)

    class Kit(QuantMethodConformance):
        method_name = "reversed"

    with pytest.raises(AssertionError, match=r"qkv_proj: shard q_proj relative error .* seed \d+"):
        Kit().test_fused_shards_load_into_place("qkv_proj")


def test_serialized_format_must_be_one_the_engine_picks(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    def register_quantization_methods(register: Any) -> None:
        register(QuantMethodSpec(name="fp8_alias", factory="engine_quant_fp8.config:Fp8Config.from_config",
                                 device_types=("cpu",), checkpoint_methods=()))

    _install(monkeypatch, "fp8_alias", register_quantization_methods=register_quantization_methods)

    class Kit(QuantMethodConformance):
        method_name = "fp8_alias"
        serialized_config = {"quant_method": "fp8"}

    with pytest.raises(AssertionError, match=r"quant_method 'fp8' is not in QuantMethodSpec.checkpoint_methods"):
        Kit().test_serialized_checkpoint_loads("down_proj", tmp_path)


def test_a_method_without_a_checkpoint_format_skips_with_the_reason(tmp_path: Any) -> None:
    class Kit(QuantMethodConformance):
        method_name = "fp8"

    with pytest.raises(pytest.skip.Exception, match="serialized_config is None"):
        Kit().test_serialized_checkpoint_loads("down_proj", tmp_path)


# -- models ---------------------------------------------------------------------------------
class _LogitsOffByOnePercent:
    @staticmethod
    def model_class(architecture: str) -> type:
        from engine_models_llama.llama import LlamaForCausalLM

        class Wrong(LlamaForCausalLM):
            def forward(self, input_ids: Any, positions: Any, forward_batch: Any) -> Any:
                out = super().forward(input_ids, positions, forward_batch)
                out.next_token_logits = out.next_token_logits * 1.01
                return out

        return Wrong


def test_a_new_architecture_is_served_by_its_plugin_and_checked(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Any) -> None:
    from engine.testing.checkpoints import load_hf_model, make_tiny_checkpoint

    def register_models(register: Any) -> None:
        register(ModelSpec(name="wrong_model", architectures=("WrongForCausalLM",),
                           factory=_LogitsOffByOnePercent.model_class))

    _install(monkeypatch, "wrong_model", register_models=register_models)

    class Kit(ModelConformance):
        architecture = "WrongForCausalLM"
        reference_model = "LlamaForCausalLM"
        plugin_name = "wrong_model"

    Kit().test_architecture_is_served_by_the_plugin()
    path = make_tiny_checkpoint(str(tmp_path), "WrongForCausalLM", reference="LlamaForCausalLM")
    prompts = [[5, 6, 7, 8], [9, 10]]
    with pytest.raises(AssertionError, match=r"max abs logit error .*WrongForCausalLM, seeds"):
        Kit().test_logits_match_transformers(path, load_hf_model(path, reference="LlamaForCausalLM"), prompts)


def test_plugin_name_catches_the_builtin_answering() -> None:
    class Kit(ModelConformance):
        architecture = "LlamaForCausalLM"
        plugin_name = "my_model"

    with pytest.raises(AssertionError, match="served by plugin 'llama', not 'my_model'"):
        Kit().test_architecture_is_served_by_the_plugin()
