"""The device-side description of one forward pass (the last of the three batch forms).

``ScheduleBatch`` (scheduler, CPU lists) -> ``ModelWorkerBatch`` (what the worker
needs) -> ``ForwardBatch`` (device tensors the model and attention backend read).

Defined with the layer SDK because everything below the model executor reads it (layers,
attention backends, the sampler) and the executor builds it; ``engine.model_executor.forward_batch``
exports the same names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from engine.sampling.sampling_batch_info import SamplingBatchInfo


class ForwardMode(enum.IntEnum):
    # Prefill of new tokens, possibly on top of a cached prefix (chunked prefill too).
    EXTEND = 1
    # One new token per request.
    DECODE = 2
    # Extend rows followed by decode rows in one batch (chunked prefill + decode).
    MIXED = 3
    # Nothing to run on this rank (data-parallel padding).
    IDLE = 4

    def is_extend(self) -> bool:
        """True for every mode whose rows may carry more than one new token."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


class BatchAttention(Protocol):
    """What the layers call on a batch's attention backend (an ``engine.attention.AttentionBackend``).

    Named by what is called rather than imported: attention backends take a ``ForwardBatch``, so
    importing their class here would make the two modules each other's import.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: Any,
                forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    """Everything one model forward needs, on the model's device."""

    forward_mode: ForwardMode
    # Number of requests (rows) in the batch.
    batch_size: int
    # [num_tokens] token ids to run: all new tokens of every row, concatenated.
    input_ids: torch.Tensor
    # [batch_size] request slots in ReqToTokenPool.
    req_pool_indices: torch.Tensor
    # [batch_size] total length of each row after this pass (prefix + new tokens).
    seq_lens: torch.Tensor
    # [num_tokens] KV slots the new tokens' K/V are written to.
    out_cache_loc: torch.Tensor
    # [num_tokens] position ids of the new tokens.
    positions: torch.Tensor
    # Host copy of seq_lens: backends plan with it without a device sync.
    seq_lens_cpu: list[int]
    # Sum of seq_lens (used to size backend workspaces).
    seq_lens_sum: int = 0
    # DECODE batches from ``ScheduleBatch.prepare_for_decode``: ``[4, batch_size]`` int64 whose rows
    # are ``req_pool_indices``, ``positions``, ``seq_lens`` and ``out_cache_loc`` (those fields are
    # views of it), so a graph runner refreshes its static copies in one copy. None otherwise.
    decode_ints: torch.Tensor | None = None
    # EXTEND/MIXED: [batch_size] new tokens per row, cached-prefix lengths, start offsets.
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    # MIXED: the first `num_extend_reqs` rows are extend rows, the rest decode rows.
    num_extend_reqs: int = 0
    # Rows whose logits are wanted at every new position (prompt logprobs), else last only.
    return_logprob: bool = False
    # Tree verification (speculative decoding, EXTEND only; None: causal as usual). Per row an
    # ``[n, n]`` bool matrix over the row's ``n`` new tokens, ``m[i, j]`` True where new token i
    # attends to new token j (its ancestors and itself); every new token still attends to the
    # whole cached prefix. The rows' matrices, flattened row-major, back to back.
    tree_mask: torch.Tensor | None = None
    # [batch_size + 1] int64: row i's matrix is tree_mask[tree_mask_indptr[i]:tree_mask_indptr[i + 1]].
    tree_mask_indptr: torch.Tensor | None = None
    # Pools and backend shared by every layer.
    req_to_token_pool: ReqToTokenPool | None = None
    token_to_kv_pool: MHATokenToKVPool | None = None
    attn_backend: BatchAttention | None = None
    sampling_info: SamplingBatchInfo | None = None
    # Per-backend metadata computed once per batch by attn_backend.init_forward_metadata.
    attn_metadata: Any = None
    # Pipeline parallelism: the previous stage's hidden states (and residual), on every stage
    # but the first (an ``engine.layers.pipeline.PPProxyTensors``).
    pp_proxy: Any = None
    # Free-form slot for extensions (speculative decoding, multimodal, ...).
    extra: dict[str, Any] = field(default_factory=dict)
    # LoRA (``engine.lora``): per row (extend rows, then decode rows), the load id of the adapter
    # the row runs with, None for the base model; None when no row has one.
    lora_uids: list[int | None] | None = None
    # Multimodal models (``engine.multimodal``), prefill: [num_tokens, hidden] embeddings the model
    # runs on instead of embedding ``input_ids`` (text embeddings with the items' rows scattered
    # in; built by the model runner). None: embed ``input_ids``.
    input_embeds: torch.Tensor | None = None
    # Per row (extend rows, then decode rows): an ``engine.multimodal.runtime.RowMultimodal`` when
    # the row's request carries images or video, else None; None when no row does.
    mm_rows: list[Any] | None = None
    # M-RoPE models (``engine.multimodal.MRopeModel``): [3, num_tokens] positions; the model
    # runner passes them as ``positions`` to the model.
    mrope_positions: torch.Tensor | None = None
    # Hidden states a speculative proposer reads (EAGLE; ``engine.layers.hidden_capture``): None
    # captures nothing; () the LM head's input; decoder layer ids: those layers' outputs,
    # concatenated in this order. Returned in ``LogitsProcessorOutput.hidden_states``.
    capture_hidden: tuple[int, ...] | None = None
    # Filled while the model runs when layers are captured: layer id -> [num_tokens, hidden].
    captured_layers: dict[int, torch.Tensor] = field(default_factory=dict)
    # Rotary cos/sin at ``positions``, computed by the first layer and read by the others (the
    # unfused path: ``RotaryEmbedding.rotate_joint``): rope key -> (positions, cos, sin, the
    # rotary embedding that read them).
    rope_cos_sin: dict[Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def split_rows(self, parts: int) -> list[ForwardBatch]:
        """This batch as up to ``parts`` batches of consecutive rows (pipeline micro-batches).

        Each part shares this batch's pools, backend and sampling info; its own attention
        metadata is computed when it runs. A batch of fewer rows than ``parts`` gives one part
        per row; one row gives ``[self]``.
        """
        bs = self.batch_size
        parts = max(1, min(parts, bs))
        if parts == 1:
            return [self]
        bounds = [bs * i // parts for i in range(parts + 1)]
        if self.forward_mode.is_extend():
            assert self.extend_seq_lens_cpu is not None
            tok = [0]
            for n in self.extend_seq_lens_cpu:
                tok.append(tok[-1] + n)
        else:
            tok = list(range(bs + 1))
        out = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            t0, t1 = tok[lo], tok[hi]
            sub = ForwardBatch(
                forward_mode=self.forward_mode, batch_size=hi - lo, input_ids=self.input_ids[t0:t1],
                req_pool_indices=self.req_pool_indices[lo:hi], seq_lens=self.seq_lens[lo:hi],
                out_cache_loc=self.out_cache_loc[t0:t1], positions=self.positions[t0:t1],
                seq_lens_cpu=self.seq_lens_cpu[lo:hi], seq_lens_sum=sum(self.seq_lens_cpu[lo:hi]),
                num_extend_reqs=max(0, min(hi, self.num_extend_reqs) - lo), return_logprob=self.return_logprob,
                req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
                attn_backend=self.attn_backend, sampling_info=self.sampling_info, extra=self.extra,
                lora_uids=self.lora_uids[lo:hi] if self.lora_uids is not None else None)
            if self.forward_mode.is_extend():
                assert self.extend_seq_lens is not None and self.extend_prefix_lens is not None
                assert self.extend_prefix_lens_cpu is not None and self.extend_seq_lens_cpu is not None
                sub.extend_seq_lens = self.extend_seq_lens[lo:hi]
                sub.extend_prefix_lens = self.extend_prefix_lens[lo:hi]
                sub.extend_start_loc = self.extend_start_loc[lo:hi] - t0  # type: ignore[index]
                sub.extend_seq_lens_cpu = self.extend_seq_lens_cpu[lo:hi]
                sub.extend_prefix_lens_cpu = self.extend_prefix_lens_cpu[lo:hi]
            out.append(sub)
        return out

    @classmethod
    def build(
        cls,
        forward_mode: ForwardMode,
        input_ids: list[int],
        req_pool_indices: list[int],
        seq_lens: list[int],
        prefix_lens: list[int],
        out_cache_loc: torch.Tensor,
        device: torch.device | str,
        num_extend_reqs: int = 0,
        return_logprob: bool = False,
    ) -> ForwardBatch:
        """Builds a batch from host lists; decode rows have ``prefix_len == seq_len - 1``."""
        bs = len(seq_lens)
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
        positions = torch.cat(
            [torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix_lens, seq_lens)]
        ) if bs else torch.empty(0, dtype=torch.int64)
        start_loc = [0] * bs
        for i in range(1, bs):
            start_loc[i] = start_loc[i - 1] + extend_lens[i - 1]

        def dev(x: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

        fb = cls(
            forward_mode=forward_mode,
            batch_size=bs,
            input_ids=dev(input_ids),
            req_pool_indices=dev(req_pool_indices),
            seq_lens=dev(seq_lens),
            out_cache_loc=out_cache_loc.to(device, non_blocking=True),
            positions=positions.to(device, non_blocking=True),
            seq_lens_cpu=list(seq_lens),
            seq_lens_sum=sum(seq_lens),
            num_extend_reqs=num_extend_reqs,
            return_logprob=return_logprob,
        )
        if forward_mode.is_extend():
            fb.extend_seq_lens = dev(extend_lens)
            fb.extend_prefix_lens = dev(prefix_lens)
            fb.extend_start_loc = dev(start_loc)
            fb.extend_seq_lens_cpu = extend_lens
            fb.extend_prefix_lens_cpu = list(prefix_lens)
        return fb
