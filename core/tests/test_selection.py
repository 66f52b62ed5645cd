"""select_components: every component chosen and checked before the model loads; options reach
every kind's factory; the start-up log names each component with its distribution."""

from __future__ import annotations

import logging
import re
import types
from typing import Any

import pytest
import torch

from engine import plugins
from engine.config import ServerArgs
from engine.errors import ConfigError, PluginError
from engine.hookspecs import ModelSpec, PluginOption, QuantMethodSpec, SchedulePolicySpec, hookimpl
from engine.layers.quantization import QuantizationConfig
from engine.managers.policy import SchedulePolicy
from engine.selection import select_components

# What the recording factories below were given, by kind.
SEEN: dict[str, Any] = {}


class RecordingPolicy(SchedulePolicy):
    def __init__(self, options: dict[str, Any]) -> None:
        SEEN["policy"] = options

    def order(self, queue: list[Any], ctx: Any) -> list[Any]:
        return list(queue)


class Bf16OnlyQuant(QuantizationConfig):
    name = "recq"

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    @classmethod
    def from_config(cls, config: dict[str, Any], options: dict[str, Any] | None = None) -> Bf16OnlyQuant:
        SEEN["quant"] = (config, options)
        return cls(options or {})

    def get_linear_method(self, layer: Any, prefix: str) -> None:
        return None

    def supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]


class RecordingModel(torch.nn.Module):
    def __init__(self, config: Any, quant_config: Any, options: dict[str, Any]) -> None:
        super().__init__()
        SEEN["model"] = (quant_config, options)


def _recorder() -> types.ModuleType:
    mod = types.ModuleType("rec")

    @hookimpl
    def register_schedule_policies(register):  # type: ignore[no-untyped-def]
        register(SchedulePolicySpec(name="recorded", factory=RecordingPolicy))

    @hookimpl
    def register_quantization_methods(register):  # type: ignore[no-untyped-def]
        register(QuantMethodSpec(name="recq", factory=Bf16OnlyQuant.from_config, device_types=("cpu",)))

    @hookimpl
    def register_models(register):  # type: ignore[no-untyped-def]
        register(ModelSpec(name="rec", architectures=("RecForCausalLM",), factory=RecordingModel))

    @hookimpl
    def register_plugin_options(register):  # type: ignore[no-untyped-def]
        register(PluginOption(plugin="rec", key="depth", default=3))
        register(PluginOption(plugin="rec", key="mode", default="fast"))

    for fn in (register_schedule_policies, register_quantization_methods, register_models, register_plugin_options):
        setattr(mod, fn.__name__, fn)
    return mod


@pytest.fixture()
def recorder(monkeypatch: pytest.MonkeyPatch) -> plugins.PluginRegistry:
    SEEN.clear()
    reg = plugins.PluginRegistry(extra_plugins=[("rec", _recorder())])
    monkeypatch.setattr(plugins, "get_registry", lambda disabled=(): reg)
    return reg


def _hf_config(arch: str = "RecForCausalLM", dtype: str = "bfloat16") -> Any:
    return types.SimpleNamespace(architectures=[arch], torch_dtype=dtype, quantization_config=None)


def _args(**values: Any) -> ServerArgs:
    return ServerArgs.from_dict({"platform": "cpu", **values})


def test_policy_quant_and_model_factories_receive_their_plugins_options(recorder: plugins.PluginRegistry) -> None:
    args = _args(schedule_policy="recorded", quant="recq", plugin_options={"rec": {"depth": 5}})
    selection = select_components(args, _hf_config())
    expected = {"depth": 5, "mode": "fast"}  # the user's value over the declared defaults
    assert SEEN["quant"] == ({}, expected)
    selection.create_policy()
    assert SEEN["policy"] == expected
    selection.create_model(_hf_config())
    assert SEEN["model"] == (selection.quant_config, expected)
    # Older factories that take no options keep working: fcfs and the cpu platform are hook API 1.
    assert select_components(_args(), _hf_config()).create_policy().__class__.__name__ == "FcfsPolicy"


def test_activation_dtype_the_quant_method_cannot_run_is_refused(recorder: plugins.PluginRegistry) -> None:
    with pytest.raises(ConfigError) as err:
        select_components(_args(quant="recq", dtype="float32"), _hf_config())
    assert str(err.value) == "--dtype float32: quantization method 'recq' cannot run activations in float32; accepted: bfloat16"
    with pytest.raises(ConfigError, match=r"--dtype auto \(resolved to float16\): .* accepted: bfloat16"):
        select_components(_args(quant="recq"), _hf_config(dtype="float16"))
    assert select_components(_args(quant="recq"), _hf_config()).dtype == torch.bfloat16


