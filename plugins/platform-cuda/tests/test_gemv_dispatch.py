"""When the unquantized linear layers take the platform's skinny GEMM, and how it is turned off.

No GPU needed: the layer-level cases hand the layer a recording stand-in for the kernel and an
input that reports ``is_cuda`` (a tensor subclass), so the dispatch in ``UnquantizedLinearMethod``
runs on the CPU; the option cases construct the platform, which probes nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_platform_cuda import DEFAULT_OPTIONS
from engine_platform_cuda.platform import CudaPlatform

from engine import plugins
from engine.errors import ConfigError
from engine.layers.linear import (
    DEFAULT_SKINNY_MAX_ROWS,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    skinny_linear_applies,
)


class _OnGpu(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` like one on the GPU (the layers check it)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class _Recorder:
    """Stands for ``layer_kernels()['linear']``: records the shapes it is called with."""

    def __init__(self, max_rows: int = 8) -> None:
        self.max_rows = max_rows
        self.calls: list[tuple[tuple[int, ...], bool]] = []

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.calls.append((tuple(x.shape), bias is not None))
        return F.linear(x.as_subclass(torch.Tensor), weight, bias)


def _layer(k: int = 32, n: int = 24, bias: bool = True, dtype: torch.dtype = torch.bfloat16) -> ReplicatedLinear:
    layer = ReplicatedLinear(k, n, bias=bias, params_dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    layer.weight.data.copy_(torch.randn(n, k, generator=gen))
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=gen))
    return layer


def _x(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype).as_subclass(_OnGpu)


# -- the rule ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rule_takes_one_to_max_rows_of_a_16_bit_dtype(dtype: torch.dtype) -> None:
    w = torch.zeros(24, 32, dtype=dtype)
    for rows in range(1, 9):
        assert skinny_linear_applies(torch.zeros(rows, 32, dtype=dtype), w, None, 8)
    assert not skinny_linear_applies(torch.zeros(9, 32, dtype=dtype), w, None, 8)
    assert not skinny_linear_applies(torch.zeros(0, 32, dtype=dtype), w, None, 8)
    assert skinny_linear_applies(torch.zeros(4, 32, dtype=dtype), w, None, 4)
    assert not skinny_linear_applies(torch.zeros(5, 32, dtype=dtype), w, None, 4)


def test_rule_refuses_other_dtypes_layouts_and_shapes() -> None:
    bf16 = torch.bfloat16
    w = torch.zeros(24, 32, dtype=bf16)
    x = torch.zeros(2, 32, dtype=bf16)
    assert skinny_linear_applies(x, w, torch.zeros(24, dtype=bf16), 8)
    assert not skinny_linear_applies(x.float(), w.float(), None, 8)  # float32: cuBLAS
    assert not skinny_linear_applies(x, w.half(), None, 8)  # mixed dtypes
    assert not skinny_linear_applies(x, w, torch.zeros(24), 8)  # float32 bias
    assert not skinny_linear_applies(torch.zeros(32, 2, dtype=bf16).t(), w, None, 8)  # K not unit-stride
    assert not skinny_linear_applies(x, torch.zeros(32, 24, dtype=bf16).t(), None, 8)  # W^T view
    assert not skinny_linear_applies(torch.zeros(2, 16, dtype=bf16), w, None, 8)  # K mismatch
    assert not skinny_linear_applies(torch.zeros(2, 2, 32, dtype=bf16), w, None, 8)  # not flattened
    # Strided rows (a view into a wider buffer) are fine: the kernel takes a row stride.
    assert skinny_linear_applies(torch.zeros(2, 64, dtype=bf16)[:, :32], w, None, 8)


# -- the layers ---------------------------------------------------------------------------------

def test_layer_calls_the_kernel_for_few_rows_and_f_linear_above() -> None:
    layer = _layer()
    kernel = _Recorder(max_rows=8)
    layer.use_kernels({"linear": kernel})
    for rows in (1, 5, 8):
        x = _x(rows, 32)
        torch.testing.assert_close(layer(x).as_subclass(torch.Tensor),
                                   F.linear(x.as_subclass(torch.Tensor), layer.weight, layer.bias))
    assert kernel.calls == [((1, 32), True), ((5, 32), True), ((8, 32), True)]
    layer(_x(9, 32))
    assert len(kernel.calls) == 3


def test_layer_flattens_leading_dims_and_restores_them() -> None:
    layer = _layer(bias=False)
    kernel = _Recorder()
    layer.use_kernels({"linear": kernel})
    x = _x(2, 3, 32)
    out = layer(x)
    assert kernel.calls == [((6, 32), False)]
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out.as_subclass(torch.Tensor), F.linear(x.as_subclass(torch.Tensor), layer.weight))
    assert layer(_x(3, 3, 32)).shape == (3, 3, 24)  # 9 rows: F.linear, same shape contract
    assert len(kernel.calls) == 1


def test_layer_threshold_comes_from_the_kernel() -> None:
    layer = _layer()
    kernel = _Recorder(max_rows=2)
    layer.use_kernels({"linear": kernel})
    layer(_x(2, 32))
    layer(_x(3, 32))
    assert [c[0][0] for c in kernel.calls] == [2]

    class Plain:  # a kernel without ``max_rows``: the SDK's default threshold
        calls = 0

        def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
            Plain.calls += 1
            return F.linear(x.as_subclass(torch.Tensor), w, b)

    layer.use_kernels({"linear": Plain()})
    layer(_x(DEFAULT_SKINNY_MAX_ROWS, 32))
    layer(_x(DEFAULT_SKINNY_MAX_ROWS + 1, 32))
    assert Plain.calls == 1


def test_layer_keeps_f_linear_for_float32_cpu_tensors_and_no_kernel() -> None:
    kernel = _Recorder()
    fp32 = _layer(dtype=torch.float32)
    fp32.use_kernels({"linear": kernel})
    fp32(_x(1, 32, dtype=torch.float32))
    on_cpu = _layer()
    on_cpu.use_kernels({"linear": kernel})
    on_cpu(torch.randn(1, 32).to(torch.bfloat16))  # a real CPU tensor: is_cuda is False
    none = _layer()
    none.use_kernels({"rms_norm": object()})  # a platform without ``linear``
    assert none.skinny_linear is None
    none(_x(1, 32))
    assert kernel.calls == []


def test_row_parallel_adds_its_bias_after_the_kernel() -> None:
    layer = RowParallelLinear(32, 24, bias=True, params_dtype=torch.bfloat16)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    kernel = _Recorder()
    layer.use_kernels({"linear": kernel})
    x = _x(3, 32)
    out = layer(x).as_subclass(torch.Tensor)
    assert kernel.calls == [((3, 32), False)]  # the bias is added once, after the reduction
    torch.testing.assert_close(out, F.linear(x.as_subclass(torch.Tensor), layer.weight) + layer.bias)


def test_every_linear_layer_kind_takes_kernels() -> None:
    qkv = QKVParallelLinear(32, 8, 4, 2, params_dtype=torch.bfloat16)
    kernel = _Recorder()
    qkv.use_kernels({"linear": kernel})
    assert qkv(_x(1, 32)).shape == (1, (4 + 2 * 2) * 8)
    assert kernel.calls == [((1, 32), False)]


# -- the platform's option ------------------------------------------------------------------------

def _kernels(**options: Any) -> dict[str, Any]:
    return CudaPlatform(options=options).layer_kernels()


def test_platform_offers_the_kernel_by_default_and_not_when_off() -> None:
    kernels = _kernels()
    assert kernels["linear"].max_rows == DEFAULT_OPTIONS["gemv_max_rows"] == 8
    assert "linear" not in _kernels(gemv=False)
    assert "rms_norm" in _kernels(gemv=False)  # the other kernels stay
    assert _kernels(gemv_max_rows=4)["linear"].max_rows == 4


@pytest.mark.parametrize("options, message", [
    ({"gemv": "maybe"}, "cuda.gemv: invalid value 'maybe'"),
    ({"gemv_max_rows": 0}, "cuda.gemv_max_rows: invalid value 0; accepted: an int from 1 to 16"),
    ({"gemv_max_rows": 17}, "cuda.gemv_max_rows: invalid value 17"),
    ({"gemv_rows": 4}, "unknown option 'cuda.gemv_rows'"),
    ({"pdl": 1}, "cuda.pdl: invalid value 1; accepted: on/true or off/false"),
    ({"norm_fusion": "yes"}, "cuda.norm_fusion: invalid value 'yes'; accepted: on/true or off/false"),
    ({"pdl_preload": 0}, "cuda.pdl_preload: invalid value 0; accepted: an int from 1 to 4"),
    ({"pdl_preload": 5}, "cuda.pdl_preload: invalid value 5; accepted: an int from 1 to 4"),
    ({"pdl_preload": True}, "cuda.pdl_preload: invalid value True; accepted: an int from 1 to 4"),
])
def test_platform_refuses_bad_option_values(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        CudaPlatform(options=options)


def test_options_are_declared_and_reach_the_platform_from_the_registry() -> None:
    declared = plugins.plugin_options()
    assert declared["cuda.gemv"].default is True and declared["cuda.gemv_max_rows"].default == 8
    plugins.check_plugin_options({"cuda": {"gemv": False, "gemv_max_rows": 4}})
    with pytest.raises(ConfigError, match="cuda.gemv: invalid value 0"):
        plugins.check_plugin_options({"cuda": {"gemv": 0}})
    reg = plugins.get_registry()
    entry = reg.entries["platform"]["cuda"]
    platform = plugins.create(entry.spec.factory, options=reg.options_for("cuda", {"cuda": {"gemv": False}}))
    assert platform.options == {"gemv": False, "gemv_max_rows": 8, "qkv_prologue": True, "pdl": True,
                                "norm_fusion": True, "pdl_preload": 3, "l2_prefetch_mb": "auto", "argmax": False}
    assert "linear" not in platform.layer_kernels()


def test_pdl_reaches_the_skinny_gemm_and_the_kernels_before_it() -> None:
    from engine_platform_cuda.kernels import layer_kernels, rms_norm, silu_and_mul

    on = layer_kernels(pdl=True)
    assert on["linear"].pdl is True
    # The norm and the activation that precede a projection let it start early.
    assert on["rms_norm"].func is rms_norm and on["rms_norm"].keywords == {"trigger": True}
    assert on["silu_and_mul"].func is silu_and_mul and on["silu_and_mul"].keywords == {"trigger": True}
    off = layer_kernels(pdl=False)
    assert off["linear"].pdl is False and off["rms_norm"] is rms_norm and off["silu_and_mul"] is silu_and_mul
    # Without the skinny GEMM nothing is launched with PDL, so nothing triggers.
    no_gemv = layer_kernels(gemv_max_rows=0, pdl=True)
    assert "linear" not in no_gemv and no_gemv["rms_norm"] is rms_norm
    # The platform asks for PDL only on a CUDA device of sm_90 or newer (its instructions need
    # sm_90), and never when told not to.
    from engine_platform_cuda.gemv import supports_pdl

    expected = CudaPlatform().is_available() and supports_pdl()
    assert CudaPlatform().layer_kernels()["linear"].pdl is expected
    assert CudaPlatform({"pdl": False}).layer_kernels()["linear"].pdl is False


def test_norm_fusion_is_on_by_default_and_off_by_option() -> None:
    from engine_platform_cuda.kernels import layer_kernels

    from engine.cli import build_server_args

    assert DEFAULT_OPTIONS["norm_fusion"] is True
    assert _kernels()["linear"].norm_fusion is True
    assert _kernels(norm_fusion=False)["linear"].norm_fusion is False
    assert "linear" not in _kernels(gemv=False, norm_fusion=True)  # no skinny GEMM: nothing to fuse into
    assert layer_kernels()["linear"].norm_fusion is False  # the function's default: separate launches
    args_off = build_server_args({"plugin_option": ["cuda.norm_fusion=off"]})
    assert args_off.plugin_options == {"cuda": {"norm_fusion": False}}
    plugins.check_plugin_options(args_off.plugin_options)


def test_cli_spelling_off_turns_it_off() -> None:
    from engine.cli import build_server_args

    args = build_server_args({"plugin_option": ["cuda.gemv=off", "cuda.gemv_max_rows=4"]})
    assert args.plugin_options == {"cuda": {"gemv": False, "gemv_max_rows": 4}}
    plugins.check_plugin_options(args.plugin_options)


def test_pdl_preload_reaches_the_skinny_gemm_rule() -> None:
    from engine_platform_cuda.gemv import MAX_PDL_STEPS, RULE, GemvConfig, choose_config
    from engine_platform_cuda.kernels import layer_kernels

    from engine.cli import build_server_args

    assert DEFAULT_OPTIONS["pdl_preload"] == RULE.fma_pdl_steps == 3 and MAX_PDL_STEPS == 4
    assert _kernels()["linear"].rule.fma_pdl_steps == 3
    linear = _kernels(pdl_preload=1)["linear"]
    assert linear.rule.fma_pdl_steps == 1 and linear.rule.fma_tile == RULE.fma_tile  # only that field
    assert layer_kernels()["linear"].rule is RULE  # the function's default: the rule as it is
    # The chosen "fma" configs carry it; "dot" ones ignore it (never launched with PDL).
    assert choose_config(1, 2048, 4096, 132, rule=linear.rule).pdl_steps == 1
    assert choose_config(1, 2048, 4096, 132).pdl_steps == 3
    with pytest.raises(ValueError, match="GemvConfig.pdl_steps: invalid value 5; accepted: 1..4"):
        GemvConfig("fma", 4, 1024, pdl_steps=5).validate()
    args = build_server_args({"plugin_option": ["cuda.pdl_preload=2"]})
    assert args.plugin_options == {"cuda": {"pdl_preload": 2}}
    plugins.check_plugin_options(args.plugin_options)
