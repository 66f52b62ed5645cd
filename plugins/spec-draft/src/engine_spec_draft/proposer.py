"""Draft-model proposing: a second, smaller ``ModelRunner`` with its own KV pool.

Per request the proposer keeps a slot in the draft's request pool and ``kv_len``, the number
of leading tokens of the request (prompt + output) whose KV the draft holds. A step:

1. catch up: one EXTEND over each row's tokens from ``kv_len`` to the end (the last token
   included; after a verify step that is the kept drafts' successor, the target's own token),
   whose last logits give draft 0;
2. ``k - 1`` more one-token EXTEND steps, each feeding the previous draft (greedy).

After verification (``on_verified``: ``a`` drafts kept) the draft's KV is right for the
request's first ``L + a`` tokens (``L``: its length before the step); the KV of later drafts is
freed and the next step catches up from there. Requests that leave the running batch
(finished, aborted, retracted) lose their draft state at the next ``propose``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from engine.speculative import DraftRequest, Proposer, ProposerContext

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _DraftState:
    slot: int
    kv_len: int = 0  # leading tokens of the request with KV in the draft pool
    length_at_propose: int = 0  # the request's length when drafts were last proposed
    drafted: int = 0  # drafts fed through the draft model at that step (the last is not)


class DraftModelProposer(Proposer):
    def __init__(self, runner: Any, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: drafts at or above it end the chain
        self.states: dict[str, _DraftState] = {}

    # -- pools ----------------------------------------------------------------------
    def _state(self, rid: str) -> _DraftState | None:
        state = self.states.get(rid)
        if state is None:
            slots = self.runner.req_to_token_pool.alloc(1)
            if slots is None:
                return None
            state = self.states[rid] = _DraftState(slots[0])
        return state

    def _truncate(self, state: _DraftState, keep: int) -> None:
        """Frees the draft KV of positions ``keep..kv_len``."""
        if keep < state.kv_len:
            row = self.runner.req_to_token_pool.req_to_token[state.slot]
            self.runner.token_to_kv_pool_allocator.free(row[keep: state.kv_len].to(torch.int64))
            state.kv_len = keep

    def release(self, rid: str) -> None:
        state = self.states.pop(rid, None)
        if state is not None:
            self._truncate(state, 0)
            self.runner.req_to_token_pool.free(state.slot)

    # -- drafting --------------------------------------------------------------------
    def _extend(self, rows: list[tuple[_DraftState, list[int]]]) -> list[int] | None:
        """Runs ``tokens`` after each state's ``kv_len``; the greedy next token of each row
        (None when the draft pool is full)."""
        from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

        runner = self.runner
        prefix = [s.kv_len for s, _ in rows]
        seq = [s.kv_len + len(t) for s, t in rows]
        loc = runner.token_to_kv_pool_allocator.alloc_extend(prefix, seq, [-1] * len(rows))
        if loc is None:
            return None
        ids: list[int] = []
        offset = 0
        for (state, tokens), p, s in zip(rows, prefix, seq):
            runner.req_to_token_pool.write(state.slot, p, loc[offset: offset + s - p])
            offset += s - p
            ids.extend(tokens)
            state.kv_len = s
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [s.slot for s, _ in rows], seq, prefix, loc,
                                runner.device, num_extend_reqs=len(rows))
        out = runner.forward(fb)
        return torch.argmax(out.next_token_logits, dim=-1).tolist()

    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int]]:
        live = {r.rid for r in reqs}
        for rid in [rid for rid in self.states if rid not in live]:
            self.release(rid)
        drafts: list[list[int]] = [[] for _ in reqs]
        active: list[tuple[int, _DraftState, list[int]]] = []
        for i, req in enumerate(reqs):
            if req.max_draft <= 0:
                continue
            state = self._state(req.rid)
            if state is None:
                continue
            tokens = list(req.prompt_ids) + list(req.output_ids)
            self._truncate(state, min(state.kv_len, len(tokens) - 1))
            state.length_at_propose, state.drafted = len(tokens), 0
            active.append((i, state, tokens[state.kv_len:]))
        if not active:
            return drafts
        step_rows = [(s, t) for _, s, t in active]
        for step in range(max(reqs[i].max_draft for i, _, _ in active)):
            nxt = self._extend(step_rows)
            if nxt is None:  # the draft pool is full: propose what there is
                break
            still = []
            for (i, state, _), (s, _), tok in zip(active, step_rows, nxt):
                if tok >= self.vocab_size or len(drafts[i]) >= reqs[i].max_draft:
                    continue
                drafts[i].append(tok)
                if len(drafts[i]) < reqs[i].max_draft:
                    still.append(((i, state, []), (s, [tok])))
            if not still:
                break
            active = [a for a, _ in still]
            step_rows = [r for _, r in still]
        return drafts

    def on_verified(self, reqs: Sequence[DraftRequest], num_accepted: Sequence[int]) -> None:
        for req, kept in zip(reqs, num_accepted):
            state = self.states.get(req.rid)
            if state is None or state.length_at_propose == 0:
                continue
            # Right: the request's tokens before the step and the kept drafts.
            self._truncate(state, min(state.kv_len, state.length_at_propose + kept))
            state.length_at_propose = 0


def create(ctx: ProposerContext, options: dict[str, Any] | None = None) -> DraftModelProposer:
    from engine.model_executor.model_runner import ModelRunner

    args = ctx.server_args
    target = ctx.target_runner
    pool_tokens = target.max_total_num_tokens if target is not None else (args.max_total_tokens or 8192)
    draft_args = dataclasses.replace(
        args, model_path=ctx.draft_model_path, tokenizer_path=None, speculative_algorithm=None,
        disable_cuda_graph=True, max_total_tokens=pool_tokens, quant=None, context_length=args.context_length,
        max_running_requests=target.max_running_requests if target is not None else args.max_running_requests)
    runner = ModelRunner(draft_args, ctx.draft_model_path)
    if runner.vocab_size < ctx.vocab_size // 2:
        logger.warning("draft model vocabulary (%d) is much smaller than the target's (%d): same tokenizer?",
                       runner.vocab_size, ctx.vocab_size)
    logger.info("draft model %s: KV pool of %d tokens", ctx.draft_model_path, runner.max_total_num_tokens)
    return DraftModelProposer(runner, ctx.vocab_size)
