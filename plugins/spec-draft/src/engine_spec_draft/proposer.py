"""Draft-model proposing: a second, smaller ``ModelRunner`` with its own KV pool.

Per request the proposer keeps a slot in the draft's request pool and ``kv_len``, the number
of leading tokens of the request (prompt + output) whose KV the draft holds. A round
(``propose``):

1. catch up: each row's tokens from ``kv_len`` to the end (the last token included; after a
   verify step that is the kept drafts' successor, the target's own token) in one forward whose
   last logits give draft 0: an EXTEND, or a DECODE when every row has exactly one token to
   feed (all drafts of the previous round rejected);
2. up to ``k - 1`` DECODE steps (one token per row), each feeding the previous step's greedy
   token, which stays on the device (the argmax is the next step's input). Decode steps replay
   the draft runner's CUDA graphs where it captured them (``CudaGraphRunner``).

Rows are ordered by ``max_draft`` (largest first), so the rows still drafting at a step are a
prefix of the previous step's: a row leaves the batch once it has its ``max_draft`` drafts,
with no device sync. A draft at or above the target's vocabulary ends its row's chain; the row
still runs to its ``max_draft`` and the tokens after the stop are cut when the round's drafts
reach the host, in one copy (the round's only sync). KV slots of all the round's steps are
allocated in one call and written to ``req_to_token`` in one indexed write.

After verification (``on_verified``: ``a`` drafts kept) the draft's KV is right for the
request's first ``L + a`` tokens (``L``: its length before the step); the KV of later drafts is
freed and the next round catches up from there. Requests that leave the running batch
(finished, aborted, retracted) lose their draft state at the next ``propose``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.speculative import DraftRequest, Proposer, ProposerContext

if TYPE_CHECKING:
    from engine.config import ServerArgs
    from engine.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _DraftState:
    slot: int
    kv_len: int = 0  # leading tokens of the request with KV in the draft pool
    length_at_propose: int = 0  # the request's length when drafts were last proposed


@dataclasses.dataclass
class _Row:
    """One request drafting in the current round."""

    index: int  # into the round's request list
    state: _DraftState
    tokens: list[int]  # to feed in the catch-up: the request's tokens from state.kv_len on
    max_draft: int
    length: int  # the request's length L (its KV after the catch-up)


class DraftModelProposer(Proposer):
    def __init__(self, runner: Any, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: drafts at or above it end the chain
        self.states: dict[str, _DraftState] = {}
        # Draft forwards run, by mode (tests and logs: steps after the catch-up are DECODE).
        self.extend_forwards = 0
        self.decode_forwards = 0

    # -- pools ----------------------------------------------------------------------
    def _state(self, rid: str) -> _DraftState | None:
        state = self.states.get(rid)
        if state is None:
            slots = self.runner.req_to_token_pool.alloc(1)
            if slots is None:
                return None
            state = self.states[rid] = _DraftState(slots[0])
        return state

    def _truncate(self, cuts: Sequence[tuple[_DraftState, int]]) -> None:
        """Frees the draft KV of positions ``keep..kv_len`` of each ``(state, keep)``, in one call."""
        r2t = self.runner.req_to_token_pool.req_to_token
        freed = []
        for state, keep in cuts:
            if keep < state.kv_len:
                freed.append(r2t[state.slot, keep: state.kv_len])
                state.kv_len = keep
        if freed:
            self.runner.token_to_kv_pool_allocator.free(torch.cat(freed).to(torch.int64))

    def release(self, rid: str) -> None:
        state = self.states.pop(rid, None)
        if state is not None:
            self._truncate([(state, 0)])
            self.runner.req_to_token_pool.free(state.slot)

    # -- drafting --------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int]]:
        live = {r.rid for r in reqs}
        for rid in [rid for rid in self.states if rid not in live]:
            self.release(rid)
        drafts: list[list[int]] = [[] for _ in reqs]
        rows: list[_Row] = []
        cuts = []
        for i, req in enumerate(reqs):
            if req.max_draft <= 0:
                continue
            state = self._state(req.rid)
            if state is None:  # no request slot left in the draft's pool
                continue
            tokens = list(req.prompt_ids) + list(req.output_ids)
            cuts.append((state, min(state.kv_len, len(tokens) - 1)))
            state.length_at_propose = len(tokens)
            rows.append(_Row(i, state, tokens, req.max_draft, len(tokens)))
        self._truncate(cuts)
        for row in rows:
            row.tokens = row.tokens[row.state.kv_len:]
        if not rows:
            return drafts
        rows.sort(key=lambda r: -r.max_draft)  # stable; the rows of each step are a prefix
        steps = self._draft(rows)
        if not steps:  # the draft pool is full: no drafts this round
            return drafts
        flat = torch.cat(steps).tolist()  # the round's only device-to-host copy
        stopped = [False] * len(rows)
        start = 0
        for step in steps:  # step j holds the tokens of rows 0 .. n_j - 1
            for r in range(step.shape[0]):
                if stopped[r]:
                    continue
                tok = flat[start + r]
                if tok >= self.vocab_size:  # outside the target's vocabulary: the chain ends
                    stopped[r] = True
                else:
                    drafts[rows[r].index].append(tok)
            start += step.shape[0]
        return drafts

    def _draft(self, rows: list[_Row]) -> list[torch.Tensor]:
        """Runs the round: the catch-up, then decode steps while rows want drafts and the draft
        pool has room. Returns each step's greedy tokens (device), step ``j`` for the first
        ``n_j`` rows; empty when the pool cannot hold the catch-up."""
        runner = self.runner
        allocator = runner.token_to_kv_pool_allocator
        caught_up = sum(len(row.tokens) for row in rows)
        # Rows in decode step j (feeding draft j - 1): those wanting more than j drafts.
        sizes = [sum(1 for row in rows if row.max_draft > j) for j in range(1, rows[0].max_draft)]
        room = allocator.available_size() - caught_up
        if room < 0:
            return []
        num_steps = 0
        for n in sizes:
            if n > room:
                break  # the pool is full: fewer drafts this round
            room -= n
            num_steps += 1
        sizes = sizes[:num_steps]
        loc = allocator.alloc(caught_up + sum(sizes))
        assert loc is not None  # checked against available_size above
        catch_loc, step_loc = loc[:caught_up], loc[caught_up:]
        # One host-to-device copy: the decode steps' positions and request slots (step-major,
        # in the layout of step_loc), then for a one-token catch-up its ids, positions, slots.
        positions = [rows[r].length + j - 1 for j, n in enumerate(sizes, 1) for r in range(n)]
        slots = [rows[r].state.slot for n in sizes for r in range(n)]
        one_token = all(len(row.tokens) == 1 for row in rows)
        host = positions + slots
        if one_token:
            host += ([row.tokens[0] for row in rows] + [row.length - 1 for row in rows]
                     + [row.state.slot for row in rows])
        packed = torch.tensor(host, dtype=torch.int64).to(runner.device, non_blocking=True)
        m, num_rows = len(positions), len(rows)
        r2t = runner.req_to_token_pool.req_to_token
        pos_d, slot_d = packed[:m], packed[m: 2 * m]
        if m:
            r2t[slot_d, pos_d] = step_loc.to(r2t.dtype)
        if one_token:
            ids, cpos, cslot = packed[2 * m:].view(3, num_rows)
            r2t[cslot, cpos] = catch_loc.to(r2t.dtype)
            fb = self._decode_batch(ids, cslot, cpos, catch_loc, [row.length for row in rows])
        else:
            fb = self._extend_batch(rows, catch_loc)
        steps = [self._greedy(fb)]
        seq_d = pos_d + 1
        start = 0
        for j, n in enumerate(sizes, 1):
            end = start + n
            fb = self._decode_batch(steps[-1][:n], slot_d[start:end], pos_d[start:end], step_loc[start:end],
                                    [rows[r].length + j for r in range(n)], seq_d[start:end])
            steps.append(self._greedy(fb))
            start = end
        for row in rows:
            row.state.kv_len = row.length + min(row.max_draft - 1, num_steps)
        return steps

    def _greedy(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.forward_mode.is_decode():
            self.decode_forwards += 1
        else:
            self.extend_forwards += 1
        out = self.runner.forward(fb)
        # Read before the next forward: under graphs the logits live in a static buffer.
        return torch.argmax(out.next_token_logits, dim=-1)

    def _extend_batch(self, rows: list[_Row], loc: torch.Tensor) -> ForwardBatch:
        """The catch-up as an EXTEND over each row's tokens (``loc``: their KV slots, in order)."""
        from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

        runner = self.runner
        ids: list[int] = []
        offset = 0
        for row in rows:
            runner.req_to_token_pool.write(row.state.slot, row.state.kv_len, loc[offset: offset + len(row.tokens)])
            offset += len(row.tokens)
            ids.extend(row.tokens)
        return ForwardBatch.build(ForwardMode.EXTEND, ids, [row.state.slot for row in rows],
                                  [row.length for row in rows], [row.state.kv_len for row in rows], loc,
                                  runner.device, num_extend_reqs=len(rows))

    def _decode_batch(self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor,
                      seq_lens_cpu: list[int], seq_lens: torch.Tensor | None = None) -> ForwardBatch:
        """One token per row (device tensors; ``req_to_token`` already holds ``loc``)."""
        from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(seq_lens_cpu), input_ids=ids, req_pool_indices=slots,
            seq_lens=positions + 1 if seq_lens is None else seq_lens, out_cache_loc=loc, positions=positions,
            seq_lens_cpu=seq_lens_cpu, seq_lens_sum=sum(seq_lens_cpu))

    def on_verified(self, reqs: Sequence[DraftRequest], num_accepted: Sequence[int]) -> None:
        cuts = []
        for req, kept in zip(reqs, num_accepted):
            state = self.states.get(req.rid)
            if state is None or state.length_at_propose == 0:
                continue
            # Right: the request's tokens before the step and the kept drafts.
            cuts.append((state, min(state.kv_len, state.length_at_propose + kept)))
            state.length_at_propose = 0
        self._truncate(cuts)


