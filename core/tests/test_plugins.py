"""The plugin registry facade: discovery, allowlist, disabling, broken plugins, errors."""

from __future__ import annotations

import types

import pytest

from engine import plugins
from engine.errors import PluginError
from engine.hookspecs import AttentionBackendSpec, PlatformSpec, SchedulePolicySpec, hookimpl
from engine.platforms import Platform


def _module(name: str, **hooks: object) -> types.ModuleType:
    mod = types.ModuleType(name)
    for key, fn in hooks.items():
        setattr(mod, key, fn)
    return mod


def test_builtin_plugins_are_discovered() -> None:
    infos = {p.name: p for p in plugins.list_plugins()}
    for name, dist in [("torch_native", "plugserve-attention-torch-native"), ("cpu", "plugserve-platform-cpu"),
                       ("llama", "plugserve-models-llama"), ("fcfs", "plugserve-policy-fcfs")]:
        assert infos[name].distribution == dist and infos[name].status == "ok"
    assert "torch_native" in plugins.attention_backends()
    assert "LlamaForCausalLM" in plugins.model_architectures()


def test_unknown_backend_names_installed_and_closest() -> None:
    with pytest.raises(PluginError) as err:
        plugins.get_attention_backend("torch_nativ")
    msg = str(err.value)
    assert "unknown attention backend 'torch_nativ'" in msg and "torch_native" in msg and "did you mean" in msg


def test_known_but_uninstalled_name_suggests_distribution() -> None:
    with pytest.raises(PluginError, match="pip install plugserve-attention-flashinfer"):
        plugins.PluginRegistry(load_entry_points=False).get("attention", "flashinfer", "attention backend")


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(PluginError, match="no installed model plugin provides architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        plugins.get_model_spec("GPT2LMHeadModel")


def test_disabled_plugin_is_listed_and_unusable() -> None:
    reg = plugins.PluginRegistry(disabled={"fcfs"})
    assert reg.plugins["fcfs"].status == "disabled"
    with pytest.raises(PluginError) as err:
        reg.get("policy", "fcfs", "schedule policy")
    assert str(err.value) == ("schedule policy 'fcfs' is provided by plugin 'fcfs' (plugserve-policy-fcfs 0.1.0), "
                              "which is disabled (--disable-plugin fcfs)")


def test_disabled_by_env_and_allowlist_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = plugins.PluginRegistry(env_disabled={"lpm"})
    with pytest.raises(PluginError, match=r"plugin 'lpm' \(plugserve-policy-lpm 0.1.0\), which is disabled "
                                          r"\(ENGINE_DISABLE_PLUGINS=lpm\)"):
        reg.get("policy", "lpm", "schedule policy")
    reg = plugins.PluginRegistry(allowlist={"cpu", "llama", "fcfs"})
    with pytest.raises(PluginError, match=r"disabled \(not in ENGINE_PLUGINS=cpu,fcfs,llama\)"):
        reg.get("attention", "torch_native", "attention backend")


def test_unknown_name_with_nothing_disabled_lists_installed() -> None:
    # No disabled plugin provides it: the message lists what is installed, as before.
    with pytest.raises(PluginError, match=r"unknown schedule policy 'lifo'; installed: .*fcfs"):
        plugins.PluginRegistry(disabled={"lpm"}).get("policy", "lifo", "schedule policy")


def test_allowlist_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.ALLOWLIST_ENV, "cpu,llama")
    plugins.reset_registry()
    try:
        status = {p.name: p.status for p in plugins.list_plugins()}
        assert status["cpu"] == "ok" and status["torch_native"] == "disabled"
    finally:
        monkeypatch.delenv(plugins.ALLOWLIST_ENV)
        plugins.reset_registry()


def test_broken_registration_is_listed_with_error() -> None:
    @hookimpl
    def register_attention_backends(register):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    reg = plugins.PluginRegistry(load_entry_points=False,
                                 extra_plugins=[("bad", _module("bad", register_attention_backends=register_attention_backends))])
    assert reg.plugins["bad"].status == "broken" and "boom" in reg.plugins["bad"].error


