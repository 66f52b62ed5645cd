"""``GGUFConfig``: linear weights of a GGUF checkpoint kept in their GGML blocks (``--quant gguf``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError, ModelLoadError
from engine.layers.quantization import LinearMethodBase, QuantizationConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn


@dataclass
class GGUFConfig(QuantizationConfig):
    """Keeps Q4_0, Q4_1, Q8_0, Q4_K and Q6_K linear weights in their blocks.

    The engine's model loader sees ``loads_gguf_blocks`` and feeds each claimed linear layer
    the raw blocks of its GGUF tensors (``uint8 [rows, row_bytes]``) together with their GGML
    type (``<proj>.weight_type``); other tensors (embeddings, norms) arrive dequantized as usual.
    """

    #: with ``--load-format dummy``: the GGML type of the random blocks (None: not set).
    dummy_type: int | None = None
    #: what the layers kept, for the load-time memory report.
    kept_bytes: Counter = field(default_factory=Counter)
    dequantized_bytes: int = 0
    float_bytes: int = 0
    fallback: Counter = field(default_factory=Counter)
    #: bytes of the LM head's Q8_0 copy (``get_lm_head_projection``); 0: none.
    lm_head_bytes: int = 0

    name = "gguf"
    #: the model loader reads the GGUF file's blocks for the layers this method serves.
    loads_gguf_blocks = True

    @classmethod
    def from_config(cls, config: dict[str, Any], options: dict[str, Any] | None = None) -> GGUFConfig:
        """``{}`` (``--quant gguf``) or ``{"quant_method": "gguf"}``; ``options``: the plugin's."""
        from engine_quant_gguf.formats import type_from_name

        method = (config or {}).get("quant_method", "gguf")
        if method != "gguf":
            raise ModelLoadError(f"plugserve-quant-gguf: quantization_config.quant_method is '{method}'; accepted: gguf")
        name = str((options or {}).get("dummy_type") or "")
        try:
            dummy = type_from_name(name) if name else None
        except ValueError as exc:
            raise ConfigError(f"--plugin-option gguf.dummy_type: invalid value {exc}") from None
        return cls(dummy_type=dummy)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        from engine_quant_gguf.method import GGUFLinearMethod

        return GGUFLinearMethod(self)

    def get_lm_head_projection(self, lm_head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """On the CPU, an LM head whose float32 weights are exactly Q8_0 values (a GGUF's Q8_0
        token embedding, tied) multiplies from Q8_0 blocks at decode: a quarter of the bytes."""
        import torch
        import torch.nn.functional as F

        from engine_quant_gguf import cpu_kernels, formats

        weight = lm_head.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not cpu_kernels.available():
            return None
        blocks = formats.exact_q8_0(weight.data)
        if blocks is None:
            return None
        self.lm_head_bytes = blocks.numel()

        def project(h: torch.Tensor) -> torch.Tensor:
            if h.dtype != torch.float32 or h.dim() != 2 or h.shape[0] > cpu_kernels.MAX_FUSED_ROWS:
                return F.linear(h, weight)
            out = torch.empty(h.shape[0], blocks.shape[0], dtype=torch.float32)
            cpu_kernels.matmul(h, blocks, formats.Q8_0, out, 0)
            return out
        return project

    def load_report(self) -> str:
        """One line for the load log: bytes kept in blocks vs the same weights dequantized."""
        from engine_quant_gguf.formats import type_name

        kept = sum(self.kept_bytes.values())
        types = ", ".join(f"{type_name(t)} {_size(b)}" for t, b in sorted(self.kept_bytes.items()))
        line = (f"gguf: linear weights kept quantized: {_size(kept)} ({types or 'none'}); "
                f"dequantized they would take {_size(self.dequantized_bytes)}")
        if self.float_bytes:
            line += f"; {_size(self.float_bytes)} of them held dequantized"
        if self.fallback:
            line += " (" + ", ".join(f"{n} {what}" for what, n in sorted(self.fallback.items())) + ")"
        if self.lm_head_bytes:
            return line + f"; lm_head also in Q8_0 blocks ({_size(self.lm_head_bytes)}) at decode; embeddings dequantized"
        return line + "; embeddings and lm_head are dequantized"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
