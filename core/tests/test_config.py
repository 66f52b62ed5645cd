"""ServerArgs: YAML, flags over file, validation messages, plugin options, required plugins."""

from __future__ import annotations

import pathlib
import types

import pytest

from engine import plugins
from engine.config import ServerArgs, check_required_plugins, load_yaml
from engine.errors import ConfigError, EngineError
from engine.hookspecs import PluginOption, hookimpl


def test_defaults_validate() -> None:
    args = ServerArgs()
    args.validate()
    assert args.schedule_policy == "fcfs" and args.page_size == 1


def test_unknown_key_suggests_closest() -> None:
    with pytest.raises(ConfigError, match="unknown key 'max_total_token' .*did you mean max_total_tokens"):
        ServerArgs.from_dict({"max_total_token": 5})


@pytest.mark.parametrize("key,value,needle", [
    ("dtype", "fp32", "--dtype: invalid value 'fp32'; accepted: auto, float32, bfloat16, float16"),
    ("page_size", 0, "--page-size: invalid value 0; accepted: an integer >= 1"),
    ("mem_fraction_static", 1.5, "--mem-fraction-static: invalid value 1.5"),
    ("max_total_tokens", "lots", "max_total_tokens: invalid value 'lots'; expected an integer"),
    ("disable_radix_cache", "yes", "disable_radix_cache: invalid value 'yes'; expected true/false"),
    ("tp_size", 0, "--tp-size: invalid value 0"),
    ("pp_size", 0, "--pp-size: invalid value 0"),
    ("node_rank", 2, "--node-rank: invalid value 2; accepted: 0..0"),
    ("dist_init_addr", "nohost", "--dist-init-addr: invalid value 'nohost'; accepted: HOST:PORT"),
])
def test_invalid_values_name_field_value_and_accepted(key: str, value: object, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        ServerArgs.from_dict({key: value})
    assert needle in str(err.value)


def test_yaml_and_overrides(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "deploy.yaml"
    f.write_text("attention: torch_native\nmax-total-tokens: 4096\nschedule_policy: fcfs\n")
    args = ServerArgs.from_yaml(str(f), overrides={"max_total_tokens": 1024})
    assert args.attention == "torch_native" and args.max_total_tokens == 1024


def test_bad_yaml_is_one_line_error(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("attention: [torch_native\n")
    with pytest.raises(ConfigError, match=r"invalid YAML in .*bad.yaml at line \d+"):
        load_yaml(str(f))
    g = tmp_path / "list.yaml"
    g.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_yaml(str(g))
    with pytest.raises(ConfigError, match="file not found"):
        load_yaml(str(tmp_path / "missing.yaml"))


def test_required_plugins() -> None:
    check_required_plugins(["plugserve-attention-torch-native>=0.1", "plugserve-core"])
    with pytest.raises(ConfigError, match="'plugserve-attention-nope' is not installed"):
        check_required_plugins(["plugserve-attention-nope"])
    with pytest.raises(ConfigError, match="0.1.0 is installed but 'plugserve-core>=99' is required"):
        check_required_plugins(["plugserve-core>=99"])
    with pytest.raises(ConfigError, match="invalid requirement"):
        check_required_plugins(["not a requirement !!"])


def _options_registry(monkeypatch: pytest.MonkeyPatch) -> plugins.PluginRegistry:
    @hookimpl
    def register_plugin_options(register):  # type: ignore[no-untyped-def]
        register(PluginOption(plugin="opts", key="block", default=64, help="tile size"))
        register(PluginOption(plugin="opts", key="prefetch", default="auto", help="MiB or auto",
                              accepts=(int,)))

    mod = types.ModuleType("opts")
    mod.register_plugin_options = register_plugin_options  # type: ignore[attr-defined]
    reg = plugins.PluginRegistry(extra_plugins=[("opts", mod)])
    monkeypatch.setattr(plugins, "get_registry", lambda disabled=(): reg)
    return reg


def test_plugin_options_are_checked_against_declarations(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = _options_registry(monkeypatch)
    plugins.check_plugin_options({"opts": {"block": 32}})
    assert reg.options_for("opts", {"opts": {"block": 32}}) == {"block": 32, "prefetch": "auto"}
    assert reg.options_for("opts", {}) == {"block": 64, "prefetch": "auto"}  # declared defaults reach the factory
    with pytest.raises(ConfigError, match=r"unknown option 'opts.blok'; declared: opts\.block, opts\.prefetch \(did you mean opts.block\?\)"):
        plugins.check_plugin_options({"opts": {"blok": 32}})
    with pytest.raises(ConfigError, match=r"opts.block: invalid value 'big'; expected int like the default 64"):
        plugins.check_plugin_options({"opts": {"block": "big"}})
    with pytest.raises(ConfigError, match=r"unknown plugin 'optz'; installed: .*opts.*\(did you mean opts\?\)"):
        plugins.check_plugin_options({"optz": {"block": 1}})


def test_plugin_option_accepts_the_types_it_declares_besides_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    _options_registry(monkeypatch)
    plugins.check_plugin_options({"opts": {"prefetch": 6}})
    plugins.check_plugin_options({"opts": {"prefetch": "off"}})
    with pytest.raises(ConfigError, match=r"opts.prefetch: invalid value True; expected str or int like the default 'auto'"):
        plugins.check_plugin_options({"opts": {"prefetch": True}})
    with pytest.raises(ConfigError, match=r"opts.prefetch: invalid value 1.5; expected str or int"):
        plugins.check_plugin_options({"opts": {"prefetch": 1.5}})


def test_options_of_a_disabled_plugin_are_an_error() -> None:
    with pytest.raises(ConfigError, match=r"plugin 'triton' is disabled \(--disable-plugin triton\)"):
        plugins.check_plugin_options({"triton": {"max_kv_splits": 8}}, ["triton"])


def test_option_declared_under_another_plugins_name_marks_it_broken() -> None:
    @hookimpl
    def register_plugin_options(register):  # type: ignore[no-untyped-def]
        register(PluginOption(plugin="torch_native", key="block", default=64))

    mod = types.ModuleType("squatter")
    mod.register_plugin_options = register_plugin_options  # type: ignore[attr-defined]
    reg = plugins.PluginRegistry(load_entry_points=False, extra_plugins=[("squatter", mod)])
    info = reg.plugins["squatter"]
    assert info.status == "broken" and "must be declared under this plugin's own name 'squatter'" in info.error


def test_unknown_disable_plugin_name_is_an_error() -> None:
    ServerArgs.from_dict({"disable_plugin": ["triton"]})
    with pytest.raises(EngineError, match=r"--disable-plugin: unknown plugin 'flashinfr'; installed: .*torch_native.*"
                                          r"\(did you mean flashinfer\?\)"):
        ServerArgs.from_dict({"disable_plugin": ["flashinfr"]})
