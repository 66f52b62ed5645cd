"""Projects hidden states to logits at the positions that need them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather
from engine.layers.hidden_capture import captured_hidden_states
from engine.layers.linear import DEFAULT_SKINNY_MAX_ROWS, linear_with_kernel

if TYPE_CHECKING:
    from engine.layers.vocab_parallel_embedding import ParallelLMHead
    from engine.layers.forward_batch import ForwardBatch


#: On NVIDIA GPUs, project to the logits with one GEMM that outputs float32 where
#: ``LogitsProcessor._float32_gemm_applies`` (False: the 16-bit GEMM, its logits widened after).
FLOAT32_LM_HEAD_GEMM = True

#: Whether this torch's ``mm`` takes ``out_dtype`` (float32 output of 16-bit operands, torch 2.8
#: and later); without it the LM head is the 16-bit GEMM, widened after.
_MM_HAS_OUT_DTYPE = {"dtype", "dtype_out"} <= set(torch.ops.aten.mm.overloads())


@dataclass
class LogitsProcessorOutput:
    # [bs, vocab] float32 logits at each row's last new position.
    next_token_logits: torch.Tensor
    # [num_tokens, vocab] float32 logits at every new position, when prompt logprobs are wanted.
    full_logits: torch.Tensor | None = None
    # [num_tokens, D] hidden states at every new position when ``ForwardBatch.capture_hidden``
    # asks for them (speculative proposers such as EAGLE; ``engine.layers.hidden_capture``).
    hidden_states: torch.Tensor | None = None


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, logit_scale: float = 1.0, final_logit_softcap: float = 0.0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.logit_scale = logit_scale
        self.final_logit_softcap = final_logit_softcap
        #: the platform's skinny GEMM (``layer_kernels()['linear']``) for projections of few rows
        #: (decode at small batch: the LM head is the largest single weight read); None: matmul.
        self.skinny_linear: Any = None
        #: a float32 ``[rows, vocab]`` buffer the decode logits are written into (set by the decode
        #: graph runner while it captures the graphs that share one logits buffer): the widening to
        #: float32 is that copy, instead of a float32 tensor of its own copied into the buffer after.
        self.decode_out: torch.Tensor | None = None

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        """Takes the platform's ``linear`` kernel when it offers one (``ModelRunner`` calls this)."""
        self.skinny_linear = kernels.get("linear")

    def forward(self, hidden_states: torch.Tensor, lm_head: ParallelLMHead,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        if forward_batch.forward_mode.is_decode():
            last = hidden_states
        else:
            assert forward_batch.extend_seq_lens is not None and forward_batch.extend_start_loc is not None
            last_index = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
            last = hidden_states[last_index]
        logits = self._project(last, lm_head, self.decode_out if forward_batch.forward_mode.is_decode() else None)
        full = None
        if forward_batch.return_logprob and forward_batch.forward_mode.is_extend():
            full = self._project(hidden_states, lm_head)
        return LogitsProcessorOutput(next_token_logits=logits, full_logits=full,
                                     hidden_states=captured_hidden_states(forward_batch, hidden_states))

    def _project(self, h: torch.Tensor, lm_head: ParallelLMHead, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` of ``h``; with ``out`` (``[rows, vocab]`` float32) written
        into it and returned."""
        if out is not None and (out.shape != (h.shape[0], self.vocab_size) or out.dtype != torch.float32):
            raise ValueError(f"LogitsProcessor.decode_out: {tuple(out.shape)} {out.dtype} for logits of "
                             f"{(h.shape[0], self.vocab_size)}; accepted: float32 of the logits' shape")
        projection = getattr(lm_head, "projection", None)
        if projection is None and self._float32_gemm_applies(h, lm_head.weight):
            # cuBLAS writes the float32 logits itself (into ``out`` when given): no 16-bit logits
            # widened in a pass of their own, and they are not rounded to 16 bits on the way.
            # H200, 1,024 rows x 128,256 x 4,096 bf16: 1,431 us against 1,770 us for the GEMM's
            # bf16 output widened into the buffer (2,017 us with a float32 tensor copied in).
            logits = torch.mm(h, lm_head.weight.t(), out_dtype=torch.float32, **({} if out is None else {"out": out}))
            return self._scale_and_cap(logits)
        # Each tensor-parallel rank holds a slice of the (padded) vocabulary: gather the slices,
        # then cut the padding off.
        local = projection(h) if projection is not None else linear_with_kernel(self.skinny_linear, h, lm_head.weight)
        logits = tensor_model_parallel_all_gather(local)[:, : self.vocab_size]
        logits = logits.float() if out is None else out.copy_(logits)
        return self._scale_and_cap(logits)

    def _float32_gemm_applies(self, h: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the projection is one CUDA GEMM with float32 output: 16-bit ``h`` and weight on
        an NVIDIA GPU, more rows than the platform's skinny kernel takes, an unpadded vocabulary
        and one tensor-parallel rank (gathering float32 slices would double the bytes sent), on a
        torch whose ``mm`` takes ``out_dtype``."""
        max_rows = getattr(self.skinny_linear, "max_rows", DEFAULT_SKINNY_MAX_ROWS) if self.skinny_linear else 0
        return (FLOAT32_LM_HEAD_GEMM and _MM_HAS_OUT_DTYPE and h.device.type == "cuda" and torch.version.hip is None
                and h.dim() == 2 and h.shape[0] > max_rows and h.dtype in (torch.bfloat16, torch.float16)
                and weight.dtype == h.dtype and weight.shape[0] == self.vocab_size
                and get_tensor_model_parallel_world_size() == 1)

    def _scale_and_cap(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logit_scale != 1.0:
            logits.mul_(self.logit_scale)
        if self.final_logit_softcap:
            logits.div_(self.final_logit_softcap).tanh_().mul_(self.final_logit_softcap)
        return logits
