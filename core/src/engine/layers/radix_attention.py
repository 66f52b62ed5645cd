"""The attention layer models use: routes to the selected attention backend."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.layernorm import RMSNorm
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.mem_cache.memory_pool import MHATokenToKVPool, is_fp8

if TYPE_CHECKING:
    from engine.layers.forward_batch import ForwardBatch

# Checkpoint names of per-tensor KV-cache scales (llm-compressor / compressed-tensors, vLLM's own
# saved layout, AutoFP8's output scales of k_proj/v_proj, ModelOpt), by suffix after the attention
# module's prefix: suffix -> which scale.
_KV_SCALE_SUFFIXES = (
    (".k_scale", "k"), (".v_scale", "v"),
    (".attn.k_scale", "k"), (".attn.v_scale", "v"),
    (".k_proj.output_scale", "k"), (".v_proj.output_scale", "v"),
    (".k_proj.k_scale", "k"), (".v_proj.v_scale", "v"),
)


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """Where a checkpoint's KV-cache scale goes: ``(attention module prefix, "k" | "v")``.

    ``model.layers.3.self_attn.k_scale`` and ``model.layers.3.self_attn.k_proj.output_scale``
    both give ``("model.layers.3.self_attn", "k")``; any other name gives None. A model plugin
    hands the tensor to its ``RadixAttention.load_kv_scale`` under that prefix; whether the
    scale is used depends on ``--kv-cache-dtype``, which the model need not know.
    """
    # Longest suffixes first, so ".attn.k_scale" is not read as ".k_scale" of an "attn" module.
    for suffix, kind in sorted(_KV_SCALE_SUFFIXES, key=lambda s: -len(s[0])):
        if name.endswith(suffix):
            return name[: -len(suffix)], kind
    return None


class RadixAttention(nn.Module):
    """Attention over the paged KV pool; carries what backends need to know of the layer.

    Satisfies ``engine.attention.AttentionLayerInfo``.
    """

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int,
                 layer_id: int, logit_cap: float = 0.0, sliding_window_size: int = -1,
                 v_head_dim: int = -1, kv_layout: str = "mha") -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.logit_cap = logit_cap
        self.sliding_window_size = sliding_window_size if sliding_window_size else -1
        self.v_head_dim = v_head_dim
        #: "mha", or "mla" for multi-head latent attention (one latent KV row per token; the
        #: model's class declares ``kv_layout = "mla"`` and the runner builds an MLA pool).
        self.kv_layout = kv_layout
        # Per-tensor scales of an fp8 KV cache (stored = x / scale). Python floats, not tensors:
        # kernels take them as scalars, so a step neither reads them back from the device nor
        # breaks CUDA-graph capture. Unused when the pool stores the activation dtype.
        self.k_scale = 1.0
        self.v_scale = 1.0
        #: the platform's ``qkv_prologue`` kernel (``use_kernels``); None: norm, rotary and the KV
        #: store run as separate kernels.
        self.fused_prologue: Any = None

    #: device type of the tensors the platform's fused prologue runs on (CUDA builds of torch, ROCm's
    #: included). Tests running the Triton kernel in its CPU interpreter set "cpu".
    prologue_device_type = "cuda"

    def use_kernels(self, kernels: dict[str, Any]) -> None:
        """Takes the platform's ``qkv_prologue`` (q/k norm, rotary and KV store in one launch;
        ``forward_qkv``) when it offers one."""
        self.fused_prologue = kernels.get("qkv_prologue")

    def load_kv_scale(self, kind: str, value: torch.Tensor) -> None:
        """Sets ``k_scale`` (``kind="k"``) or ``v_scale`` from a checkpoint's one-element tensor."""
        if kind not in ("k", "v"):
            raise ValueError(f"load_kv_scale: kind {kind!r}; accepted: 'k', 'v'")
        if value.numel() != 1:
            raise ModelLoadError(f"layer {self.layer_id}: {kind}_scale has shape {tuple(value.shape)}; accepted: "
                                 "one per-tensor scale (per-head or per-channel KV scales are not supported)")
        scale = float(value.detach().float().reshape(()).cpu())
        if not math.isfinite(scale) or scale <= 0:
            raise ModelLoadError(f"layer {self.layer_id}: {kind}_scale is {scale}; accepted: a finite number > 0")
        setattr(self, f"{kind}_scale", scale)

    def extra_repr(self) -> str:
        return f"layer_id={self.layer_id}, k_scale={self.k_scale:g}, v_scale={self.v_scale:g}"

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        backend = forward_batch.attn_backend
        assert backend is not None, "ForwardBatch has no attention backend"
        return backend.forward(q, k, v, self, forward_batch, save_kv_cache)

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                    rotary_emb: RotaryEmbedding, q_norm: RMSNorm | None = None,
                    k_norm: RMSNorm | None = None) -> torch.Tensor:
        """Attention from a fused q/k/v projection's output.

        Splits ``qkv`` ``[tokens, (heads + kv_heads) * head_dim + kv_heads * v_head_dim]`` (this
        rank's heads), normalizes each q and k head with ``q_norm``/``k_norm`` when given
        (Qwen3), applies ``rotary_emb`` at ``positions``, saves K/V and attends. The steps before
        attention run in one launch of the platform's ``qkv_prologue`` where ``prologue_applies``
        says so (same values: the kernel rounds as the separate layers' kernels do), and the
        backend is then given ``k = v = None`` with ``save_kv_cache=False``: the new tokens' K/V
        are in the pool. Anything else runs the layers one by one. ``qkv`` may be changed in place.
        Returns ``[tokens, heads * v_head_dim]``.
        """
        v_dim = self.v_head_dim if self.v_head_dim > 0 else self.head_dim
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * v_dim], dim=-1)
        if self.prologue_applies(qkv, forward_batch, rotary_emb, q_norm, k_norm):
            pool = forward_batch.token_to_kv_pool
            assert pool is not None
            k_cache, v_cache = pool.get_kv_buffer(self.layer_id)
            self.fused_prologue(
                positions, q, k, v, k_cache, v_cache, forward_batch.out_cache_loc, rotary_emb.cos_cache,
                rotary_emb.sin_cache, rotary_emb.rotary_dim, q_norm.weight if q_norm is not None else None,
                k_norm.weight if k_norm is not None else None,
                q_norm.variance_epsilon if q_norm is not None else 0.0, self.k_scale, self.v_scale)
            # The new K/V are in the pool: the backend reads them there (k, v left unrotated).
            return self.forward(q, None, None, forward_batch, save_kv_cache=False)
        if q_norm is None and k_norm is None and not qkv.is_cuda and type(rotary_emb) is RotaryEmbedding:
            # The CPU's eager path: q and k rotated in one pass (per-call overhead dominates there).
            q_size = q.shape[-1]
            qk = rotary_emb.rotate_joint(positions, qkv[..., : q_size + k.shape[-1]], forward_batch.rope_cos_sin)
            q, k = qk[..., :q_size], qk[..., q_size:]
            return self.forward(q, k, v.contiguous(), forward_batch)
        if q_norm is not None:
            q = q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        if k_norm is not None:
            k = k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = rotary_emb(positions, q, k)
        return self.forward(q, k, v.contiguous(), forward_batch)

    def prologue_applies(self, qkv: torch.Tensor, forward_batch: ForwardBatch, rotary_emb: RotaryEmbedding,
                         q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> bool:
        """Whether ``forward_qkv`` takes the fused prologue: the platform offered it, the batch has
        tokens to run (decode, extend or mixed; not idle), ``qkv`` is on the kernel's device,
        the pool is the plain K/V one storing the activation dtype or fp8, the rotary embedding is
        the neox ``RotaryEmbedding`` of this head size, and the norms are plain ``RMSNorm`` of
        ``head_dim`` weights with one epsilon (both or none). Checks metadata only (no device
        sync), so a CUDA graph captures the same choice every replay makes."""
        if self.fused_prologue is None or forward_batch.forward_mode.is_idle():
            return False
        pool = forward_batch.token_to_kv_pool
        if qkv.device.type != self.prologue_device_type or type(pool) is not MHATokenToKVPool:
            return False
        if pool.dtype != qkv.dtype and not is_fp8(pool.dtype):
            return False
        if type(rotary_emb) is not RotaryEmbedding or rotary_emb.head_dim != self.head_dim:
            return False
        if q_norm is None or k_norm is None:
            return q_norm is None and k_norm is None
        return all(type(n) is RMSNorm and n.out_quant is None and n.weight.numel() == self.head_dim
                   for n in (q_norm, k_norm)) and q_norm.variance_epsilon == k_norm.variance_epsilon \
            and q_norm.weight.dtype == k_norm.weight.dtype
