"""The scheduler's speculative decode step: propose, verify in one extend forward, roll back.

One step for the running batch: the proposer drafts up to ``k`` tokens per request (none for
requests the verifier cannot reproduce exactly: those take the ordinary sampler's token at their
row, penalties, grammar mask and logprobs included); the target runs one EXTEND forward over ``[last token] + drafts`` of every row (KV slots are
allocated for all of them), replayed from a captured graph where one fits (every row padded to
``k + 1`` tokens, ``VerifyGraphRunner``) and eager otherwise; ``verify_rows`` picks the kept
drafts and the target's own next token on the device (one host sync per step); the requests
append those tokens one by one (so EOS, stop ids and ``max_new_tokens`` inside an accepted run
end the request at the right token); the KV slots of positions that were not kept go back to
the allocator.

Tree drafts (``DraftTree``) run the same step with a tree attention mask, eagerly
(``_tree_step``): every node gets a KV slot, nodes sit at position ``prefix + depth``; after
verification the accepted path's slots are written to ``req_to_token`` in path order and every
other node's slot is freed. On an attention backend without ``supports_tree_mask`` each tree is
cut to its longest root-to-leaf chain.

KV invariant (the same as plain decode): before and after a step, a running request has KV
for every position but its last token's (``seqlen - 1``). The step writes KV for positions
``seqlen - 1 .. seqlen - 1 + len(drafts)``; after appending ``m`` tokens the request needs
the first ``m`` of them and the rest are freed.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import engine.distributed as distributed
from engine.hookspecs import call_with_accepted
from engine.managers.logprobs import record_output_logprobs
from engine.model_executor.forward_batch import ForwardBatch, ForwardMode
from engine.speculative.base import DraftRequest, DraftTree, ProposerContext, ReleaseReason, RequestEnd, TargetHidden
from engine.speculative.tree import (
    depths,
    is_chain,
    longest_chain,
    row_parents,
    row_tokens,
    tree_mask_of_rows,
    truncate,
)
from engine.speculative.verify import draft_tensor, pad_positions, verify_rows, verify_tree

if TYPE_CHECKING:
    from engine.managers.schedule_batch import Req, ScheduleBatch
    from engine.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Counters for /get_server_info and /metrics."""

    verify_steps: int = 0  # speculative forward passes
    verified_rows: int = 0  # request rows in them
    proposed_tokens: int = 0
    accepted_tokens: int = 0  # drafts kept
    emitted_tokens: int = 0  # drafts kept + the target's own token per row
    fallback_steps: int = 0  # decode steps run without speculation (batch too large, ...)
    tree_steps: int = 0  # verify steps with at least one tree draft (eager, tree attention mask)

    def mean_accept_length(self) -> float:
        """Tokens appended per request and verify step (1.0 = no speedup)."""
        return self.emitted_tokens / self.verified_rows if self.verified_rows else 0.0


def _num_tokens(draft: list[int] | DraftTree) -> int:
    """Draft tokens of a chain or a tree."""
    return len(draft.tokens) if isinstance(draft, DraftTree) else len(draft)


def num_draft_tokens_of(args: Any) -> int:
    """Tokens verified per request and step: ``--speculative-num-draft-tokens``, else
    ``--speculative-num-steps + 1`` (a chain of ``num_steps`` drafts after the last token)."""
    return args.speculative_num_draft_tokens or args.speculative_num_steps + 1