def test_entry_point_whose_metadata_vanished_is_broken_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution being uninstalled while the registry scans: its metadata read fails."""
    import importlib_metadata

    class Vanishing:
        name, group, value = "going", plugins.ENTRY_POINT_GROUP, "gone_module"

        @property
        def dist(self) -> object:
            raise importlib_metadata.MetadataNotFound("No package metadata was found.")

    real = importlib_metadata.entry_points

    def entry_points(**kw: object) -> list[object]:
        return [*real(**kw), Vanishing()]

    monkeypatch.setattr(importlib_metadata, "entry_points", entry_points)
    reg = plugins.PluginRegistry()
    assert reg.plugins["going"].status == "broken" and "unreadable package metadata" in reg.plugins["going"].error
    assert reg.plugins["torch_native"].status == "ok"


def test_wrong_spec_type_marks_plugin_broken() -> None:
    @hookimpl
    def register_attention_backends(register):  # type: ignore[no-untyped-def]
        register(SchedulePolicySpec(name="x", factory="x:y"))

    reg = plugins.PluginRegistry(load_entry_points=False,
                                 extra_plugins=[("odd", _module("odd", register_attention_backends=register_attention_backends))])
    assert reg.plugins["odd"].status == "broken" and "expects AttentionBackendSpec" in reg.plugins["odd"].error


def test_hook_with_fewer_arguments_is_accepted() -> None:
    # pluggy rule: implementations may take fewer arguments than the spec.
    @hookimpl
    def register_attention_backends():  # type: ignore[no-untyped-def]
        return None

    reg = plugins.PluginRegistry(load_entry_points=False,
                                 extra_plugins=[("quiet", _module("quiet", register_attention_backends=register_attention_backends))])
    assert reg.plugins["quiet"].status == "ok"


def test_unknown_hook_is_an_error() -> None:
    @hookimpl
    def register_attention_backend(register):  # type: ignore[no-untyped-def]  (typo: no trailing s)
        pass

    with pytest.raises(Exception, match="unknown hook"):
        plugins.PluginRegistry(load_entry_points=False,
                               extra_plugins=[("typo", _module("typo", register_attention_backend=register_attention_backend))])


def test_conflicting_names_are_an_error_when_selected() -> None:
    def make(owner: str) -> types.ModuleType:
        @hookimpl
        def register_attention_backends(register):  # type: ignore[no-untyped-def]
            register(AttentionBackendSpec(name="dup", factory=f"{owner}:create"))
        return _module(owner, register_attention_backends=register_attention_backends)

    reg = plugins.PluginRegistry(load_entry_points=False, extra_plugins=[("a", make("a")), ("b", make("b"))])
    with pytest.raises(PluginError, match="registered by several plugins"):
        reg.get("attention", "dup", "attention backend")


class _FakeAccel(Platform):
    name = "fake"
    device_type = "cpu"

    def is_available(self) -> bool:
        return True

    def distributed_backend(self) -> str:
        return "gloo"

    def memory_info(self, device):  # type: ignore[no-untyped-def]
        return (1, 2)

    def default_attention_backend(self) -> str:
        return "torch_native"


def test_two_platforms_claiming_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def make(name: str) -> types.ModuleType:
        @hookimpl
        def register_platforms(register):  # type: ignore[no-untyped-def]
            register(PlatformSpec(name=name, factory=_FakeAccel, device_type="cpu"))
        return _module(name, register_platforms=register_platforms)

    reg = plugins.PluginRegistry(extra_plugins=[("acc1", make("acc1")), ("acc2", make("acc2"))])
    monkeypatch.setattr(plugins, "get_registry", lambda disabled=(): reg)
    with pytest.raises(PluginError, match="several platforms claim this machine .*--platform"):
        plugins.select_platform(None)
    # --platform decides; the cpu fallback is not chosen while an accelerator claims the machine.
    assert isinstance(plugins.select_platform("acc2"), _FakeAccel)


def test_fallback_platform_when_nothing_else_claims() -> None:
    reg = plugins.PluginRegistry()
    names = [n for n, e in reg.entries["platform"].items() if e.spec.fallback]
    assert names == ["cpu"]


class _OptionedPlatform(_FakeAccel):
    """A hook-API-2 platform: its factory takes options; its default sees the enabled backends."""

    def __init__(self, options: dict) -> None:  # type: ignore[type-arg]
        self.options = options
        self.told: tuple[str, ...] = ()

    def default_attention_backend(self, available) -> str:  # type: ignore[no-untyped-def, override]
        self.told = tuple(available)
        return "torch_native"


def test_platform_factory_gets_options_and_default_sees_enabled_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.hookspecs import PluginOption

    @hookimpl
    def register_platforms(register):  # type: ignore[no-untyped-def]
        register(PlatformSpec(name="opt_plat", factory=_OptionedPlatform, device_type="cpu"))

    @hookimpl
    def register_plugin_options(register):  # type: ignore[no-untyped-def]
        register(PluginOption(plugin="optplat", key="cores", default=4))

    mod = _module("optplat", register_platforms=register_platforms, register_plugin_options=register_plugin_options)
    reg = plugins.PluginRegistry(disabled={"triton"}, extra_plugins=[("optplat", mod)])
    monkeypatch.setattr(plugins, "get_registry", lambda disabled=(): reg)
    spec, platform = plugins.choose_platform("opt_plat", plugin_options={"optplat": {"cores": 2}})
    assert spec.name == "opt_plat" and platform.options == {"cores": 2}
    assert plugins.select_platform("opt_plat").options == {"cores": 4}  # the declared default
    assert plugins.default_attention_backend(platform) == "torch_native"
    assert "torch_native" in platform.told and "triton" not in platform.told
    # A hook-API-1 platform (no ``available`` argument) still answers.
    assert plugins.default_attention_backend(_FakeAccel()) == "torch_native"


def test_in_process_plugins_join_every_registry_only_inside_the_block() -> None:
    module = types.ModuleType("engine_test_in_process")

    @hookimpl
    def register_schedule_policies(register):  # type: ignore[no-untyped-def]
        register(SchedulePolicySpec(name="in-process-policy", factory=lambda: None))

    module.register_schedule_policies = register_schedule_policies  # type: ignore[attr-defined]
    before = plugins.get_registry()
    assert "in-process-policy" not in plugins.schedule_policies()
    with plugins.in_process_plugins(("in_process_test", module)):
        assert "in-process-policy" in plugins.schedule_policies()
        assert "in-process-policy" in plugins.schedule_policies(disabled=["lof"])  # any disabled set
        assert plugins.get_registry().plugins["in_process_test"].distribution == "(in-process)"
    assert "in-process-policy" not in plugins.schedule_policies()
    assert plugins.get_registry() is before  # the cached registry without it is kept