def test_quant_method_that_does_not_run_on_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("gpuq")

    @hookimpl
    def register_quantization_methods(register):  # type: ignore[no-untyped-def]
        register(QuantMethodSpec(name="gpuq", factory=Bf16OnlyQuant.from_config, device_types=("cuda",)))

    mod.register_quantization_methods = register_quantization_methods  # type: ignore[attr-defined]
    reg = plugins.PluginRegistry(extra_plugins=[("gpuq", mod)])
    monkeypatch.setattr(plugins, "get_registry", lambda disabled=(): reg)
    with pytest.raises(ConfigError, match=r"quantization method 'gpuq' does not run on platform 'cpu' \(runs on: cuda\); "
                                          r"methods for cpu: .*fp8"):
        select_components(_args(quant="gpuq"), _hf_config("LlamaForCausalLM"))


def test_attention_backend_for_another_platform_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        # flashinfer, not triton: under TRITON_INTERPRET=1 (CPU test runs) triton declares cpu too.
        select_components(_args(attention="flashinfer"), _hf_config("LlamaForCausalLM"))
    assert re.fullmatch(r"--attention: backend 'flashinfer' does not run on cpu \(it supports: cuda\); "
                        r"backends for platform 'cpu': (\w+, )*torch_native(, \w+)*", str(err.value)), str(err.value)


def test_disabled_default_backend_names_its_plugin() -> None:
    with pytest.raises(PluginError, match=r"attention backend 'torch_native' is provided by plugin 'torch_native' "
                                          r"\(plugserve-attention-torch-native 0.1.0\), which is disabled "
                                          r"\(--disable-plugin torch_native\); platform 'cpu' picks it"):
        select_components(_args(disable_plugin=["torch_native"]), _hf_config("LlamaForCausalLM"))


def test_start_up_log_names_every_component(llama_ckpt: str, caplog: pytest.LogCaptureFixture) -> None:
    from engine.model_executor.model_runner import ModelRunner

    caplog.set_level(logging.INFO, logger="engine.model_executor.model_runner")
    ModelRunner(ServerArgs.from_dict({"model_path": llama_ckpt, "platform": "cpu", "max_total_tokens": 256,
                                      "schedule_policy": "lpm"}), llama_ckpt)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("platform: cpu (plugserve-platform-cpu 0.1.0) — cpu (") for line in lines), lines
    for expected in ("attention: torch_native (plugserve-attention-torch-native 0.1.0)",
                     "quant: none; activation dtype float32",
                     "model: llama for LlamaForCausalLM (plugserve-models-llama 0.1.0)",
                     "policy: lpm (plugserve-policy-lpm 0.1.0)"):
        assert expected in lines, lines


def test_gguf_blocks_on_a_checkpoint_that_is_not_gguf_fail_in_preflight(llama_ckpt: str) -> None:
    """``--quant gguf`` reads blocks from a GGUF file: a Hugging Face directory is refused before
    any process starts; ``--load-format dummy`` (benchmarks) needs no file."""
    from engine.errors import ModelLoadError

    pytest.importorskip("engine_quant_gguf")
    hf = _hf_config("LlamaForCausalLM")
    with pytest.raises(ModelLoadError, match=r"--quant gguf: .* is not a GGUF checkpoint; accepted: a GGUF file"):
        select_components(_args(model_path=llama_ckpt, quant="gguf"), hf)
    assert select_components(_args(model_path=llama_ckpt, quant="gguf", load_format="dummy"), hf).quant is not None


def test_gguf_default_follows_the_one_switch(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """With no --quant, a GGUF keeps its blocks where its device's switch says so
    (``KEEP_GGUF_QUANTIZED_ON_CPU``: on, for float32; ``KEEP_GGUF_QUANTIZED_ON_CUDA``: off), and
    only where the gguf plugin is installed and enabled."""
    from engine import selection
    from engine.model_executor import gguf_loader

    pytest.importorskip("engine_quant_gguf")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    reg = plugins.get_registry()
    cuda, cpu = types.SimpleNamespace(device_type="cuda"), types.SimpleNamespace(device_type="cpu")
    assert selection._default_gguf_method(_args(model_path=str(gguf)), cuda, reg) is None  # the shipped default
    monkeypatch.setattr(gguf_loader, "KEEP_GGUF_QUANTIZED_ON_CUDA", True)
    assert selection._default_gguf_method(_args(model_path=str(gguf)), cuda, reg).name == "gguf"
    assert selection._default_gguf_method(_args(), cuda, reg).name == "gguf"  # the default model is a GGUF
    assert selection._default_gguf_method(_args(model_path=str(gguf)), cpu, reg).name == "gguf"
    assert selection._default_gguf_method(_args(), cpu, reg).name == "gguf"
    assert selection._default_gguf_method(_args(model_path=str(gguf), dtype="bfloat16"), cpu, reg) is None
    assert selection._default_gguf_method(_args(model_path=str(gguf), disable_plugin=["gguf"]), cpu, reg) is None
    monkeypatch.setattr(gguf_loader, "KEEP_GGUF_QUANTIZED_ON_CPU", False)
    assert selection._default_gguf_method(_args(model_path=str(gguf)), cpu, reg) is None
    assert selection._default_gguf_method(_args(model_path=str(tmp_path / "x.safetensors")), cuda, reg) is None
    assert selection._default_gguf_method(_args(model_path=str(gguf), disable_plugin=["gguf"]), cuda, reg) is None
