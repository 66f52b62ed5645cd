"""EAGLE proposing: a one-layer head drafts a chain, or an EAGLE-2 tree, on the target's hidden states.

The head's position ``i`` reads the target's feature at ``i`` and the token at ``i + 1`` and
predicts the token at ``i + 2``. Per request the proposer keeps a slot in its own KV pool
(``kv_len`` head positions from ``base`` on) and the target features it has not fed yet
(``pending``, positions up to ``hid_end - 1``). The core hands over the features of every
target forward at the positions whose KV it kept (``on_target_hidden``); a request of length
``L`` has them up to ``L - 2``.

A step (``propose``): one EXTEND catches each request's head up to position ``L - 2`` (its last
output is draft 0), then ``k - 1`` one-token steps feed each draft with the head's own output
feature. The drafts' head KV is freed at once (only positions with target features stay), so
verification needs no rollback here: the next features start where the accepted ones end.
With ``--speculative-eagle-topk`` > 1 the steps after the catch-up grow an EAGLE-2 tree instead
(``_grow_trees``, ``engine_spec_eagle.tree``), its node KV freed the same way.

A prefix-cache hit skips the cached prefix's target forward, so the head starts at the first
position it gets features for (``base``): it then attends only from there (drafts stay exact,
acceptance may drop on such requests).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from engine.speculative import DraftRequest, DraftTree, Proposer, ProposerContext, TargetHidden

logger = logging.getLogger(__name__)

#: A request absent from this many consecutive proposals (finished, or prefilling in chunks
#: while others decode) loses its head state.
_IDLE_PROPOSALS = 4


@dataclasses.dataclass
class _HeadState:
    slot: int
    base: int = 0  # absolute position of head position 0
    kv_len: int = 0  # head positions with KV (base .. base + kv_len - 1)
    pending: list[torch.Tensor] = dataclasses.field(default_factory=list)  # features from base + kv_len on
    hid_end: int = 0  # one past the last position with a feature
    seen: int = 0  # proposal count when last touched


class EagleProposer(Proposer):
    def __init__(self, head: Any, pools: Any, target_model: Any, vocab_size: int, layers: tuple[int, ...],
                 topk: int = 1, num_steps: int = 1, tree_rows: int = 0) -> None:
        """``topk`` > 1: EAGLE-2 trees of depth ``num_steps`` for up to ``tree_rows`` requests a
        step (each needs ``topk`` request slots of the head's pool for its frontier)."""
        self.head = head
        self.pools = pools
        self.embed = target_model.model.embed_tokens
        self.target_lm_head = target_model.lm_head.weight
        self.vocab_size = vocab_size
        self.target_hidden_layers = layers
        self.states: dict[str, _HeadState] = {}
        self.proposals = 0
        # Acceptance statistics of this proposer's drafts (the core keeps per-request ones too).
        self.proposed = 0
        self.accepted = 0
        self.topk = topk
        self.num_steps = num_steps
        slots = pools.req_to_token.alloc(tree_rows * topk) if topk > 1 else []
        assert slots is not None, "the head's request pool has no room for the tree frontier's slots"
        # Request slots of frontier nodes: node k of request j's frontier runs in row j * topk + k.
        self.tree_slots: list[int] = slots
        self._draftable: torch.Tensor | None = None

    # -- state -----------------------------------------------------------------------
    def _truncate(self, state: _HeadState, keep: int) -> None:
        """Frees head KV of head positions ``keep..kv_len``."""
        if keep < state.kv_len:
            row = self.pools.req_to_token.req_to_token[state.slot]
            self.pools.allocator.free(row[keep: state.kv_len].to(torch.int64))
            state.kv_len = keep

    def release(self, rid: str) -> None:
        state = self.states.pop(rid, None)
        if state is not None:
            self._truncate(state, 0)
            self.pools.req_to_token.free(state.slot)

    def on_target_hidden(self, states: Sequence[TargetHidden]) -> None:
        for item in states:
            state = self.states.get(item.rid)
            if state is None:
                slots = self.pools.req_to_token.alloc(1)
                if slots is None:
                    continue  # no head slot: this request gets no drafts
                state = self.states[item.rid] = _HeadState(slots[0], base=item.start, hid_end=item.start)
            state.seen = self.proposals
            fed_end = state.base + state.kv_len
            if item.start > state.hid_end or item.start < state.base:
                # A gap (a prefix-cache hit) or an earlier start than the head has: start over.
                self._truncate(state, 0)
                state.base, state.pending = item.start, []
            elif item.start < fed_end:
                self._truncate(state, item.start - state.base)  # recomputed: drop from there on
                state.pending = []
            elif item.start < state.hid_end:
                features = torch.cat(state.pending)[: item.start - fed_end]
                state.pending = [features] if features.numel() else []
            state.pending.append(item.hidden)
            state.hid_end = item.start + item.hidden.shape[0]

    # -- drafting ----------------------------------------------------------------------
    def _run(self, rows: list[tuple[_HeadState, list[int], torch.Tensor, int]]
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One head EXTEND: per row (state, tokens, features, first absolute position), appended
        after the state's KV. Returns the last position's features and logits (the head's
        vocabulary) per row (None when the head's pool is full)."""
        pools = self.pools
        prefix = [s.kv_len for s, _, _, _ in rows]
        seq = [s.kv_len + len(t) for s, t, _, _ in rows]
        loc = pools.allocator.alloc_extend(prefix, seq, [-1] * len(rows))
        if loc is None:
            return None
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        offset = 0
        for (state, tokens, _, first), p, s in zip(rows, prefix, seq):
            pools.req_to_token.write(state.slot, p, loc[offset: offset + s - p])
            offset += s - p
            ids.extend(tokens)
            positions.append(torch.arange(first, first + len(tokens), dtype=torch.int64))
            state.kv_len = s
        features = torch.cat([f for _, _, f, _ in rows]).to(pools.device)
        out, last_rows = self._head_forward(ids, [s.slot for s, _, _, _ in rows], seq, prefix, loc,
                                            torch.cat(positions), features)
        last = out[last_rows]
        return last, self.head.logits(last, self.target_lm_head, self.vocab_size)

    def _catch_up(self, rows: list[tuple[_HeadState, list[int], torch.Tensor, int]]
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``_run`` over the requests' pending target features; when the head's pool is full the
        features go back to ``pending`` (the next step feeds them), so head positions stay aligned."""
        result = self._run(rows)
        if result is None:
            for state, _, features, _ in rows:
                state.pending = [features]
        return result

    def _head_forward(self, ids: list[int], slots: list[int], seq: list[int], prefix: list[int], loc: torch.Tensor,
                      positions: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over rows whose ``req_to_token`` entries (prefix and ``loc``) are written:
        ``[n, H]`` output features, and the index of each row's last token."""
        from engine.model_executor.forward_batch import ForwardBatch, ForwardMode

        pools = self.pools
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, slots, seq, prefix, loc, pools.device,
                                num_extend_reqs=len(slots))
        fb.positions = positions.to(pools.device)  # absolute positions (RoPE)
        fb.req_to_token_pool, fb.token_to_kv_pool, fb.attn_backend = pools.req_to_token, pools.kv, pools.backend
        pools.backend.init_forward_metadata(fb)
        out = self.head(fb.input_ids, features, fb.positions, fb, self.embed)
        assert fb.extend_start_loc is not None and fb.extend_seq_lens is not None
        return out, fb.extend_start_loc + fb.extend_seq_lens - 1

    @torch.inference_mode()
    def propose(self, reqs: Sequence[DraftRequest]) -> list[list[int] | DraftTree]:
        self.proposals += 1
        live = {r.rid for r in reqs}
        for rid, state in list(self.states.items()):
            if rid in live:
                state.seen = self.proposals
            elif self.proposals - state.seen > _IDLE_PROPOSALS:
                self.release(rid)
        drafts: list[list[int]] = [[] for _ in reqs]
        active: list[tuple[int, _HeadState, int]] = []  # (request index, state, L)
        rows = []
        for i, req in enumerate(reqs):
            state = self.states.get(req.rid)
            if req.max_draft <= 0 or state is None or not state.pending:
                continue
            tokens = list(req.prompt_ids) + list(req.output_ids)
            length = len(tokens)
            if state.hid_end != length - 1:
                continue  # features missing (not expected): no drafts for this request
            first = state.base + state.kv_len
            features = torch.cat(state.pending)
            state.pending = []
            active.append((i, state, length))
            rows.append((state, tokens[first + 1: length], features, first))
        if not rows:
            return [*drafts]
        if self.topk > 1:
            out: list[list[int] | DraftTree] = [*drafts]
            for (i, _, _), tree in zip(active, self._grow_trees(reqs, active, rows)):
                out[i] = tree
                self.proposed += len(tree.tokens)
            self._truncate_drafts(reqs)
            return out
        result = self._catch_up(rows)
        while result is not None:
            features, logits = result
            ids_h = self.head.to_target_ids(torch.argmax(logits, dim=-1)).tolist()
            nxt_rows, nxt_active, keep = [], [], []
            for j, ((i, state, length), tok) in enumerate(zip(active, ids_h)):
                if not 0 <= tok < self.vocab_size:
                    continue
                drafts[i].append(tok)
                if len(drafts[i]) < reqs[i].max_draft:
                    keep.append(j)
                    nxt_active.append((i, state, length))
                    nxt_rows.append((state, [tok], None, length - 2 + len(drafts[i])))
            if not nxt_rows:
                break
            keep_t = torch.tensor(keep, dtype=torch.int64, device=features.device)
            chosen = features.index_select(0, keep_t)
            nxt_rows = [(s, t, chosen[k: k + 1], p) for k, (s, t, _, p) in enumerate(nxt_rows)]
            active = nxt_active
            result = self._run(nxt_rows)
        self._truncate_drafts(reqs)
        self.proposed += sum(len(d) for d in drafts)
        return [*drafts]

    def _truncate_drafts(self, reqs: Sequence[DraftRequest]) -> None:
        for _, state, length in self._all(reqs):
            self._truncate(state, max(0, length - 1 - state.base))  # keep only positions with target features

    def _draftable_bias(self, width: int, device: torch.device) -> torch.Tensor:
        """``[width]``: 0 where the head's token maps to a target id, ``-inf`` elsewhere."""
        if self._draftable is None or self._draftable.shape[0] != width:
            ids = self.head.to_target_ids(torch.arange(width, device=device))
            self._draftable = torch.where(ids < self.vocab_size, 0.0, float("-inf")).to(device)
        return self._draftable

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.float(), dim=-1) + self._draftable_bias(logits.shape[-1], logits.device)

    def _grow_trees(self, reqs: Sequence[DraftRequest], active: list[tuple[int, _HeadState, int]],
                    rows: list[tuple[_HeadState, list[int], torch.Tensor, int]]) -> list[DraftTree]:
        """EAGLE-2 trees for the ``active`` requests (``engine_spec_eagle.tree``).

        A frontier node of depth ``d`` runs at head position ``L - 2 + d`` in a request slot of
        its own (``tree_slots``) whose row is the request's head KV, then the KV of the node's
        ancestors (depths ``1 .. d - 1``), then its own: the one-token extend attends exactly to
        its path. Its input is its parent's output feature (the root's: the catch-up's last
        output) and its token. All node KV is freed before returning."""
        from engine_spec_eagle.tree import grow_draft_trees

        result = self._catch_up(rows)
        k = self.topk
        if result is None:
            return [DraftTree([], []) for _ in active]
        root_feature, root_logits = result
        pools = self.pools
        r2t = pools.req_to_token.req_to_token
        device = root_feature.device
        capacity = len(self.tree_slots) // k
        keep = [reqs[i].max_draft if j < capacity else 0 for j, (i, _, _) in enumerate(active)]
        n_rows = min(len(active), capacity)
        kv_lens = torch.tensor([s.kv_len for _, s, _ in active[:n_rows]], dtype=torch.int64, device=device)
        tree_slots = torch.tensor(self.tree_slots[: n_rows * k], dtype=torch.int64, device=device).view(n_rows, k)
        if n_rows:
            # Every frontier row of a request starts with the request's head KV.
            width = int(max(s.kv_len for _, s, _ in active[:n_rows]))
            own = torch.tensor([s.slot for _, s, _ in active[:n_rows]], dtype=torch.int64, device=device)
            r2t[tree_slots.flatten(), :width] = r2t[own.repeat_interleave(k), :width]
        hidden = root_feature.shape[-1]
        # The previous frontier, per request (full size; rows no longer expanded keep zeros).
        walk: dict[str, torch.Tensor] = {
            "feature": root_feature.unsqueeze(1),  # [A, K or 1, H] output features
            "path": torch.zeros((len(active), 1, 0), dtype=torch.int64, device=device),  # their ancestors' KV
            "loc": torch.zeros((len(active), 1), dtype=torch.int64, device=device),  # their own KV
        }
        node_locs: list[torch.Tensor] = []

        def expand(tokens: torch.Tensor, parents: torch.Tensor, depth: int, row_ids: list[int]) -> torch.Tensor | None:
            n = len(row_ids) * k
            loc = pools.allocator.alloc(n)
            if loc is None:
                return None
            loc = loc.to(device=device, dtype=torch.int64)
            node_locs.append(loc)
            at = torch.tensor(row_ids, dtype=torch.int64, device=device)
            features = walk["feature"].index_select(0, at).gather(1, parents.unsqueeze(-1).expand(-1, -1, hidden))
            path = walk["path"].index_select(0, at)
            path = path.gather(1, parents.unsqueeze(-1).expand(-1, -1, path.shape[-1]))
            if depth > 1:
                path = torch.cat([path, walk["loc"].index_select(0, at).gather(1, parents).unsqueeze(-1)], dim=-1)
            row_slots = tree_slots.index_select(0, at).flatten()
            prefix = kv_lens.index_select(0, at).repeat_interleave(k) + depth - 1
            cols = prefix.unsqueeze(1) - (depth - 1) + torch.arange(depth, device=device)
            r2t[row_slots.unsqueeze(1), cols] = torch.cat([path.flatten(0, 1), loc.unsqueeze(1)], dim=1).to(r2t.dtype)
            ids = self.head.to_target_ids(tokens.flatten())
            ids = torch.where(ids < self.vocab_size, ids, 0)  # unkept (-inf) nodes only
            prefix_h = [active[j][1].kv_len + depth - 1 for j in row_ids for _ in range(k)]
            positions = torch.tensor([active[j][2] - 2 + depth for j in row_ids for _ in range(k)], dtype=torch.int64)
            slots_h = [self.tree_slots[j * k + c] for j in row_ids for c in range(k)]  # = row_slots, on the host
            out, _ = self._head_forward(ids.tolist(), slots_h, [p + 1 for p in prefix_h], prefix_h, loc, positions,
                                        features.flatten(0, 1))
            logp = self._log_probs(self.head.logits(out, self.target_lm_head, self.vocab_size))
            full = torch.zeros((len(active), k, hidden), dtype=out.dtype, device=device)
            full[at] = out.view(-1, k, hidden)
            full_path = torch.zeros((len(active), k, path.shape[-1]), dtype=torch.int64, device=device)
            full_path[at] = path
            full_loc = torch.zeros((len(active), k), dtype=torch.int64, device=device)
            full_loc[at] = loc.view(-1, k)
            walk.update(feature=full, path=full_path, loc=full_loc)
            return logp.view(len(row_ids), k, -1)

        try:
            return grow_draft_trees(self._log_probs(root_logits), expand, k, self.num_steps, keep,
                                    to_ids=self.head.to_target_ids)
        finally:
            if node_locs:
                pools.allocator.free(torch.cat(node_locs))

    def _all(self, reqs: Sequence[DraftRequest]) -> list[tuple[int, _HeadState, int]]:
        out = []
        for i, req in enumerate(reqs):
            state = self.states.get(req.rid)
            if state is not None:
                out.append((i, state, len(req.prompt_ids) + len(req.output_ids)))
        return out

    def on_verified(self, reqs: Sequence[DraftRequest], num_accepted: Sequence[int]) -> None:
        # Nothing to roll back: draft KV (chain steps, tree nodes) is freed in ``propose``, and the
        # accepted tokens' head KV is recomputed from the target's features (``on_target_hidden``).
        self.accepted += sum(num_accepted)


@dataclasses.dataclass
class _HeadPools:
    """The head's own KV pool (one layer), request slots and attention backend."""

    req_to_token: Any
    kv: Any
    allocator: Any
    backend: Any
    device: Any


def _pools(head: Any, target: Any, tokens: int, max_reqs: int, context_len: int, tree_slots: int = 0) -> _HeadPools:
    from engine.attention import AttentionContext
    from engine.hookspecs import resolve_factory
    from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator

    attn = head.layer.self_attn
    device, dtype = target.device, target.dtype
    req_to_token = ReqToTokenPool(max_reqs + 1 + tree_slots, context_len + 8, device)
    kv = MHATokenToKVPool(tokens, 1, dtype, attn.num_kv_heads, attn.head_dim, 1, device)
    allocator = TokenToKVPoolAllocator(tokens, 1, device)
    chosen = target.selection.attention
    ctx = AttentionContext(device=device, dtype=dtype, num_layers=1, num_heads=attn.num_heads,
                           num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, page_size=1,
                           max_context_len=context_len, req_to_token_pool=req_to_token, token_to_kv_pool=kv,
                           options=dict(chosen.options))
    return _HeadPools(req_to_token, kv, allocator, resolve_factory(chosen.spec.factory)(ctx), device)


def create(ctx: ProposerContext, options: dict[str, Any] | None = None) -> EagleProposer:
    from engine_spec_eagle.head import aux_layer_ids, build_head

    target = ctx.target_runner
    if target is None:  # the conformance kit builds proposers alone: load the target for its weights
        from engine.model_executor.model_runner import ModelRunner

        args = dataclasses.replace(ctx.server_args, speculative_algorithm=None, disable_cuda_graph=True)
        target = ModelRunner(args, ctx.target_model_path)
    assert ctx.draft_model_path is not None
    head = build_head(ctx.draft_model_path, target.hf_config, target.dtype, target.device)
    layers = aux_layer_ids(head.config, target.num_layers) if head.eagle3 else ()
    # Trees: each request's frontier runs in ``topk`` request slots of the head's pool.
    tree_rows = int(getattr(ctx.server_args, "speculative_max_batch_size", 8) or 8) if ctx.eagle_topk > 1 else 0
    pools = _pools(head, target, target.max_total_num_tokens, target.max_running_requests, target.context_len,
                   tree_rows * ctx.eagle_topk)
    logger.info("EAGLE%s head %s: %s, KV pool of %d tokens, %s", "-3" if head.eagle3 else "-1/2",
                ctx.draft_model_path, f"target layers {list(layers)}" if layers else "the target's final hidden states",
                target.max_total_num_tokens,
                f"trees (top-k {ctx.eagle_topk}, depth {ctx.num_steps})" if ctx.eagle_topk > 1 else "chains")
    return EagleProposer(head, pools, target.model, ctx.vocab_size, layers, topk=ctx.eagle_topk,
                         num_steps=ctx.num_steps, tree_rows=tree_rows)
