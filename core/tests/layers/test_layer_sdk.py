"""The layer SDK's one import surface (``engine.layers``) and its gated activations."""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import engine.layers

DOCS = pathlib.Path(__file__).resolve().parents[3] / "docs" / "plugins-reference.md"


@pytest.mark.parametrize("name", engine.layers.__all__)
def test_every_exported_name_resolves_to_its_module_object(name: str) -> None:
    value = getattr(engine.layers, name)
    module = importlib.import_module(f"engine.{engine.layers._EXPORTS[name]}")
    assert value is getattr(module, name)  # a re-export, not a second definition


def test_unknown_name_lists_the_exports() -> None:
    with pytest.raises(AttributeError, match="the layer SDK exports: .*RMSNorm"):
        engine.layers.NoSuchLayer  # noqa: B018


def test_import_is_light() -> None:
    # A plugin's registration module may import the SDK: it must not pull in the linear
    # layers (torch.distributed) or the sampler until a name is used.
    code = ("import sys, engine.layers; "
            "print(sorted(m for m in sys.modules if m.startswith('engine.layers.') or m == 'torch.distributed'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_docs_list_exactly_the_exports() -> None:
    text = DOCS.read_text(encoding="utf-8")
    section = text.split("## The layer SDK", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`([A-Za-z_]+)`", section))
    assert set(engine.layers.__all__) <= documented, sorted(set(engine.layers.__all__) - documented)


@pytest.mark.parametrize("hidden_act", ["silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new"])
def test_gated_activation_matches_transformers(hidden_act: str) -> None:
    from transformers.activations import ACT2FN

    x = torch.randn(5, 2 * 24, generator=torch.Generator().manual_seed(0))
    ref = ACT2FN[hidden_act](x[:, :24]) * x[:, 24:]
    torch.testing.assert_close(engine.layers.get_act_and_mul(hidden_act)(x), ref)


def test_names_say_what_runs() -> None:
    assert isinstance(engine.layers.get_act_and_mul("silu"), engine.layers.SiluAndMul)
    assert isinstance(engine.layers.get_act_and_mul("gelu"), engine.layers.GeluAndMul)
    with pytest.raises(ValueError, match="unsupported hidden_act 'relu2'; supported: silu, swish, gelu"):
        engine.layers.get_act_and_mul("relu2")


def test_only_silu_takes_the_fused_kernel() -> None:
    def fused(x: torch.Tensor) -> torch.Tensor:
        return x

    silu = engine.layers.SiluAndMul()
    silu.use_kernels({"silu_and_mul": fused})
    assert silu.fused is fused
    # The fused kernel runs only on CUDA tensors: the CPU path stays the PyTorch code.
    x = torch.randn(2, 8)
    torch.testing.assert_close(silu(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    assert not hasattr(engine.layers.GeluAndMul(), "use_kernels")  # no fused GELU kernel to take