def draft_server_args(args: ServerArgs, draft_model_path: str, target: Any, num_draft_tokens: int,
                      cuda_graph: bool = True) -> ServerArgs:
    """The draft runner's settings: the target's, with the draft's checkpoint and pools sized for
    what speculation uses.

    Drafting happens only for batches of at most ``--speculative-max-batch-size`` requests, so the
    draft holds that many request slots, captures CUDA graphs (as the target does:
    ``--disable-cuda-graph``) for decode batches up to that size (and ``--cuda-graph-max-bs``),
    and its KV pool needs at most a full context per slot (``num_draft_tokens`` of slack), capped
    at the target's pool size. Without a target runner (the conformance kit builds the proposer
    alone) the pool is ``--max-total-tokens`` or 8192 tokens.
    """
    max_bs = args.speculative_max_batch_size
    if target is not None:
        pool = min(target.max_total_num_tokens, max_bs * (target.context_len + num_draft_tokens))
    else:
        pool = args.max_total_tokens or 8192
    return dataclasses.replace(
        args, model_path=draft_model_path, tokenizer_path=None, speculative_algorithm=None,
        quant=None, context_length=args.context_length, max_total_tokens=pool, max_running_requests=max_bs,
        disable_cuda_graph=args.disable_cuda_graph or not cuda_graph,
        cuda_graph_max_bs=min(args.cuda_graph_max_bs, max_bs))


