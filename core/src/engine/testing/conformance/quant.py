"""``QuantMethodConformance``: linear layers through a quantization method against float64.

Three things a method must get right, each with its own test: the plain round trip (a weight
loaded, processed and applied), the fused layers' shard loading (q/k/v into ``qkv_proj``,
gate/up into ``gate_up_proj``: each shard must land in its own rows with its own scales), and,
for methods with a checkpoint format, serialized weights saved to a safetensors file and loaded
back the way the model loader does.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import pytest
import torch

from engine import plugins
from engine.testing.conformance._common import KIT_SEED, derive_seed, device_or_skip, generator, randn

# The fused layers a model builds, as (layer, checkpoint projections with their shard ids).
# Input width 128; shards of different sizes and magnitudes (100x apart), so a shard loaded into
# another's rows, or quantized with another's scale, shows as a large error on its own slice.
_HIDDEN = 128
_LAYOUTS: dict[str, list[tuple[str, Any, int, float]]] = {
    # 4 query heads over 2 KV heads of 16: q 64 rows, k 32, v 32.
    "qkv_proj": [("q_proj", "q", 64, 0.1), ("k_proj", "k", 32, 1.0), ("v_proj", "v", 32, 10.0)],
    "gate_up_proj": [("gate_proj", 0, 96, 0.5), ("up_proj", 1, 96, 5.0)],
    "down_proj": [("down_proj", None, 96, 1.0)],
}
_PREFIX = {"qkv_proj": "model.layers.0.self_attn", "gate_up_proj": "model.layers.0.mlp",
           "down_proj": "model.layers.0.mlp"}


def _build_layer(kind: str, qcfg: Any) -> Any:
    from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    prefix = f"{_PREFIX[kind]}.{kind}"
    if kind == "qkv_proj":
        return QKVParallelLinear(_HIDDEN, 16, 4, 2, bias=False, quant_config=qcfg, prefix=prefix)
    if kind == "gate_up_proj":
        return MergedColumnParallelLinear(_HIDDEN, [96, 96], bias=False, quant_config=qcfg, prefix=prefix)
    return RowParallelLinear(_HIDDEN, 96, bias=False, quant_config=qcfg, prefix=prefix)


class QuantMethodConformance:
    """Set ``method_name`` and ``max_rel_error``; for a checkpoint format, also
    ``serialized_config`` and ``serialize_weight``.

    ``max_rel_error`` bounds ``||y - y_ref|| / ||y_ref||`` per layer and, for fused layers, per
    shard, where ``y_ref`` is ``x @ W.T`` in float64 with the original float weight.
    """

    method_name: ClassVar[str] = ""
    device: ClassVar[str] = "cpu"
    dtype: ClassVar[torch.dtype] = torch.float32
    max_rel_error: ClassVar[float] = 0.05
    #: the method quantizes a 16/32-bit checkpoint when chosen with ``--quant`` (factory gets ``{}``).
    on_the_fly: ClassVar[bool] = True
    #: ``quantization_config`` of a checkpoint in the method's own format; None: no such format.
    serialized_config: ClassVar[dict[str, Any] | None] = None
    #: base of every test's seed.
    seed: ClassVar[int] = KIT_SEED

    def serialize_weight(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint in the method's format stores for one projection of float
        ``weight [out, in]``, keyed by parameter name (``{"weight": q, "weight_scale": s}``).
        Override when ``serialized_config`` is set."""
        raise NotImplementedError(
            f"{type(self).__name__} sets serialized_config but does not override serialize_weight(weight): "
            "return the tensors your checkpoint format stores for one projection")

    # -- helpers -------------------------------------------------------------------
    def _config(self, source: str) -> Any:
        spec = plugins.get_quantization_method(self.method_name)
        device_type = torch.device(self.device).type
        if device_type not in spec.device_types:
            default = " (the default when a spec names none)" if spec.device_types == ("cuda",) else ""
            pytest.fail(f"the kit runs quantization method '{spec.name}' on {device_type}, but its QuantMethodSpec "
                        f"declares device_types={spec.device_types!r}{default}: the engine would refuse it there. "
                        "Declare the devices it runs on, or set the kit's `device`.", pytrace=False)
        if source == "on_the_fly":
            if not self.on_the_fly:
                pytest.skip(f"{type(self).__name__}.on_the_fly is False: the method only loads its own checkpoints")
            return plugins.create(spec.factory, {}, options=plugins.declared_options("quantization", spec.name))
        if self.serialized_config is None:
            pytest.skip(f"{type(self).__name__}.serialized_config is None: the method has no checkpoint format")
        method = self.serialized_config.get("quant_method")
        assert method in spec.checkpoint_methods, (
            f"serialized_config's quant_method {method!r} is not in QuantMethodSpec.checkpoint_methods "
            f"{spec.checkpoint_methods!r}: the engine would not pick '{spec.name}' for such a checkpoint")
        return plugins.create(spec.factory, dict(self.serialized_config),
                              options=plugins.declared_options("quantization", spec.name))

    def _make(self, kind: str, qcfg: Any, device: torch.device) -> Any:
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(device):
                return _build_layer(kind, qcfg)
        finally:
            torch.set_default_dtype(prev)

    def _weights(self, kind: str, seed: int) -> list[torch.Tensor]:
        gen = generator(seed)
        return [randn(gen, rows, _HIDDEN, device=torch.device("cpu"), dtype=self.dtype, scale=mag)
                for _, _, rows, mag in _LAYOUTS[kind]]

    def _check(self, layer: Any, kind: str, weights: list[torch.Tensor], device: torch.device, seed: int,
               where: str) -> None:
        layer.quant_method.process_weights_after_loading(layer)
        x = randn(generator(seed + 1), 8, _HIDDEN, device=device, dtype=self.dtype)
        got = layer(x).double().cpu()
        refs = [x.double().cpu() @ w.double().t() for w in weights]
        assert got.shape[-1] == sum(r.shape[-1] for r in refs), f"output width {got.shape[-1]} ({where})"
        for (proj, _, rows, _), g, r in zip(_LAYOUTS[kind], got.split([r.shape[-1] for r in refs], -1), refs):
            rel = ((g - r).norm() / r.norm()).item()
            assert rel <= self.max_rel_error, (
                f"{kind}: shard {proj} relative error {rel:.4f} > {self.max_rel_error} ({where}, seed {seed})")

    # -- tests ---------------------------------------------------------------------
    def test_linear_round_trip(self) -> None:
        device = device_or_skip(self.device)
        seed = derive_seed(self.seed, self.method_name, "round_trip", self.dtype)
        qcfg = self._config("on_the_fly")
        layer = self._make("down_proj", qcfg, device)
        assert layer.weight.dtype == self.dtype, "on-the-fly methods load the weight in the model dtype"
        (weight,) = self._weights("down_proj", seed)
        layer.weight.weight_loader(layer.weight, weight.to(device))
        self._check(layer, "down_proj", [weight], device, seed, "on the fly")

    @pytest.mark.parametrize("kind", ["qkv_proj", "gate_up_proj"])
    def test_fused_shards_load_into_place(self, kind: str) -> None:
        """Each checkpoint projection, loaded with its shard id, computes its own output slice."""
        device = device_or_skip(self.device)
        seed = derive_seed(self.seed, self.method_name, "fused", kind, self.dtype)
        layer = self._make(kind, self._config("on_the_fly"), device)
        weights = self._weights(kind, seed)
        for (_, shard_id, _, _), w in zip(_LAYOUTS[kind], weights):
            layer.weight.weight_loader(layer.weight, w.to(device), shard_id)
        self._check(layer, kind, weights, device, seed, "on the fly")

    @pytest.mark.parametrize("kind", ["qkv_proj", "gate_up_proj", "down_proj"])
    def test_serialized_checkpoint_loads(self, kind: str, tmp_path: Any) -> None:
        """Weights in the method's format, saved to safetensors and loaded back per shard the way
        the model loader does (``param.weight_loader(param, tensor, shard_id)``), give the
        original weights' outputs."""
        from safetensors.torch import load_file, save_file

        device = device_or_skip(self.device)
        seed = derive_seed(self.seed, self.method_name, "serialized", kind, self.dtype)
        layer = self._make(kind, self._config("serialized"), device)
        weights = self._weights(kind, seed)
        tensors = {f"{_PREFIX[kind]}.{proj}.{param}": t.contiguous()
                   for (proj, _, _, _), w in zip(_LAYOUTS[kind], weights)
                   for param, t in self.serialize_weight(w).items()}
        path = os.path.join(str(tmp_path), "model.safetensors")
        save_file(tensors, path)
        params = dict(layer.named_parameters())
        for name, tensor in load_file(path).items():
            proj, param_name = name.rsplit(".", 2)[1:]
            shard_id = next(s for p, s, _, _ in _LAYOUTS[kind] if p == proj)
            param = params.get(param_name)
            assert param is not None, (
                f"checkpoint tensor '{name}' has no parameter '{param_name}' on {kind}; "
                f"the method created: {', '.join(params)}")
            if shard_id is None:
                param.weight_loader(param, tensor.to(device))
            else:
                param.weight_loader(param, tensor.to(device), shard_id)
        self._check(layer, kind, weights, device, seed, "serialized checkpoint")
