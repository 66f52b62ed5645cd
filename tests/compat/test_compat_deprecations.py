"""The old forms the corpus uses still work, and each warns with its replacement's name.

The corpus's own tests filter these warnings (they are expected there); here they are caught and
read: a warning that stopped naming its replacement, or an old form that stopped warning (or
working), fails.
"""

from __future__ import annotations

import importlib
import pathlib
import warnings

import pytest
import torch

from engine.deprecation import DEPRECATIONS


def _deprecations(fn) -> list[warnings.WarningMessage]:  # type: ignore[no-untyped-def]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if issubclass(w.category, DeprecationWarning)]


def test_the_model_plugins_old_silu_and_mul_call_warns_at_its_own_line() -> None:
    """The Granite plugin builds ``SiluAndMul(config.hidden_act)``: one warning, pointing at the
    plugin's line, naming ``get_act_and_mul`` and the release that removes the old form."""
    from transformers import GraniteConfig

    granite = importlib.import_module("engine_models_granite.granite")  # on sys.path: conftest.py

    config = GraniteConfig(hidden_size=32, intermediate_size=64, hidden_act="silu")
    caught = _deprecations(lambda: granite.GraniteMLP(config, None, "model.layers.0.mlp"))
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "get_act_and_mul" in message, message
    assert f"removed in {DEPRECATIONS['SiluAndMul(act)'].removed_in}" in message, message
    assert pathlib.Path(caught[0].filename).name == "granite.py", caught[0].filename


@pytest.mark.parametrize("act", ["silu", "swish", "gelu", "gelu_pytorch_tanh"])
def test_old_silu_and_mul_builds_what_get_act_and_mul_builds(act: str) -> None:
    from engine.layers import SiluAndMul, get_act_and_mul

    built: list[torch.nn.Module] = []
    caught = _deprecations(lambda: built.append(SiluAndMul(act)))
    assert len(caught) == 1 and "get_act_and_mul" in str(caught[0].message)
    expected = get_act_and_mul(act)
    assert type(built[0]) is type(expected)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(built[0](x), expected(x), rtol=0, atol=0)


def test_new_silu_and_mul_does_not_warn() -> None:
    from engine.layers import SiluAndMul

    assert _deprecations(SiluAndMul) == []


def test_old_silu_and_mul_with_an_unknown_name_is_a_clear_error() -> None:
    from engine.layers import SiluAndMul

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match=r"unsupported hidden_act 'relu'; supported: silu, swish, gelu"):
            SiluAndMul("relu")


@pytest.mark.parametrize("name", ["random", "torch"])
def test_the_old_kit_modules_seeding_names_warn_and_name_the_seed_attribute(name: str) -> None:
    """The attention plugin's conftest replaces ``engine.testing.conformance.random``: the name
    resolves (to the module it stood for) and the warning names the kit's ``seed`` attribute."""
    conformance = importlib.import_module("engine.testing.conformance")
    vars(conformance).pop(name, None)  # a conftest's monkeypatch may have left the name set
    got: list[object] = []
    caught = _deprecations(lambda: got.append(getattr(conformance, name)))
    assert got == [importlib.import_module(name)]
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "`seed` attribute" in message and "AttentionBackendConformance" in message, message
    assert f"removed in {DEPRECATIONS[f'engine.testing.conformance.{name}'].removed_in}" in message