class Speculator:
    """Runs speculative decode steps for a ``Scheduler`` (its pools, cache and runner)."""

    def __init__(self, scheduler: Any) -> None:
        import engine.plugins as plugins

        args = scheduler.args
        self.scheduler = scheduler
        self.algorithm = args.speculative_algorithm
        self.num_draft_tokens = num_draft_tokens_of(args)
        self.max_draft = self.num_draft_tokens - 1
        self.max_batch_size = args.speculative_max_batch_size
        self.tp_size = scheduler.runner.placement.tp_size
        runner = scheduler.runner
        ctx = ProposerContext(
            num_steps=args.speculative_num_steps, num_draft_tokens=self.num_draft_tokens,
            eagle_topk=args.speculative_eagle_topk, vocab_size=runner.vocab_size, device=runner.device,
            target_model_path=args.model_path, draft_model_path=args.speculative_draft_model_path,
            server_args=args, target_runner=runner)
        self.proposer = plugins.create_proposer(self.algorithm, ctx, args.disable_plugin, args.plugin_options)
        # A proposer that reads the target's hidden states (EAGLE) gets them after every forward.
        self.wants_hidden = plugins.get_speculative_algorithm(self.algorithm, args.disable_plugin).needs_hidden_states
        if self.wants_hidden:
            runner.capture_hidden = tuple(self.proposer.target_hidden_layers)
        self.stats = SpecStats()
        self.verify_trees = self._can_verify_trees(runner)
        self.verify_graphs = self._capture_verify_graphs(args, runner)
        logger.info("speculative decoding: %s, up to %d draft tokens per request and step, up to batch size %d",
                    self.algorithm, self.max_draft, self.max_batch_size)

    @staticmethod
    def _can_verify_trees(runner: Any) -> bool:
        """Whether tree drafts are verified as trees: the attention backend has a tree mask
        (``supports_tree_mask``) and no layer has a sliding window (the triton and flashinfer
        masks compare KV indices, not a node's depth). Otherwise trees are cut to chains."""
        from engine.layers.radix_attention import RadixAttention

        backend = runner.attn_backend
        if not getattr(backend, "supports_tree_mask", False):
            logger.info("speculative tree drafts are verified as chains (their longest branch): attention backend "
                        "'%s' has no tree mask", runner.attention_backend_name)
            return False
        model = getattr(runner, "model", None)
        windowed = model is not None and any(
            isinstance(m, RadixAttention) and m.sliding_window_size > 0 for m in model.modules())
        if windowed:
            logger.info("speculative tree drafts are verified as chains (their longest branch): the model has "
                        "sliding-window attention layers")
        return not windowed

    def _capture_verify_graphs(self, args: Any, runner: Any) -> Any:
        """Device graphs for verify steps (every row runs ``num_draft_tokens`` tokens), one per
        batch-size bucket up to ``--speculative-max-batch-size``, where decode steps are captured
        and the attention backend has a verify mode; else None (verify steps run eagerly)."""
        decode_graphs = runner.cuda_graph_runner
        if decode_graphs is None:
            return None  # --disable-cuda-graph, a platform without graphs, pipeline parallelism
        backend = runner.attn_backend
        if not getattr(backend, "supports_verify_cuda_graph", False):
            logger.info("speculative verify steps run eagerly: attention backend '%s' has no verify graph mode",
                        runner.attention_backend_name)
            return None
        from engine.model_executor.cuda_graph_runner import VerifyGraphRunner

        return VerifyGraphRunner(runner, self.num_draft_tokens, min(self.max_batch_size, args.cuda_graph_max_bs),
                                 pool=decode_graphs.pool)

    # -- request ends ----------------------------------------------------------------
    def request_ended(self, req: Req) -> None:
        """Tells the proposer that ``req`` ended (finished or aborted): ``on_request_end`` with
        its prompt and output, then ``release``. The scheduler calls this once per request,
        where a finished request leaves it (``_emit``), whichever step ended it."""
        fr = req.finished_reason
        reason: ReleaseReason = "aborted" if fr is not None and fr.kind == "abort" else "finished"
        self.proposer.on_request_end(RequestEnd(
            req.rid, req.origin_input_ids, list(req.output_ids), reason,
            fr.to_json() if fr is not None else None))
        self._release(req.rid, reason)

    def request_retracted(self, req: Req) -> None:
        """``req`` was retracted (KV memory, priority preemption): the proposer drops its state;
        the request later resumes under the same id."""
        self._release(req.rid, "retracted")

    def _release(self, rid: str, reason: ReleaseReason) -> None:
        # A proposer written before the reason existed takes ``release(rid)``: hooks only gain
        # arguments, and an implementation may accept fewer.
        call_with_accepted(self.proposer.release, rid, reason=reason)

    # -- eligibility -------------------------------------------------------------
    @staticmethod
    def row_can_draft(req: Req) -> bool:
        """Whether the chain verifier reproduces this request's sampling exactly. Rows that
        cannot (penalties, an unmet min_new_tokens, a grammar, logprobs, a per-request seed)
        get no drafts: they take one token per step from the ordinary sampler, in the same
        forward as the others' verification."""
        p = req.sampling_params
        return (req.grammar is None and not req.return_logprob and p.seed is None
                and p.frequency_penalty == 0 and p.presence_penalty == 0 and p.repetition_penalty == 1
                and len(req.output_ids) >= p.min_new_tokens)

    def _draft_budget(self, req: Req) -> int:
        """Drafts worth proposing: none past max_new_tokens or the context length."""
        if not self.row_can_draft(req):
            return 0
        sched = self.scheduler
        left = req.sampling_params.max_new_tokens - len(req.output_ids) - 1
        room = sched.context_len - req.seqlen - 1
        return max(0, min(self.max_draft, left, room))

    # -- the step ----------------------------------------------------------------------
    def may_speculate(self, batch: ScheduleBatch) -> bool:
        """Whether ``try_step`` may verify drafts for ``batch`` (its size is within
        --speculative-max-batch-size); False: every step of it decodes plainly, and may overlap."""
        return 0 < len(batch.reqs) <= self.max_batch_size

    def try_step(self, batch: ScheduleBatch, info: SamplingBatchInfo) -> list[Req] | None:
        """One speculative decode step of ``batch``; returns its rows (to emit), or None when
        the step should decode plainly (batch above --speculative-max-batch-size, or no draft
        at all this step: a plain decode step is cheaper, and may replay a CUDA graph)."""
        sched = self.scheduler
        reqs = list(batch.reqs)
        if not self.may_speculate(batch):
            self.stats.fallback_steps += 1
            return None
        views = [DraftRequest(r.rid, r.origin_input_ids, r.output_ids, self._draft_budget(r)) for r in reqs]
        drafts = self._checked(self.proposer.propose(views), views, sched.runner.vocab_size)
        if self.tp_size > 1:
            # Tensor-parallel ranks must run the same step: rank 0's drafts decide.
            drafts = distributed.broadcast_objects(drafts, src=0)
        if not self.verify_trees:
            # No tree attention mask here: verify each tree's longest branch as a chain.
            drafts = [longest_chain(d) if isinstance(d, DraftTree) else d for d in drafts]
        # The decode-memory check guaranteed one slot per row; drafts take what else is free.
        spare = sched.allocator.available_size() + sched.tree_cache.evictable_size() - len(reqs)
        for i, d in enumerate(drafts):
            size = _num_tokens(d)
            if size > spare:
                keep = max(spare, 0)
                drafts[i] = d = truncate(d, keep) if isinstance(d, DraftTree) else d[:keep]
                size = keep
            spare -= size
        if not any(_num_tokens(d) for d in drafts):
            self.proposer.on_verified(views, [0] * len(reqs))
            self.stats.fallback_steps += 1
            return None
        info.steps = [len(r.output_ids) for r in reqs]
        if any(isinstance(d, DraftTree) for d in drafts):
            return self._tree_step(reqs, views, drafts, info)
        chains: list[list[int]] = [d for d in drafts if not isinstance(d, DraftTree)]
        return self._chain_step(reqs, views, chains, info)

    def _chain_step(self, reqs: list[Req], views: list[DraftRequest], drafts: list[list[int]],
                    info: SamplingBatchInfo) -> list[Req]:
        """A verify step whose drafts are all chains: one extend (or a verify graph replay)."""
        sched = self.scheduler
        prefix_lens = [r.seqlen - 1 for r in reqs]
        seq_lens = [r.seqlen + len(d) for r, d in zip(reqs, drafts)]
        out_cache_loc = self._alloc_slots(sum(seq_lens) - sum(prefix_lens))
        pool = sched.req_to_token_pool
        rows = [[r.output_ids[-1], *d] for r, d in zip(reqs, drafts)]
        graphs = self.verify_graphs
        if graphs is not None and graphs.can_run(len(reqs), max(prefix_lens)):
            # Captured: every row runs num_draft_tokens tokens; logits row-major [rows, T].
            out, fb = graphs.replay([r.req_pool_idx for r in reqs], prefix_lens, rows, out_cache_loc)
            fb.sampling_info = info
            width = graphs.tokens_per_row
            assert out.full_logits is not None
            logits3 = out.full_logits[: len(reqs) * width].view(len(reqs), width, -1)
        else:
            input_ids: list[int] = []
            offset = 0
            for req, p, row in zip(reqs, prefix_lens, rows):
                pool.write(req.req_pool_idx, p, out_cache_loc[offset: offset + len(row)])
                offset += len(row)
                input_ids.extend(row)
            fb = ForwardBatch.build(ForwardMode.EXTEND, input_ids, [r.req_pool_idx for r in reqs], seq_lens,
                                    prefix_lens, out_cache_loc, sched.device, num_extend_reqs=len(reqs),
                                    return_logprob=True)  # logits at every position
            fb.sampling_info = info
            out = sched.runner.forward(fb)
            width = max(len(row) for row in rows)
            full = out.full_logits
            assert full is not None
            idx = torch.tensor(pad_positions([len(row) for row in rows], width), dtype=torch.int64)
            logits3 = full.index_select(0, idx.to(full.device, non_blocking=True)).view(len(reqs), width, -1)
        appended, sample = self._decide(reqs, drafts, out, fb, info, logits3)
        kept_counts = []
        row_of = pool.req_to_token
        unused_slots = []
        for i, (req, d, tokens, p) in enumerate(zip(reqs, drafts, appended, prefix_lens)):
            n = 0
            for tok in tokens:
                req.append_output(tok)
                n += 1
                if sample is not None and not d:
                    record_output_logprobs(req, i, sample)
                req.check_finished()
                if req.finished():
                    break
            kept_counts.append(min(n, len(tokens) - 1))
            # Written: positions p .. p + len(d); needed: the first n (the new last token has none).
            if n < len(d) + 1:
                unused_slots.append(row_of[req.req_pool_idx, p + n: p + len(d) + 1])
            self._count_row(req, len(d), n)
        if unused_slots:
            # One free for the step (the caches only read the kept positions of each row).
            sched.allocator.free(torch.cat(unused_slots).to(torch.int64))
        # Kept positions: the last token and the kept drafts (finished rows are released).
        self.hand_hidden_states(reqs, fb, out, prefix_lens, [k + 1 for k in kept_counts])
        self.stats.verify_steps += 1
        self.proposer.on_verified(views, kept_counts)
        return reqs

    def _tree_step(self, reqs: list[Req], views: list[DraftRequest], drafts: list[list[int] | DraftTree],
                   info: SamplingBatchInfo) -> list[Req]:
        """A verify step with at least one tree, run eagerly with a tree attention mask.

        Row i runs its nodes (``engine.speculative.tree``: the last token, then the draft's
        nodes; a chain is a tree too) at KV indices ``prefix .. prefix + n - 1`` in node order
        and positions ``prefix + depth``, each attending to the prefix and its ancestors.
        ``verify_tree`` picks the path; its slots are then written to ``req_to_token`` at
        ``prefix ..`` in path order (no KV copy: page size 1), and every other node's slot is
        freed once the request has appended its tokens.
        """
        sched = self.scheduler
        pool = sched.req_to_token_pool
        prefix_lens = [r.seqlen - 1 for r in reqs]
        parents = [row_parents(d) for d in drafts]
        rows = [row_tokens(r.output_ids[-1], d) for r, d in zip(reqs, drafts)]
        lens = [len(row) for row in rows]
        out_cache_loc = self._alloc_slots(sum(lens))
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        for req, p, lo, hi in zip(reqs, prefix_lens, offsets, offsets[1:]):
            pool.write(req.req_pool_idx, p, out_cache_loc[lo:hi])
        fb = ForwardBatch.build(ForwardMode.EXTEND, [t for row in rows for t in row], [r.req_pool_idx for r in reqs],
                                [p + n for p, n in zip(prefix_lens, lens)], prefix_lens, out_cache_loc, sched.device,
                                num_extend_reqs=len(reqs), return_logprob=True)  # logits at every node
        positions = [p + d for p, par in zip(prefix_lens, parents) for d in depths(par)]
        fb.positions = torch.tensor(positions, dtype=torch.int64).to(sched.device, non_blocking=True)
        fb.tree_mask, fb.tree_mask_indptr = tree_mask_of_rows(parents, sched.device)
        fb.sampling_info = info
        out = sched.runner.forward(fb)
        assert out.full_logits is not None
        plain = [i for i, d in enumerate(drafts) if not _num_tokens(d)]
        sample, plain_info = self._sample_plain_rows(reqs, plain, out, fb, info)
        verdicts = verify_tree(out.full_logits[: offsets[-1]], list(zip(rows, parents)), plain_info)
        paths = [path for path, _ in verdicts]
        appended = [[row[j] for j in path[1:]] + [tok] for row, (path, tok) in zip(rows, verdicts)]
        if sample is not None:
            sampled = sample.next_token_ids.tolist()
            for i in plain:
                appended[i], paths[i] = [sampled[i]], [0]
        if self.tp_size > 1:
            appended, paths = distributed.broadcast_objects((appended, paths), src=0)
        kept_counts, picks, unused_slots = [], [], []
        for i, (req, d, tokens, p, path) in enumerate(zip(reqs, drafts, appended, prefix_lens, paths)):
            row_slots = out_cache_loc[offsets[i]: offsets[i + 1]]
            # The accepted path's KV, in order, at the positions its tokens now hold.
            pool.write(req.req_pool_idx, p, row_slots[torch.tensor(path, dtype=torch.int64).to(row_slots.device)])
            n = 0
            for tok in tokens:
                req.append_output(tok)
                n += 1
                if sample is not None and i in plain:
                    record_output_logprobs(req, i, sample)
                req.check_finished()
                if req.finished():
                    break
            kept_counts.append(min(n, len(tokens) - 1))
            kept_nodes = set(path[:n])
            dropped = [j for j in range(lens[i]) if j not in kept_nodes]
            if dropped:
                unused_slots.append(row_slots[torch.tensor(dropped, dtype=torch.int64).to(row_slots.device)])
            picks.append([offsets[i] + j for j in path[:n]])
            self._count_row(req, _num_tokens(d), n)
        if unused_slots:
            sched.allocator.free(torch.cat(unused_slots).to(torch.int64))
        self.hand_hidden_states(reqs, fb, out, prefix_lens, picks=picks)
        self.stats.verify_steps += 1
        self.stats.tree_steps += 1
        self.proposer.on_verified(views, kept_counts)
        return reqs

    def _count_row(self, req: Req, drafted: int, appended: int) -> None:
        """After a verify step appended ``appended`` tokens to ``req`` (``drafted`` drafts
        proposed): the request's and the server's acceptance counters, and a finished request
        cached."""
        if drafted:
            req.spec_verify_ct += 1
            req.spec_accepted_tokens += appended - 1
            st = self.stats
            st.verified_rows += 1
            st.proposed_tokens += drafted
            st.accepted_tokens += appended - 1
            st.emitted_tokens += appended
        if req.finished():
            # The proposer hears of the end when the request is emitted (``request_ended``).
            self.scheduler.tree_cache.cache_finished_req(req)

    def _sample_plain_rows(self, reqs: list[Req], plain: list[int], out: Any, fb: ForwardBatch,
                           info: SamplingBatchInfo) -> tuple[Any, SamplingBatchInfo]:
        """The ordinary sampler's step when some rows (``plain``) have no drafts: it sees every
        row's last-position logits (penalties, grammar mask, logprobs, seeds); only those rows
        keep its token (the drafting rows have no penalty state). Returns that sample (None
        without plain rows) and the sampling view the verifier reads: temperatures, top-k/p,
        min-p and logit_bias only."""
        sample = None
        if plain:
            sched = self.scheduler
            sched.grammar_queue.set_mask(info, reqs)
            sample = sched.runner.sample(out, fb)
            if info.penalizer is not None:
                info.penalizer.cumulate_output_tokens(sample.next_token_ids)
        return sample, dataclasses.replace(info, penalizer=None, vocab_mask=None, apply_vocab_mask=None)

    def _decide(self, reqs: list[Req], drafts: list[list[int]], out: Any, fb: ForwardBatch,
                info: SamplingBatchInfo, logits3: torch.Tensor) -> tuple[list[list[int]], Any]:
        """The tokens each row appends: verified chains for rows with drafts, the ordinary
        sampler (penalties, grammar mask, logprobs, seeds) at the last position for the rest.

        ``logits3``: ``[rows, T, vocab]``, each row's logits at its last token and its drafts
        (padded past them). Verification runs on the device for every row (a row without
        drafts keeps none); the kept counts, the target's tokens and the sampler's ids come to
        the host in one copy, the step's only sync.
        """
        plain = [i for i, d in enumerate(drafts) if not d]
        sample, plain_info = self._sample_plain_rows(reqs, plain, out, fb, info)
        width = logits3.shape[1]
        kept, final = verify_rows(logits3, draft_tensor(drafts, width - 1, logits3.device), plain_info)
        parts = [kept, final] + ([sample.next_token_ids.to(kept.dtype)] if sample is not None else [])
        host = torch.stack(parts).tolist()  # the one host sync of the step
        kept_h, final_h = host[0], host[1]
        appended = [list(d[:a]) + [t] for d, a, t in zip(drafts, kept_h, final_h)]
        for i in plain:
            appended[i] = [host[2][i]]
        if self.tp_size > 1:
            # Acceptance is not trusted to be bit-identical on every rank (as sampling is not).
            appended = distributed.broadcast_objects(appended, src=0)
        return appended, sample

    def _alloc_slots(self, need: int) -> torch.Tensor:
        """KV slots for a verify step (page size 1: speculation refuses larger pages), taken
        straight from the allocator's free list. ``ScheduleBatch._alloc_tokens`` would sort the
        whole free list first whenever a batch has more new tokens than rows (prefill's rule,
        for contiguous slots), which every verify step has: on a large pool that is a sort of
        millions of ids per step for nothing."""
        sched = self.scheduler
        allocator = sched.allocator
        if allocator.available_size() < need:
            sched.tree_cache.evict(need - allocator.available_size())
        out = allocator.alloc(need)
        if out is None:
            from engine.managers.schedule_batch import OutOfKVMemory

            raise OutOfKVMemory(f"cannot allocate {need} KV slots")
        return out

    @staticmethod
    def _checked(drafts: Any, views: list[DraftRequest], vocab_size: int) -> list[list[int] | DraftTree]:
        """The proposer's drafts, checked: one chain or tree per request, within budget (a
        tree keeps its first ``max_draft`` nodes) and vocabulary, trees with valid parent links.
        A tree that is a chain comes back as a list (it may then replay a verify graph)."""
        if not isinstance(drafts, (list, tuple)) or len(drafts) != len(views):
            raise RuntimeError(f"speculative proposer returned {type(drafts).__name__} of "
                               f"{len(drafts) if hasattr(drafts, '__len__') else '?'} drafts for {len(views)} requests")
        out: list[list[int] | DraftTree] = []
        for view, d in zip(views, drafts):
            tree = None
            if isinstance(d, DraftTree):
                if len(d.tokens) != len(d.parents):
                    raise RuntimeError(f"speculative proposer returned a draft tree of {len(d.tokens)} tokens and "
                                       f"{len(d.parents)} parents for request {view.rid}; accepted: one parent a token")
                tree = DraftTree([int(t) for t in d.tokens][: view.max_draft],
                                 [int(p) for p in d.parents][: view.max_draft])
                bad_parent = next(((i, p) for i, p in enumerate(tree.parents) if not -1 <= p < i), None)
                if bad_parent is not None:
                    i, p = bad_parent
                    raise RuntimeError(f"speculative proposer returned a draft tree whose node {i} has parent {p} for "
                                       f"request {view.rid}; accepted: -1 (the last token) or a node before it "
                                       f"(0..{i - 1}: parents come before their children)")
                tokens = tree.tokens
            else:
                tokens = [int(t) for t in d][: view.max_draft]
            bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise RuntimeError(f"speculative proposer drafted token id {bad} outside the vocabulary "
                                   f"(0..{vocab_size - 1}) for request {view.rid}")
            out.append(tokens if tree is None or is_chain(tree) else tree)
        return out

    def hand_hidden_states(self, reqs: list[Req], fb: ForwardBatch, out: Any, starts: list[int] | None = None,
                           counts: list[int] | None = None, picks: list[list[int]] | None = None) -> None:
        """Gives the proposer the target's hidden states of a forward (``out.hidden_states``) at the
        positions whose KV is kept, per unfinished request (a no-op unless the proposer reads them).

        Rows of ``out.hidden_states`` follow ``fb``'s rows (``fb.extend_seq_lens_cpu`` tokens each,
        padded ones included; decode: one each). ``starts``/``counts``: each request's first
        position and how many states to keep (default: all the forward computed). ``picks``
        (tree steps): per request, the rows of ``out.hidden_states`` to hand over, in position
        order (the accepted path's nodes), from ``starts[i]`` on; ``counts`` is then unused.
        """
        hidden = getattr(out, "hidden_states", None)
        if not self.wants_hidden or hidden is None:
            return
        n = len(reqs)
        if fb.forward_mode.is_decode():
            lens = [1] * n
            starts = starts if starts is not None else [s - 1 for s in fb.seq_lens_cpu[:n]]
        else:
            assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
            lens = list(fb.extend_seq_lens_cpu[:n])
            starts = starts if starts is not None else list(fb.extend_prefix_lens_cpu[:n])
        if picks is not None:
            states = [TargetHidden(req.rid, start, hidden[torch.tensor(rows, dtype=torch.int64).to(hidden.device)])
                      for req, start, rows in zip(reqs, starts, picks) if not req.finished() and rows]
            if states:
                self.proposer.on_target_hidden(states)
            return
        counts = counts if counts is not None else lens
        states, offset = [], 0
        for req, start, length, count in zip(reqs, starts, lens, counts):
            if not req.finished() and count > 0:
                states.append(TargetHidden(req.rid, start, hidden[offset: offset + min(count, length)]))
            offset += length
        if states:
            self.proposer.on_target_hidden(states)
