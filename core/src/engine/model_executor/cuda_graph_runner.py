"""Captures decode steps in device graphs (CUDA graphs, HIP graphs) at a set of batch sizes
and replays them.

A decode step of a small batch is bound by launch overhead unless its hundreds of
kernels are replayed as one graph. Graphs are captured for batch sizes up to
``--cuda-graph-max-bs`` (and the running-request limit); a batch is padded to the nearest
captured size (padded rows read request slot 0 and write KV slot 0, which the allocator never
hands out).

Graphs share one memory pool, but each graph's output stays allocated in it: the float32
logits of a graph of ``bs`` rows take ``bs * vocab * 4`` bytes (512 KiB a row at a 128k
vocabulary). Graphs of up to ``OWN_LOGITS_MAX_BS`` rows keep their own output; the larger ones
write their logits into one buffer of ``max_bs`` rows that all of them share, which keeps
captures up to 1024 rows at ~0.5 GiB of logits instead of ~17 GiB. The model's
``LogitsProcessor`` writes its float32 logits straight into that buffer (``decode_out``), so
sharing it costs no copy of its own.
Streams and graphs come from the platform (``create_stream``, ``create_graph``,
``graph_capture``): this module names no vendor API.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from engine.attention import AttentionBackend
    from engine.mem_cache.memory_pool import ReqToTokenPool


class GraphHost(Protocol):
    """What graph capture and replay read of the model runner that owns them
    (``engine.model_executor.model_runner.ModelRunner``, which imports this module)."""

    device: torch.device
    platform: Any
    model: torch.nn.Module
    attn_backend: AttentionBackend
    req_to_token_pool: ReqToTokenPool
    max_running_requests: int
    context_len: int

    def prepare(self, forward_batch: ForwardBatch) -> None: ...

logger = logging.getLogger(__name__)

#: Decode graphs of up to this many rows keep their own logits tensor; larger ones write one shared buffer.
OWN_LOGITS_MAX_BS = 256


def capture_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    return [s for s in sizes if s <= max_bs] or [1]


class CudaGraphRunner:
    def __init__(self, runner: GraphHost, max_bs: int) -> None:
        self.runner = runner
        self.device = runner.device
        self.batch_sizes = capture_batch_sizes(min(max_bs, runner.max_running_requests))
        self.max_bs = self.batch_sizes[-1]
        self.replays = 0  # decode steps run from a graph (the scheduler's stats)
        backend = runner.attn_backend
        backend.init_cuda_graph_state(self.max_bs, self.max_bs)
        self.fill_seq_len = backend.get_cuda_graph_seq_len_fill_value()
        d = self.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=d)
        # The other static inputs are the rows of one tensor, laid out as ForwardBatch.decode_ints,
        # so a replay refreshes them in one copy; ``_padding`` holds what padded rows get.
        self._padding = torch.zeros(4, self.max_bs, dtype=torch.int64, device=d)
        self._padding[2].fill_(self.fill_seq_len)
        self.ints = self._padding.clone()
        self.req_pool_indices, self.positions, self.seq_lens, self.out_cache_loc = self.ints.unbind(0)
        # M-RoPE models (Qwen2-VL): a decode row's rotary position is its position plus the
        # request's delta, the same in all three sections; replays copy it in (padding rows: 0).
        self.mrope = bool(getattr(runner, "mrope", False))
        self.mrope_row = torch.zeros(self.max_bs, dtype=torch.int64, device=d) if self.mrope else None
        self.platform = runner.platform
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None
        self._shared_logits: torch.Tensor | None = None
        self._capture_all()

    def _static_batch(self, bs: int) -> ForwardBatch:
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs], positions=self.positions[:bs],
            seq_lens_cpu=[self.fill_seq_len] * bs, seq_lens_sum=self.fill_seq_len * bs)
        self.runner.prepare(fb)
        return fb

    def _model_positions(self, fb: ForwardBatch) -> torch.Tensor:
        """What the captured model reads as positions: ``[3, bs]`` from ``mrope_row`` on M-RoPE
        models (built inside the graph), else the static positions."""
        if self.mrope_row is None:
            return fb.positions
        return self.mrope_row[: fb.batch_size].unsqueeze(0).expand(3, -1).contiguous()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        backend = self.runner.attn_backend
        platform = self.platform
        d = self.device
        stream = platform.create_stream()
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch(bs)
            backend.init_forward_metadata_capture_cuda_graph(bs, fb.req_pool_indices, fb.seq_lens)
            with platform.stream_context(stream):
                for _ in range(2):  # warm-up: compile kernels, settle allocator
                    warm = self.runner.model(fb.input_ids, self._model_positions(fb), fb).next_token_logits
            stream.synchronize()
            shared = bs > OWN_LOGITS_MAX_BS
            if shared and self._shared_logits is None:  # the largest graph comes first
                self._shared_logits = torch.empty((self.max_bs, warm.shape[1]), dtype=warm.dtype, device=d)
            del warm
            graph = platform.create_graph()
            target = self._shared_logits[:bs] if shared else None
            with platform.graph_capture(graph, self.pool, stream):
                with platform.decode_capture_context(self.runner.model), _logits_into(self.runner.model, target):
                    logits = self.runner.model(fb.input_ids, self._model_positions(fb), fb).next_token_logits
                    if target is not None and logits.data_ptr() != target.data_ptr():
                        # A model whose logits do not come from a LogitsProcessor: its own logits go
                        # back to the pool once captured.
                        logits = target.copy_(logits)
            self.pool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = logits
            del logits
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
            self.ints[:, bs:padded].copy_(self._padding[:, bs:padded])
            self.input_ids[bs:padded].zero_()
        self.input_ids[:bs].copy_(fb.input_ids, non_blocking=True)
        packed = _decode_ints(fb)
        if packed is not None:
            self.ints[:, :bs].copy_(packed, non_blocking=True)
        else:
            for static, given in zip(self.ints, (fb.req_pool_indices, fb.positions, fb.seq_lens, fb.out_cache_loc),
                                     strict=True):
                static[:bs].copy_(given, non_blocking=True)
        if self.mrope_row is not None:
            self.mrope_row[bs:padded].zero_()
            rows = fb.mrope_positions[0] if fb.mrope_positions is not None else fb.positions
            self.mrope_row[:bs].copy_(rows, non_blocking=True)
        seq_lens_cpu = list(fb.seq_lens_cpu) + [self.fill_seq_len] * (padded - bs)
        self.runner.attn_backend.init_forward_metadata_replay_cuda_graph(
            padded, self.req_pool_indices[:padded], self.seq_lens[:padded], seq_lens_cpu)
        self.graphs[padded].replay()
        self.replays += 1
        return LogitsProcessorOutput(next_token_logits=self.outputs[padded][:bs])


@contextlib.contextmanager
def _logits_into(model: torch.nn.Module, target: torch.Tensor | None) -> Iterator[None]:
    """While capturing a graph whose logits live in the shared buffer: the model's
    ``LogitsProcessor`` writes its decode logits straight into ``target`` (None: its own tensor)."""
    procs = [m for m in model.modules() if isinstance(m, LogitsProcessor)] if target is not None else []
    for proc in procs:
        proc.decode_out = target
    try:
        yield
    finally:
        for proc in procs:
            proc.decode_out = None


def _decode_ints(fb: ForwardBatch) -> torch.Tensor | None:
    """``fb.decode_ints`` when the batch's slot, position, length and KV-slot fields are still its
    rows (nothing replaced one since ``prepare_for_decode``), else None."""
    packed = fb.decode_ints
    if packed is None or packed.shape != (4, fb.batch_size):
        return None
    fields = (fb.req_pool_indices, fb.positions, fb.seq_lens, fb.out_cache_loc)
    if any(f.data_ptr() != row.data_ptr() or f.shape != row.shape for f, row in zip(fields, packed, strict=True)):
        return None
    return packed


class VerifyGraphRunner:
    """Captures speculative verify steps (SGLang's TARGET_VERIFY) in device graphs and replays them.

    A verify step runs every request row's last accepted token and its drafts as one extend
    forward. Under graphs every row runs exactly ``tokens_per_row`` tokens (``k + 1``): a row
    with fewer drafts is padded with token 0 whose K/V goes to slot 0 (never handed out) and
    whose logits nobody reads, and whose positions come after the row's real ones, so causal
    attention keeps them out of the real positions' view. The batch is padded to the nearest
    captured size like a decode batch (padded rows: request slot 0, no prefix, KV slot 0).

    The step's inputs travel in one host-to-device copy: the static token ids, positions,
    request slots, prefix and total lengths, plus the index lists that place the allocator's KV
    slots into the static ``out_cache_loc`` and into ``req_to_token``. The attention backend
    plans the step through ``init_forward_metadata_capture_verify`` /
    ``init_forward_metadata_replay_verify`` on the static ``ForwardBatch`` (its metadata must
    live in static buffers: each row's new tokens attend to its prefix in the paged cache and
    causally among themselves). The output is the full-position logits, ``[rows * T, vocab]``
    in row-major order, read before the next replay of any graph.
    """

    def __init__(self, runner: GraphHost, tokens_per_row: int, max_bs: int, pool: Any = None) -> None:
        self.runner = runner
        self.device = runner.device
        self.tokens_per_row = t = tokens_per_row
        self.batch_sizes = capture_batch_sizes(min(max_bs, runner.max_running_requests))
        self.max_bs = mb = self.batch_sizes[-1]
        self.backend = runner.attn_backend
        self.backend.init_verify_cuda_graph_state(mb, t)
        self.context_len = runner.context_len
        d = self.device
        # Static inputs, one buffer: [ids (mb*t) | positions (mb*t) | slots | prefix | seq] (mb each).
        self._static_len = 2 * mb * t + 3 * mb
        # Per-step index lists ride behind them in the same copy: last position of each row
        # (mb), req_to_token destinations (mb*t), out_cache_loc destinations (mb*t).
        self._stage_len = self._static_len + mb + 2 * mb * t
        self.static_ints = torch.zeros(self._static_len, dtype=torch.int64, device=d)
        self.stage = torch.zeros(self._stage_len, dtype=torch.int64, device=d)
        pin = d.type != "cpu"
        self.host = torch.zeros(self._stage_len, dtype=torch.int64, pin_memory=pin)
        self._host_np = self.host.numpy()
        n = mb * t
        s = self.static_ints
        self.input_ids, self.positions = s[:n], s[n: 2 * n]
        self.req_pool_indices = s[2 * n: 2 * n + mb]
        self.prefix_lens = s[2 * n + mb: 2 * n + 2 * mb]
        self.seq_lens = s[2 * n + 2 * mb:]
        self.extend_seq_lens = torch.full((mb,), t, dtype=torch.int64, device=d)
        self.extend_start_loc = torch.arange(0, n, t, dtype=torch.int64, device=d)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=d)
        self._reset_static()
        self.platform = runner.platform
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, LogitsProcessorOutput] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.pool: Any = pool
        self.replays = 0  # verify steps run from a graph (stats, tests)
        self._capture_all()

    # -- capture ---------------------------------------------------------------
    def _reset_static(self) -> None:
        """Fill values for capture: every row has no prefix, request slot 0 and KV slot 0."""
        t = self.tokens_per_row
        self.input_ids.zero_()
        self.positions.copy_(torch.arange(t, device=self.device).repeat(self.max_bs))
        self.req_pool_indices.zero_()
        self.prefix_lens.zero_()
        self.seq_lens.fill_(t)
        self.out_cache_loc.zero_()

    def _static_batch(self, bs: int) -> ForwardBatch:
        t = self.tokens_per_row
        n = bs * t
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=bs, input_ids=self.input_ids[:n],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:n], positions=self.positions[:n],
            seq_lens_cpu=[t] * bs, seq_lens_sum=t * bs,
            extend_seq_lens=self.extend_seq_lens[:bs], extend_prefix_lens=self.prefix_lens[:bs],
            extend_start_loc=self.extend_start_loc[:bs], extend_seq_lens_cpu=[t] * bs,
            extend_prefix_lens_cpu=[0] * bs, num_extend_reqs=bs, return_logprob=True)
        fb.extra["spec_verify"] = True
        # Hidden states a proposer reads (EAGLE), when the runner's forwards capture them.
        fb.capture_hidden = getattr(self.runner, "capture_hidden", None)
        self.runner.prepare(fb)
        return fb

    @torch.inference_mode()
    def _capture_all(self) -> None:
        stream = self.platform.create_stream()
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch(bs)
            self.backend.init_forward_metadata_capture_verify(fb)
            self.batches[bs] = fb
            self.outputs[bs] = self._capture(bs, fb, stream)
        self.platform.synchronize()
        logger.info("captured device graphs for speculative verify steps: batch sizes %s, %d tokens per row",
                    self.batch_sizes, self.tokens_per_row)

    def _capture(self, bs: int, fb: ForwardBatch, stream: Any) -> LogitsProcessorOutput:
        """Captures one graph; returns its static output (full-position logits)."""
        platform = self.platform
        with platform.stream_context(stream):
            for _ in range(2):  # warm-up: compile kernels, settle allocator
                self.runner.model(fb.input_ids, fb.positions, fb)
        stream.synchronize()
        graph = platform.create_graph()
        with platform.graph_capture(graph, self.pool, stream):
            out = self.runner.model(fb.input_ids, fb.positions, fb)
        self.pool = graph.pool()
        self.graphs[bs] = graph
        assert out.full_logits is not None
        return out

    def _launch(self, bs: int) -> None:
        self.graphs[bs].replay()

    # -- replay ----------------------------------------------------------------
    def can_run(self, bs: int, max_prefix_len: int) -> bool:
        """Whether ``bs`` rows whose longest prefix is ``max_prefix_len`` fit a captured graph
        (every row's padded positions must stay inside the context)."""
        return 0 < bs <= self.max_bs and max_prefix_len + self.tokens_per_row <= self.context_len

    def replay(self, req_pool_indices: list[int], prefix_lens: list[int], tokens: list[list[int]],
               out_cache_loc: torch.Tensor) -> tuple[LogitsProcessorOutput, ForwardBatch]:
        """Runs one verify step of ``len(tokens)`` rows.

        Args:
            req_pool_indices, prefix_lens: each row's request slot and cached length (its last
                accepted token sits at position ``prefix_len``).
            tokens: each row's ``[last token] + drafts`` (at most ``tokens_per_row``).
            out_cache_loc: the KV slots of those tokens, rows back to back (device tensor).
        Returns:
            logits: ``next_token_logits`` at each row's last real token ``[bs, vocab]`` and
            ``full_logits`` ``[padded_bs * T, vocab]`` (row i's position j at ``i * T + j``;
            static: read it before the next replay); and the static batch (for the sampler).
        """
        bs = len(tokens)
        t = self.tokens_per_row
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        mb, n = self.max_bs, self.max_bs * t
        h = self._host_np
        # Static part, whole (padded rows get the capture's fill values).
        h[: self._static_len] = 0
        h[n: 2 * n] = self._fill_positions()
        h[2 * n + 2 * mb: 2 * n + 3 * mb] = t
        width = self.runner.req_to_token_pool.req_to_token.shape[1]
        last_at = self._static_len
        r2t_at = last_at + mb
        dest_at = r2t_at + n
        num_real = 0
        for i, (slot, p, row) in enumerate(zip(req_pool_indices, prefix_lens, tokens)):
            k = len(row)
            base = i * t
            h[base: base + k] = row
            h[n + base: n + base + t] = range(p, p + t)
            h[2 * n + i] = slot
            h[2 * n + mb + i] = p
            h[2 * n + 2 * mb + i] = p + t
            h[last_at + i] = base + k - 1
            h[r2t_at + base: r2t_at + base + t] = range(slot * width + p, slot * width + p + t)
            h[dest_at + num_real: dest_at + num_real + k] = range(base, base + k)
            num_real += k
        stage = self.stage
        stage.copy_(self.host, non_blocking=True)
        self.static_ints.copy_(stage[: self._static_len])
        self.out_cache_loc.zero_()
        self.out_cache_loc.index_copy_(0, stage[dest_at: dest_at + num_real], out_cache_loc.to(torch.int64))
        # The rows' KV slots, padding included, as plain extend would record them.
        r2t = self.runner.req_to_token_pool.req_to_token
        r2t.view(-1).index_copy_(0, stage[r2t_at: r2t_at + bs * t], self.out_cache_loc[: bs * t].to(r2t.dtype))
        fb = self.batches[padded]
        fb.seq_lens_cpu = [p + t for p in prefix_lens] + [t] * (padded - bs)
        fb.seq_lens_sum = sum(fb.seq_lens_cpu)
        fb.extend_prefix_lens_cpu = list(prefix_lens) + [0] * (padded - bs)
        self.backend.init_forward_metadata_replay_verify(fb)
        self._launch(padded)
        self.replays += 1
        static = self.outputs[padded]
        full = static.full_logits
        assert full is not None
        last = full.index_select(0, stage[last_at: last_at + bs])
        out = LogitsProcessorOutput(next_token_logits=last, full_logits=full)
        hidden = getattr(static, "hidden_states", None)
        if hidden is not None:  # [padded_bs * T, D], laid out as full_logits
            out.hidden_states = hidden
        return out, fb

    def _fill_positions(self) -> Any:
        pos = getattr(self, "_fill_pos", None)
        if pos is None:
            import numpy as np

            pos = self._fill_pos = np.tile(np.arange(self.tokens_per_row, dtype=np.int64), self.max_bs)
        return pos
