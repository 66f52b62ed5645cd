"""The decode graph runner without device graphs, for tests on the CPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from engine.model_executor.cuda_graph_runner import CudaGraphRunner


class EagerReplayGraphs(CudaGraphRunner):
    """``CudaGraphRunner`` with the capture left out: a "graph" of a bucket runs the model on that
    bucket's static batch (what a graph does with the buffers as they are at replay time), with
    the lengths the replay hands the backend. Records each replay's bucket (``replayed``) and its
    static slots, positions, lengths and KV slots (``seen``, ``[4, bucket]`` copies)."""

    def __init__(self, runner: Any, max_bs: int) -> None:
        backend = runner.attn_backend
        backend.init_cuda_graph_state = lambda max_bs, max_tokens: None
        backend.init_forward_metadata_replay_cuda_graph = self._remember_lengths
        self.replayed: list[int] = []
        self.seen: list[torch.Tensor] = []
        super().__init__(runner, max_bs)

    def _remember_lengths(self, bs: int, slots: torch.Tensor, seq_lens: torch.Tensor, lens_cpu: list[int]) -> None:
        self._lens_cpu = lens_cpu

    def _capture_all(self) -> None:
        for bs in self.batch_sizes:
            self.graphs[bs] = SimpleNamespace(replay=lambda bs=bs: self._run(bs))
            self.outputs[bs] = torch.zeros(bs, self.runner.vocab_size)

    @torch.inference_mode()
    def _run(self, bs: int) -> None:
        self.seen.append(self.ints[:, :bs].clone())
        fb = self._static_batch(bs)
        fb.seq_lens_cpu, fb.seq_lens_sum = list(self._lens_cpu), sum(self._lens_cpu)
        self.runner.attn_backend.init_forward_metadata(fb)
        out = self.runner.model(fb.input_ids, fb.positions, fb)
        self.outputs[bs].copy_(out.next_token_logits)
        self.replayed.append(bs)