def create(ctx: ProposerContext, options: dict[str, Any] | None = None) -> DraftModelProposer:
    from engine.model_executor.model_runner import ModelRunner

    args = ctx.server_args
    target = ctx.target_runner
    opts = options or {}
    cuda_graph = opts.get("cuda_graph", True)
    if not isinstance(cuda_graph, bool):
        raise ValueError(f"plugin option draft.cuda_graph: {cuda_graph!r}; accepted: true or false")
    draft_args = draft_server_args(args, ctx.draft_model_path, target, ctx.num_draft_tokens, cuda_graph)
    # Device memory the draft takes: it comes on top of the target's --mem-fraction-static share.
    on_device = target is not None and target.device.type != "cpu"
    free_before = target.platform.memory_info(target.device)[0] if on_device else 0
    runner = ModelRunner(draft_args, ctx.draft_model_path)
    if runner.vocab_size < ctx.vocab_size // 2:
        logger.warning("draft model vocabulary (%d) is much smaller than the target's (%d): same tokenizer?",
                       runner.vocab_size, ctx.vocab_size)
    graphs = runner.cuda_graph_runner
    taken = ""
    if on_device:
        free_after = runner.platform.memory_info(runner.device)[0]
        taken = (f"; device memory taken by the draft (weights, pool, graphs): {(free_before - free_after) / 2**30:.2f}"
                 f" GiB, {free_after / 2**30:.2f} GiB left free")
    logger.info("draft model %s: KV pool of %d tokens, %d request slots, decode steps %s%s", ctx.draft_model_path,
                runner.max_total_num_tokens, runner.max_running_requests,
                f"in CUDA graphs for batch sizes {graphs.batch_sizes}" if graphs is not None else "eager", taken)
    return DraftModelProposer(runner, ctx.vocab_size)
