"""The skinny GEMM as the layer SDK's ``linear`` kernel (``Platform.layer_kernels()['linear']``):
what the linear layers, the RMSNorms that hand their inputs on (norm fusion), the LM head and the
logits processor call. The kernels and their launch rules are ``gemv.py``'s (called through the
module, so a test may count the calls)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_platform_cuda import gemv
from engine_platform_cuda.gemv import RULE, GemvRule, exact_norm_applies

if TYPE_CHECKING:
    from engine.layers.layernorm import PendingNorm


@dataclass(frozen=True)
class SkinnyLinear:
    """``Platform.layer_kernels()['linear']``: the unquantized linear layers call it for inputs of
    1..``max_rows`` rows (``engine.layers.linear.skinny_linear_applies``), F.linear otherwise; with
    ``norm_fusion`` it also takes the inputs an ``RMSNorm`` hands on unnormalized
    (``engine.layers.layernorm.PendingNorm``, ``norm_linear``) where ``takes_norm`` says so, and
    with ``final_norm_fusion`` the model's final norm, handed to the LM head (``takes_final_norm``,
    ``final_norm_linear``: bit-equal to the separate norm). With ``float32_out`` the logits
    processor has it store the logits as float32 (``out_dtype``), sparing their ``.float()`` copy."""

    #: the most rows of x (tokens of the batch) it is used for; the ``cuda.gemv_max_rows`` option.
    max_rows: int = 8
    #: launch with programmatic dependent launch (``skinny_linear(pdl=True)``); the ``cuda.pdl``
    #: option, on sm_90+ only.
    pdl: bool = False
    #: fold the RMSNorm before a projection into it (``norm_skinny_linear``); the
    #: ``cuda.norm_fusion`` option.
    norm_fusion: bool = False
    #: the launch-shape rule (its ``fma_pdl_steps``: the ``cuda.pdl_preload`` option).
    rule: GemvRule = RULE
    #: fold the model's final RMSNorm into the LM head (``final_norm_linear``); the
    #: ``cuda.final_norm_fusion`` option, which needs ``norm_fusion`` too.
    final_norm_fusion: bool = False
    #: the logits processor asks for float32 logits (``out_dtype``); the ``cuda.logits_f32`` option.
    float32_out: bool = False

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return gemv.skinny_linear(x, weight, bias, pdl=self.pdl, rule=self.rule, out_dtype=out_dtype)

    @property
    def norm_max_rows(self) -> int:
        """Rows ``norm_linear`` takes at most: the fma kind's (this kernel's rule), within ``max_rows``."""
        return min(self.max_rows, self.rule.fma_max_rows)

    def takes_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether ``norm_linear`` takes the norm of the 2-D ``x`` for ``weight``/``bias``: norm
        fusion on, ``x`` on the GPU, 1..``norm_max_rows`` rows, and as ``skinny_linear_applies``."""
        from engine.layers.linear import skinny_linear_applies

        return self.norm_fusion and x.is_cuda and skinny_linear_applies(x, weight, bias, self.norm_max_rows)

    def norm_linear(self, pending: PendingNorm, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``pending``'s norm times ``weight`` (+ bias), filling its ``normed`` and ``res_sum``;
        ``[rows, N]``."""
        k = pending.x.shape[-1]
        res_sum = pending.res_sum.view(-1, k) if pending.residual is not None else None
        y, _, _ = gemv.norm_skinny_linear(pending.x, pending.residual, pending.weight, pending.eps, weight, bias,
                                     pdl=self.pdl, rule=self.rule, normed=pending.normed.view(-1, k),
                                     res_sum=res_sum)
        return y

    def takes_final_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``final_norm_linear`` takes the model's final norm of the 2-D ``x`` for the LM
        head's ``weight``: ``final_norm_fusion`` on, ``takes_norm`` (no bias) for exactly one row
        (the row whose logits every forward mode wants), ``x`` laid out as ``exact_norm_applies``
        wants (a hidden size the order of ``rms_norm``'s sum is known for)."""
        return (self.final_norm_fusion and x.dim() == 2 and x.shape[0] == 1 and self.takes_norm(x, weight, None)
                and exact_norm_applies(x, None, None))

    def final_norm_linear(self, pending: PendingNorm, weight: torch.Tensor,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``pending``'s norm times ``weight`` (the LM head), filling ``normed`` and ``res_sum``:
        bit for bit the norm kernel (``kernels.rms_norm``) and then this kernel, in one launch
        (``norm_skinny_linear(exact_norm=True)``); ``out_dtype`` as for ``skinny_linear``.
        Where the residual or the norm weight is laid out otherwise than ``exact_norm_applies``
        wants (not so in the model plugins: both are whole tensors), the two kernels run."""
        k = pending.x.shape[-1]
        normed = pending.normed.view(-1, k)
        res_sum = pending.res_sum.view(-1, k) if pending.residual is not None else None
        if exact_norm_applies(pending.x, pending.residual, pending.weight):
            y, _, _ = gemv.norm_skinny_linear(pending.x, pending.residual, pending.weight, pending.eps, weight,
                                         pdl=self.pdl, rule=self.rule, normed=normed, res_sum=res_sum,
                                         exact_norm=True, out_dtype=out_dtype)
            return y
        from engine_platform_cuda.kernels import rms_norm

        out = rms_norm(pending.x, pending.weight, pending.eps, pending.residual, trigger=self.pdl)
        normed_out, res_out = (out, None) if isinstance(out, torch.Tensor) else out
        normed.copy_(normed_out)
        if res_sum is not None and res_out is not None:
            res_sum.copy_(res_out)
        return self(normed, weight, out_dtype=out_dtype)
