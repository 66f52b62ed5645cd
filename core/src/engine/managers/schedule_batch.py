"""Scheduler-side request and batch state (CPU lists), and the step from batch to forward.

``Req`` is one request's life in the scheduler; ``ScheduleBatch`` the requests
of one forward pass, which it turns into a ``ForwardBatch`` after allocating KV
memory for the new tokens.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.model_executor.forward_batch import ForwardBatch, ForwardMode
from engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.managers.stop_strings import StopStringCheck
    from engine.mem_cache.base_prefix_cache import BasePrefixCache
    from engine.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

_arrival = itertools.count()


class OutOfKVMemory(RuntimeError):
    """Raised when KV slots cannot be found even after evicting the prefix cache."""


@dataclass
class FinishReason:
    kind: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.kind}
        if self.kind == "stop":
            out["matched"] = self.matched
        elif self.kind == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
        return out


class Req:
    """One request inside the scheduler."""

    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: set[int], return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 stream: bool = False, priority: int = 0) -> None:
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        # Nothing can end this request before max_new_tokens (an abort aside).
        self.runs_to_length = ((sampling_params.ignore_eos or not eos_token_ids)
                               and not sampling_params.stop and not sampling_params.stop_token_ids)
        self.output_ids: list[int] = []
        # Tokens whose KV exists (or will, after this round's extend).
        self.fill_ids: list[int] = []
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.last_node: Any = None
        self.extend_input_len = 0
        # >0 while the request is being prefilled in chunks.
        self.is_chunked = 0
        self.cached_tokens = 0
        # Cached prefix tokens matched at its latest admission (the scheduler's KV plan).
        self.admitted_prefix_len = 0
        self.finished_reason: FinishReason | None = None
        self.stream = stream
        self.priority = priority
        self.arrival_seq = next(_arrival)
        # Prefix-match length seen by cache-aware policies (set before ordering).
        self.prefix_len_hint = 0
        # Logprobs.
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_token_logprobs: list[tuple[float | None, int]] | None = None
        self.input_top_logprobs: list[list[tuple[float, int]]] | None = None
        # Output tokens already sent to the detokenizer.
        self.send_offset = 0
        self.logprob_send_offset = 0
        self.input_logprobs_sent = False
        # Times retracted; a retracted request keeps its output and resumes.
        self.retractions = 0
        # Launched decode steps whose token is not appended yet (overlap scheduling).
        self.inflight_steps = 0
        # Structured output: the grammar key, its compile while the request waits, then the
        # matcher, which has accepted exactly ``output_ids`` (a retracted request keeps it).
        self.grammar_key: Any = None
        self.grammar_future: Any = None
        self.grammar: Any = None
        # Speculative decoding: verify forwards this request took part in, drafts kept in them.
        self.spec_verify_ct = 0
        self.spec_accepted_tokens = 0
        # Stop strings: the output decoded as the detokenizer will (set by the scheduler).
        self.stop_check: StopStringCheck | None = None
        # Pooling models (prefill only): the running reduction of the prompt's token states
        # (an ``engine.layers.pooler.PoolState``; None for generation requests), the Matryoshka
        # size asked for, and whether every prompt token must run (no cached prefix skipped).
        self.pool_state: Any = None
        self.dimensions: int | None = None
        self.pool_every_token = False
        # A cross-encoder's segment id per prompt token (None: all 0).
        self.token_type_ids: list[int] | None = None
        # Images and video (``engine.multimodal.MultimodalItem``, placeholder runs in
        # origin_input_ids hold pad ids); M-RoPE models: the prompt's [3, n] positions and the
        # delta of the positions after it (set by the scheduler on arrival).
        self.mm_items: list[Any] = []
        self.mrope_positions: torch.Tensor | None = None
        self.mrope_delta = 0
        # LoRA: the adapter's name and load id (set by the scheduler on arrival; None: the base
        # model). The load id also keys the request's prefixes in the radix cache.
        self.lora_name: str | None = None
        self.lora_uid: int | None = None
        # (stage, perf_counter time, tokens) for the live view and tracing (managers/timeline.py).
        self.stages: list[tuple[str, float, int]] = [("queued", time.perf_counter(), len(self.origin_input_ids))]

    # -- lifecycle ----------------------------------------------------------
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt positions remain to be scored: every chunk of a chunked prefill scores
        its part; once all are scored, a retracted request's re-prefill scores nothing again."""
        if not self.return_logprob or not 0 <= self.logprob_start_len < len(self.origin_input_ids):
            return False
        # One entry per prompt token from logprob_start_len on (token 0's is None).
        scored = len(self.input_token_logprobs or [])
        return scored < len(self.origin_input_ids) - self.logprob_start_len

    def init_next_round_input(self, tree_cache: BasePrefixCache | None) -> None:
        """Sets ``fill_ids`` and matches the longest cached prefix (leaving >= 1 token to run)."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree_cache is not None and self.req_pool_idx is None:
            max_prefix = 0 if self.pool_every_token else len(self.fill_ids) - 1
            if self.wants_prompt_logprobs():
                # Prompt logprobs need the logits of those positions: do not skip them.
                max_prefix = min(max_prefix, max(self.logprob_start_len, 0))
            if self.lora_uid is None:
                match = tree_cache.match_prefix(self.fill_ids[:max_prefix])
            else:  # an adapter's KV differs from the base model's: its own namespace
                match = tree_cache.match_prefix(self.fill_ids[:max_prefix], namespace=self.lora_uid)
            self.prefix_indices, self.last_node = match.device_indices, match.last_node
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def append_output(self, token_id: int, grammar_accepted: bool | None = None) -> None:
        """Appends a sampled token; a constrained, unfinished request's matcher accepts it (a token
        the grammar refuses cannot be sampled under the mask: it ends the request with an error).

        ``grammar_accepted``: the matcher's verdict when the step's batch already fed it the token
        (``GrammarQueue.accept_tokens``); None: the matcher takes it here.
        """
        self.output_ids.append(token_id)
        if self.grammar is None or self.finished():
            return
        if grammar_accepted is None:
            grammar_accepted = self.grammar.accept_token(token_id)
        if not grammar_accepted:
            self.finished_reason = FinishReason(
                "abort", message=f"structured output: the grammar refused token {token_id}")

    def check_finished(self) -> None:
        if self.finished():
            return
        params = self.sampling_params
        # A stop string ends the request at the token that completes it, even the last allowed
        # one (the detokenizer reports that match), and before min_new_tokens, as there.
        matched = self.stop_check.feed(self.output_ids) if self.stop_check is not None else None
        if matched is not None:
            self.finished_reason = FinishReason("stop", matched=matched)
            return
        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = FinishReason("length", length=params.max_new_tokens)
            return
        if not self.output_ids or len(self.output_ids) < params.min_new_tokens:
            return
        last = self.output_ids[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
            self.finished_reason = FinishReason("stop", matched=last)
        elif self.grammar is not None and self.grammar.is_terminated():
            self.finished_reason = FinishReason("stop", matched=last)

    def reset_for_retract(self) -> None:
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.req_pool_idx = None
        self.extend_input_len = 0
        self.is_chunked = 0
        self.retractions += 1

    def __repr__(self) -> str:
        return f"Req(rid={self.rid}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"


def _lora_uids(rows: list[Req]) -> list[int | None] | None:
    """Each row's adapter load id, or None when no row runs an adapter."""
    uids = [r.lora_uid for r in rows]
    return uids if any(u is not None for u in uids) else None


