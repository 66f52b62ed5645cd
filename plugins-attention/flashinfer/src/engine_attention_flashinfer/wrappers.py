"""Creating and planning FlashInfer wrappers; the only module that imports flashinfer.

Every wrapper of a backend shares one float workspace (split-KV partial results):
the wrappers run one after another on one stream, so they never use it at once.
Each wrapper keeps its own small integer workspace holding its plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import flashinfer
import torch

from engine_attention_flashinfer.planning import LayerKey, PagedKVLayout

#: GQA group size from which decode runs on the tensor-core (prefill) kernels: with
#: four or more query heads per KV head they beat the CUDA-core decode kernel.
TENSOR_CORE_MIN_GROUP = 4


@dataclass(frozen=True)
class GraphBuffers:
    """Static index buffers a CUDA-graph decode wrapper reads (shared by every batch size:
    only one graph replays at a time, and each replay re-plans into them first)."""

    kv_indptr: torch.Tensor  # [max_bs + 1] int32
    kv_indices: torch.Tensor  # [max_bs * pages of max_context_len] int32
    kv_last_page_len: torch.Tensor  # [max_bs] int32


class WrapperFactory:
    """Builds and plans FlashInfer wrappers for one model's head layout and dtypes."""

    def __init__(self, device: torch.device, workspace_bytes: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int, q_dtype: torch.dtype,
                 kv_dtype: torch.dtype) -> None:
        self.device = device
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.q_dtype = q_dtype
        self.kv_dtype = kv_dtype
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)

    # -- construction ---------------------------------------------------------
    def prefill(self) -> flashinfer.BatchPrefillWithPagedKVCacheWrapper:
        # fa2, as SGLang does for the paged path: the auto choice (fa3 on Hopper) only
        # covers head dims 64/128/256 and would compile a second family of kernels.
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")

    def decode(self, graph_bs: int | None = None,
               buffers: GraphBuffers | None = None) -> flashinfer.BatchDecodeWithPagedKVCacheWrapper:
        """An eager decode wrapper, or (``graph_bs`` and ``buffers``) one a CUDA graph can capture."""
        if graph_bs is None:
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
        assert buffers is not None
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=buffers.kv_indptr[: graph_bs + 1],
            paged_kv_indices_buffer=buffers.kv_indices,
            paged_kv_last_page_len_buffer=buffers.kv_last_page_len[:graph_bs],
        )

    # -- planning ---------------------------------------------------------------
    def plan_prefill(self, wrapper: flashinfer.BatchPrefillWithPagedKVCacheWrapper,
                     qo_indptr_cpu: torch.Tensor, layout: PagedKVLayout, key: LayerKey,
                     custom_mask: torch.Tensor | None = None) -> None:
        """Causal attention of each row's new tokens over its whole sequence (the new
        tokens' K/V are in the pool already); queries align to the end of each row.
        ``custom_mask`` (speculative tree verification, ``planning.tree_custom_mask``)
        replaces the causal mask; not combined with a sliding window."""
        if custom_mask is not None and key.window_left >= 0:
            raise ValueError("flashinfer attention: a tree mask with a sliding window is not supported")
        wrapper.plan(
            qo_indptr_cpu, layout.kv_indptr_cpu, layout.kv_indices, layout.kv_last_page_len_cpu,
            self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
            causal=custom_mask is None, custom_mask=custom_mask, sm_scale=key.sm_scale,
            window_left=key.window_left, logits_soft_cap=key.logits_soft_cap, q_data_type=self.q_dtype,
            kv_data_type=self.kv_dtype,
        )

    def plan_decode(self, wrapper: flashinfer.BatchDecodeWithPagedKVCacheWrapper,
                    layout: PagedKVLayout, key: LayerKey) -> None:
        wrapper.plan(
            layout.kv_indptr_cpu, layout.kv_indices, layout.kv_last_page_len_cpu,
            self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
            sm_scale=key.sm_scale, window_left=key.window_left,
            logits_soft_cap=key.logits_soft_cap, q_data_type=self.q_dtype,
            kv_data_type=self.kv_dtype,
        )


def version() -> str:
    return str(flashinfer.__version__)
