"""Captures decode steps in device graphs (CUDA graphs, HIP graphs) at a set of batch sizes
and replays them.

A decode step of a small batch is bound by launch overhead unless its hundreds of
kernels are replayed as one graph. Graphs are captured for batch sizes up to
``--cuda-graph-max-bs``; a batch is padded to the nearest captured size (padded
rows read request slot 0 and write KV slot 0, which the allocator never hands out).
Streams and graphs come from the platform (``create_stream``, ``create_graph``,
``graph_capture``): this module names no vendor API.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any

import torch

from engine.layers.logits_processor import LogitsProcessorOutput
from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from engine.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    return [s for s in sizes if s <= max_bs] or [1]


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_bs: int) -> None:
        self.runner = runner
        self.device = runner.device
        self.batch_sizes = capture_batch_sizes(min(max_bs, runner.max_running_requests))
        self.max_bs = self.batch_sizes[-1]
        backend = runner.attn_backend
        backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        self.fill_seq_len = backend.get_cuda_graph_seq_len_fill_value()
        d = self.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=d)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=d)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=d)
        self.seq_lens = torch.full((self.max_bs,), self.fill_seq_len, dtype=torch.int64, device=d)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=d)
        self.platform = runner.platform
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None
        self._capture_all()

    def _static_batch(self, bs: int) -> ForwardBatch:
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs], positions=self.positions[:bs],
            seq_lens_cpu=[self.fill_seq_len] * bs, seq_lens_sum=self.fill_seq_len * bs)
        self.runner.prepare(fb)
        return fb

    @torch.inference_mode()
    def _capture_all(self) -> None:
        backend = self.runner.attn_backend
        platform = self.platform
        stream = platform.create_stream()
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch(bs)
            backend.init_forward_metadata_capture_cuda_graph(bs, fb.req_pool_indices, fb.seq_lens)
            with platform.stream_context(stream):
                for _ in range(2):  # warm-up: compile kernels, settle allocator
                    self.runner.model(fb.input_ids, fb.positions, fb)
            stream.synchronize()
            graph = platform.create_graph()
            with platform.graph_capture(graph, self.pool, stream):
                out = self.runner.model(fb.input_ids, fb.positions, fb)
            self.pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out.next_token_logits
        platform.synchronize()
        logger.info("captured device graphs for decode batch sizes %s", self.batch_sizes)

    def can_run(self, fb: ForwardBatch) -> bool:
        # Decode graphs are captured without hidden-state capture (a proposer asks for it later).
        return (fb.forward_mode.is_decode() and 0 < fb.batch_size <= self.max_bs and not fb.return_logprob
                and fb.capture_hidden is None)

    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        bs = fb.batch_size
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        if padded != bs:
            self.seq_lens[bs:padded].fill_(self.fill_seq_len)
            self.req_pool_indices[bs:padded].zero_()
            self.out_cache_loc[bs:padded].zero_()
            self.input_ids[bs:padded].zero_()
            self.positions[bs:padded].zero_()
        self.input_ids[:bs].copy_(fb.input_ids, non_blocking=True)
        self.positions[:bs].copy_(fb.positions, non_blocking=True)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices, non_blocking=True)
        self.seq_lens[:bs].copy_(fb.seq_lens, non_blocking=True)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc, non_blocking=True)
        seq_lens_cpu = list(fb.seq_lens_cpu) + [self.fill_seq_len] * (padded - bs)
        self.runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            padded, self.req_pool_indices[:padded], self.seq_lens[:padded], seq_lens_cpu)
        self.graphs[padded].replay()
        return LogitsProcessorOutput(next_token_logits=self.outputs[padded][:bs])