class ScheduleBatch:
    """The requests of one forward pass and their KV bookkeeping."""

    def __init__(self, reqs: list[Req], req_to_token_pool: ReqToTokenPool,
                 allocator: TokenToKVPoolAllocator, tree_cache: BasePrefixCache,
                 device: torch.device) -> None:
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.device = device
        self.forward_mode = ForwardMode.EXTEND
        # Extend rows that continue a chunked prefill produce no token this round.
        self.chunked_req: Req | None = None
        # Requests in a MIXED batch that are decode rows (they come after the extend rows).
        self.decoding_reqs: list[Req] = []

    def is_empty(self) -> bool:
        return not self.reqs

    def batch_size(self) -> int:
        return len(self.reqs)

    # -- memory -------------------------------------------------------------
    def _alloc_req_slots(self, reqs: list[Req]) -> None:
        need = [r for r in reqs if r.req_pool_idx is None]
        slots = self.req_to_token_pool.alloc(len(need))
        if slots is None:
            raise OutOfKVMemory("out of request slots")
        for req, slot in zip(need, slots):
            req.req_pool_idx = slot
            if len(req.prefix_indices):
                self.req_to_token_pool.write(slot, 0, req.prefix_indices)

    def _last_loc(self, req: Req, prefix_len: int) -> int:
        if prefix_len == 0:
            return -1
        return int(self.req_to_token_pool.req_to_token[req.req_pool_idx, prefix_len - 1])

    def _alloc_tokens(self, prefix_lens: list[int], seq_lens: list[int], last_locs: list[int]) -> torch.Tensor:
        ps = self.allocator.page_size
        need = sum(s - p for p, s in zip(prefix_lens, seq_lens)) + (ps * len(seq_lens) if ps > 1 else 0)
        if self.allocator.available_size() < need:
            self.tree_cache.evict(need - self.allocator.available_size())
        out = self.allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
        if out is None:
            raise OutOfKVMemory(f"cannot allocate {need} KV slots")
        return out

    # -- building forward batches ---------------------------------------------
    def prepare_for_extend(self, return_logprob: bool = False) -> ForwardBatch:
        """EXTEND for ``reqs``; MIXED when ``decoding_reqs`` ride along as one-token rows."""
        self.forward_mode = ForwardMode.MIXED if self.decoding_reqs else ForwardMode.EXTEND
        num_extend = len(self.reqs)
        self._alloc_req_slots(self.reqs)
        for req in self.decoding_reqs:
            req.fill_ids = req.origin_input_ids + req.output_ids
        prefix_lens = [len(r.prefix_indices) for r in self.reqs] + [r.seqlen - 1 for r in self.decoding_reqs]
        rows = self.reqs + self.decoding_reqs
        seq_lens = [len(r.fill_ids) for r in rows]
        last_locs = [self._last_loc(r, p) for r, p in zip(rows, prefix_lens)]
        out_cache_loc = self._alloc_tokens(prefix_lens, seq_lens, last_locs)
        input_ids: list[int] = []
        offset = 0
        for req, p, s in zip(rows, prefix_lens, seq_lens):
            self.req_to_token_pool.write(req.req_pool_idx, p, out_cache_loc[offset : offset + s - p])
            offset += s - p
            input_ids.extend(req.fill_ids[p:])
        fb = ForwardBatch.build(
            self.forward_mode, input_ids, [r.req_pool_idx for r in rows], seq_lens,
            prefix_lens, out_cache_loc, self.device, num_extend_reqs=num_extend, return_logprob=return_logprob)
        fb.lora_uids = _lora_uids(rows)
        if rows and (rows[0].mrope_positions is not None or any(r.mm_items for r in rows)):
            from engine.multimodal.runtime import attach_extend

            attach_extend(fb, rows, prefix_lens, seq_lens)
        return fb

    def decode_tokens_needed(self) -> int:
        """KV slots the next decode step needs (a whole page per row when pages are larger)."""
        ps = self.allocator.page_size
        if ps == 1:
            return len(self.reqs)
        return sum(1 for r in self.reqs if (r.seqlen - 1) % ps == 0) * ps

    def prepare_for_decode(self, lag: int = 0, input_ids: torch.Tensor | None = None) -> ForwardBatch:
        """One new token per row. With ``lag`` = 1 (overlap) each row's last sampled token is
        not appended yet: it is the input (``input_ids``, on the device) at position seqlen."""
        self.forward_mode = ForwardMode.DECODE
        reqs = self.reqs
        seq_lens = [len(r.origin_input_ids) + len(r.output_ids) + lag for r in reqs]
        slots = [r.req_pool_idx for r in reqs]
        r2t = self.req_to_token_pool.req_to_token
        if self.allocator.page_size == 1:
            last_locs = [-1] * len(reqs)  # unused without pages
        else:  # each row's KV slot before the new token's position
            slot_t = torch.tensor(slots, dtype=torch.int64, device=r2t.device)
            last_locs = r2t[slot_t, torch.tensor(seq_lens, dtype=torch.int64, device=r2t.device) - 2].tolist()
        out_cache_loc = self._alloc_tokens([s - 1 for s in seq_lens], seq_lens, last_locs)
        # The step's slots, positions and lengths reach the device in one copy, into the rows of
        # one tensor with the KV slots (``ForwardBatch.decode_ints``; a graph runner refreshes its
        # static copies from it in one copy too): each small copy or op costs about 2 us of device
        # time between decode steps. The host rows are pageable on purpose: a copy of a few bytes
        # from pinned memory waited about 9 us for a copy engine after the previous step's copy to
        # the host (H100 profile), against about 2 us for pageable memory.
        bs = len(reqs)
        host = torch.empty(3, bs, dtype=torch.int64)
        rows = host.numpy()
        rows[0], rows[2] = slots, seq_lens
        rows[1] = rows[2] - 1
        ints = torch.empty(4, bs, dtype=torch.int64, device=self.device)
        ints[:3].copy_(host, non_blocking=True)
        ints[3].copy_(out_cache_loc, non_blocking=True)
        r2t[ints[0], ints[1]] = out_cache_loc.to(device=r2t.device, dtype=r2t.dtype)
        if input_ids is None:
            input_ids = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs,
            input_ids=input_ids.to(self.device, non_blocking=True), req_pool_indices=ints[0],
            positions=ints[1], seq_lens=ints[2], out_cache_loc=ints[3], decode_ints=ints,
            seq_lens_cpu=seq_lens, seq_lens_sum=sum(seq_lens))
        fb.lora_uids = _lora_uids(reqs)
        if reqs and reqs[0].mrope_positions is not None:
            from engine.multimodal.runtime import attach_decode

            attach_decode(fb, reqs)
        return fb

    # -- membership -----------------------------------------------------------
    def filter(self, keep: list[Req] | None = None) -> None:
        """Keeps the unfinished requests (or exactly ``keep``)."""
        self.reqs = [r for r in self.reqs if not r.finished()] if keep is None else keep

    def merge(self, other: ScheduleBatch) -> None:
        self.reqs.extend(other.reqs)
