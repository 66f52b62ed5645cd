"""Multi-head latent attention (DeepSeek-V2/V3) in the weight-absorbed form.

Each token's keys and values are compressed into one latent ``c_kv`` (``kv_lora_rank`` dims,
RMS-normed) plus one rotary key ``k_pe`` (``qk_rope_head_dim`` dims) shared by all heads; the
KV cache stores just those (``MLATokenToKVPool``: 576 values a token and layer for DeepSeek).
Head h's key would be ``[W_UK[h] c_kv || k_pe]`` and its value ``W_UV[h] c_kv`` (``kv_b_proj``
holds both). Absorbing ``W_UK`` into the query (``q_lat = q_nope W_UK[h]``) makes attention an MQA
over the cached rows: q ``[q_lat || q_pe]`` (576 dims), one KV head ``[c_kv || k_pe]``, V the
latent (the row's first 512 dims). The output, still in latent space, goes through ``W_UV[h]``
and ``o_proj``. ``W_UK``/``W_UV`` are split from ``kv_b_proj`` once its weights are final
(``absorb_kv_b_proj``, called from the model's ``post_load_weights``), which is then dropped.

Both projections of the hidden state (``q_proj``, or V3's ``q_a_proj``, and ``kv_a_proj_with_mqa``)
run as one linear where both are unquantized: after load they are replaced by one ``input_proj``
over their concatenated weights (``fuse_input_projections``), one skinny GEMV at decode instead of
two, into which the platform may fold the input RMSNorm.

Tensor parallelism splits the heads (``q_proj``/``q_b_proj``, ``kv_b_proj`` column-parallel,
``o_proj`` row-parallel); the latent projections and the cache are replicated on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.distributed import divide, get_tensor_model_parallel_world_size
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, UnquantizedLinearMethod
from engine.layers.quantization import QuantizationConfig
from engine.layers.radix_attention import RadixAttention
from engine.model_executor.forward_batch import ForwardBatch
from engine_models_deepseek.rope import DeepseekRotaryEmbedding, softmax_scale

#: Decode batches up to this many tokens multiply by W_UK and W_UV in one launch each
#: (``head_matvec.MAX_TOKENS``; a literal here so the CPU path does not import triton).
HEAD_MATVEC_MAX_TOKENS = 4

# transformers' (and DeepSeek's) q_a_layernorm and kv_a_layernorm keep RMSNorm's default epsilon,
# not the config's rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def plain_linear(lin: nn.Module) -> bool:
    """Whether ``lin`` is a bare weight a fused kernel may read in its place: the unquantized
    method exactly, no bias, no LoRA slots."""
    return type(lin.quant_method) is UnquantizedLinearMethod and lin.bias is None and getattr(lin, "lora", None) is None


class DeepseekMLA(nn.Module):
    #: One linear for the two projections of the hidden state where ``fuse_input_projections``
    #: allows; False keeps them apart (the comparison a benchmark makes).
    fuse_projections = True
    #: The per-head W_UK / W_UV products in one Triton launch each at decode batches on CUDA
    #: (``head_matvec``); False: batched GEMMs always (the comparison a benchmark makes).
    head_matvec_kernel = True
    #: ``head_matvec`` and the prologue as programmatic dependent launches where the platform's
    #: ``pdl`` entry allows.
    kernel_pdl = True
    #: Where ``head_matvec`` applies, the W_UK product's programs in the prologue's launch
    #: (``mla_prologue(..., w_uk=...)``); False: two launches (the comparison a benchmark makes).
    fuse_prologue = True

    def __init__(self, config: Any, layer_id: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.total_heads = int(config.num_attention_heads)
        self.num_heads = divide(self.total_heads, get_tensor_model_parallel_world_size())
        self.nope_dim = int(config.qk_nope_head_dim)
        self.rope_dim = int(config.qk_rope_head_dim)
        self.v_dim = int(config.v_head_dim)
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, quant_config=quant_config,
                                             prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, self.total_heads * qk_dim, quant_config=quant_config,
                                                 prefix=f"{prefix}.q_b_proj")
        else:
            self.q_proj = ColumnParallelLinear(hidden, self.total_heads * qk_dim, quant_config=quant_config,
                                               prefix=f"{prefix}.q_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias,
                                                   quant_config=quant_config, prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, self.total_heads * (self.nope_dim + self.v_dim),
                                              quant_config=quant_config, prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(self.total_heads * self.v_dim, hidden, bias=bias, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = DeepseekRotaryEmbedding(config)
        latent_dim = self.kv_lora_rank + self.rope_dim
        self.attn = RadixAttention(self.num_heads, latent_dim, softmax_scale(config), 1, layer_id,
                                   v_head_dim=self.kv_lora_rank, kv_layout="mla")
        # Per head: W_UK [H, nope, rank] (absorbed into q) and W_UV [H, v, rank] (applied to the
        # output); filled by absorb_kv_b_proj once the weights are loaded.
        self.register_buffer("w_uk", torch.empty(self.num_heads, self.nope_dim, self.kv_lora_rank), persistent=False)
        self.register_buffer("w_uv", torch.empty(self.num_heads, self.v_dim, self.kv_lora_rank), persistent=False)
        #: Once fused (``fuse_input_projections``): one linear for q (or q_a) and kv_a, and their
        #: output widths; None: the two layers.
        self.input_proj: ReplicatedLinear | None = None
        self.input_split = (0, 0)
        self.prefix = prefix
        #: The platform's ``pdl`` entry (``use_kernels``): ``head_matvec`` and the prologue as
        #: programmatic dependent launches.
        self.pdl = False

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        self.pdl = self.kernel_pdl and bool(kernels.get("pdl", False))

    @torch.no_grad()
    def absorb_kv_b_proj(self) -> None:
        """Splits this rank's ``kv_b_proj`` into ``w_uk`` and ``w_uv``, read through the layer itself
        (its output for the identity), so any quantization method's weights come out dequantized;
        then drops ``kv_b_proj``, which the absorbed form never runs (its bytes again otherwise)."""
        eye = torch.eye(self.kv_lora_rank, dtype=self.w_uk.dtype, device=self.w_uk.device)
        weight = self.kv_b_proj(eye).t()  # [H * (nope + v), rank]
        per_head = weight.reshape(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk.copy_(per_head[:, :self.nope_dim])
        self.w_uv.copy_(per_head[:, self.nope_dim:])
        del self.kv_b_proj

    @torch.no_grad()
    def fuse_input_projections(self) -> None:
        """Replaces ``q_proj`` (or ``q_a_proj``) and ``kv_a_proj_with_mqa`` by one ``ReplicatedLinear``
        ``input_proj`` over their concatenated weights (this rank's rows of each), where both are
        unquantized, unbiased and of one dtype; otherwise leaves them apart. A single linear can
        also take the input RMSNorm folded in (``norm_consumers``, set by the model)."""
        first_name = "q_a_proj" if self.q_lora_rank else "q_proj"
        first, kv_a = getattr(self, first_name), self.kv_a_proj_with_mqa
        if not self.fuse_projections or not (plain_linear(first) and plain_linear(kv_a)):
            return
        if first.weight.dtype != kv_a.weight.dtype:
            return
        fused = torch.cat([first.weight.data, kv_a.weight.data], dim=0)
        with torch.device("meta"):  # the weight comes next: allocate nothing
            proj = ReplicatedLinear(fused.shape[1], fused.shape[0], bias=False, params_dtype=fused.dtype,
                                    prefix=f"{self.prefix}.input_proj")
        proj.weight = nn.Parameter(fused, requires_grad=False)
        self.input_split = (first.weight.shape[0], kv_a.weight.shape[0])
        self.input_proj = proj
        delattr(self, first_name)
        del self.kv_a_proj_with_mqa

    def _project_input(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q_proj or q_a_proj output, kv_a)`` of ``hidden`` (a tensor, or the input norm's
        ``PendingNorm`` when it is folded into ``input_proj``): two column slices of one linear's
        output when fused, else the two layers."""
        if self.input_proj is not None:
            return self.input_proj(hidden).split(self.input_split, dim=-1)
        first = self.q_a_proj if self.q_lora_rank else self.q_proj
        return first(hidden), self.kv_a_proj_with_mqa(hidden)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, kv_a = self._project_input(hidden)
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous()))
        q = q.view(tokens, self.num_heads, -1)
        if self._prologue_applies(kv_a, forward_batch):
            o = self._attend_fused(positions, q, kv_a, forward_batch)
        else:
            o = self._attend(positions, q, kv_a, forward_batch)
        # Out of latent space per head, [H, T, rank] @ [H, rank, v], written as [T, H, v] directly.
        out = o.new_empty(tokens, self.num_heads, self.v_dim)
        self._per_head(o.view(tokens, self.num_heads, self.kv_lora_rank), self.w_uv, out, transposed=True)
        return self.o_proj(out.view(tokens, self.num_heads * self.v_dim))

    def _head_matvec_applies(self, x: torch.Tensor) -> bool:
        return self.head_matvec_kernel and x.is_cuda and 0 < x.shape[0] <= HEAD_MATVEC_MAX_TOKENS

    def _per_head(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, transposed: bool) -> None:
        """``out[t, h] = x[t, h] @ w[h]`` (``w[h].T`` when ``transposed``): one Triton launch at decode
        batches on CUDA (``head_matvec``), else a batched GEMM writing ``out`` in place."""
        if self._head_matvec_applies(x):
            from engine_models_deepseek.head_matvec import head_matvec

            head_matvec(x, w, out, transposed=transposed, pdl=self.pdl)
            return
        torch.bmm(x.transpose(0, 1), w.transpose(1, 2) if transposed else w, out=out.transpose(0, 1))

    def _attend(self, positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        """The torch path (CPU; the reference of the fused one)."""
        tokens = q.shape[0]
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.reshape(tokens, 1, self.rope_dim))
        # q_nope W_UK per head: [H, T, nope] @ [H, nope, rank] -> [H, T, rank]
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        q_full = torch.cat((q_lat, q_pe), dim=-1)  # [T, H, rank + rope]
        k = torch.cat((c_kv.view(tokens, 1, self.kv_lora_rank), k_pe), dim=-1)  # [T, 1, rank + rope]
        return self.attn(q_full.reshape(tokens, -1), k.view(tokens, -1), k[..., :self.kv_lora_rank], forward_batch)

    def _prologue_applies(self, kv_a: torch.Tensor, forward_batch: ForwardBatch) -> bool:
        """The fused prologue runs on CUDA over an MLA pool (it writes the pool itself)."""
        pool = forward_batch.token_to_kv_pool
        return (kv_a.is_cuda and getattr(pool, "kv_layout", None) == "mla"
                and forward_batch.out_cache_loc is not None and self.kv_a_layernorm.out_quant is None)

    def _attend_fused(self, positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor,
                      forward_batch: ForwardBatch) -> torch.Tensor:
        """``_attend`` with the norm, rope, cats and pool store in one launch (``mla_prologue``) and
        the absorbed ``q_nope @ W_UK`` written straight into the query rows' latent part (by the
        same launch at decode batches, ``fuse_prologue``)."""
        from engine_models_deepseek.mla_prologue import mla_prologue

        tokens = q.shape[0]
        latent_dim = self.kv_lora_rank + self.rope_dim
        q_full = q.new_empty(tokens, self.num_heads, latent_dim)
        k = kv_a.new_empty(tokens, latent_dim)
        one_launch = self.fuse_prologue and self._head_matvec_applies(q)
        if not one_launch:
            self._per_head(q[..., :self.nope_dim], self.w_uk, q_full[..., :self.kv_lora_rank], transposed=False)
        pool = forward_batch.token_to_kv_pool
        rope = self.rotary_emb
        mla_prologue(q, kv_a, positions, rope.cos_cache, rope.sin_cache, self.kv_a_layernorm.weight,
                     self.kv_a_layernorm.variance_epsilon, self.nope_dim, rope.interleave, q_full, k,
                     pool.get_key_buffer(self.attn.layer_id), forward_batch.out_cache_loc,
                     float(self.attn.k_scale) if pool.is_fp8 else 1.0, pdl=self.pdl,
                     w_uk=self.w_uk if one_launch else None)
        # The rows are in the pool: the backend reads them there, or k (extend, 16-bit pool).
        return self.attn(q_full.view(tokens, -1), k, k[:, :self.kv_lora_rank], forward_batch, save_kv_cache=False)
