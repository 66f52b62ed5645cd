"""Output emission and introspection of the scheduler. Mixed into ``Scheduler``."""

from __future__ import annotations

from typing import Any

from engine.managers.io_struct import BatchTokenIDOut
from engine.managers.schedule_batch import Req
from engine.managers.stop_strings import prompt_tail


class OutputMixin:
    """Queues new tokens for the detokenizer; reports pool and queue state."""

    # Provided by Scheduler.
    args: Any
    runner: Any
    allocator: Any
    tree_cache: Any
    req_to_token_pool: Any
    outbox: list[BatchTokenIDOut]
    reqs: dict[str, Req]
    grammar_queue: Any

    # -- output ---------------------------------------------------------------------
    def _emit(self, reqs: list[Req]) -> None:
        """Queues new tokens of ``reqs`` for the detokenizer (streaming ones every interval)."""
        pooled = [r for r in reqs if r.pool_state is not None]
        if pooled:  # pooling requests end with a vector, not tokens (``PoolingMixin``)
            self._emit_pooled(pooled)  # type: ignore[attr-defined]
            reqs = [r for r in reqs if r.pool_state is None]
        send = [r for r in reqs if r.finished() or (
            r.stream and len(r.output_ids) - r.send_offset >= self.args.stream_interval)]
        if not send:
            return
        out = BatchTokenIDOut(
            rids=[], new_token_ids=[], finished_reasons=[], prompt_tokens=[], completion_tokens=[],
            cached_tokens=[], skip_special_tokens=[], spaces_between_special_tokens=[],
            stop_strings=[], no_stop_trim=[], output_token_logprobs=[], output_top_logprobs=[],
            input_token_logprobs=[], input_top_logprobs=[], prompt_tail_ids=[])
        if getattr(self, "speculator", None) is not None:
            out.spec_verify_ct = [r.spec_verify_ct for r in send]
            out.spec_accepted_tokens = [r.spec_accepted_tokens for r in send]
        for req in send:
            p = req.sampling_params
            start = req.send_offset
            out.rids.append(req.rid)
            out.new_token_ids.append(req.output_ids[start:])
            out.prompt_tail_ids.append(prompt_tail(req.origin_input_ids) if start == 0 else None)
            out.finished_reasons.append(req.finished_reason.to_json() if req.finished_reason else None)
            out.prompt_tokens.append(len(req.origin_input_ids))
            out.completion_tokens.append(len(req.output_ids))
            out.cached_tokens.append(req.cached_tokens)
            out.skip_special_tokens.append(p.skip_special_tokens)
            out.spaces_between_special_tokens.append(p.spaces_between_special_tokens)
            out.stop_strings.append(p.stop)
            out.no_stop_trim.append(p.no_stop_trim)
            if req.return_logprob:
                out.output_token_logprobs.append(req.output_token_logprobs[start:])
                out.output_top_logprobs.append(req.output_top_logprobs[start:])
                if not req.input_logprobs_sent and req.input_token_logprobs is not None and not req.is_chunked:
                    out.input_token_logprobs.append(req.input_token_logprobs)
                    out.input_top_logprobs.append(req.input_top_logprobs)
                    req.input_logprobs_sent = True
                else:
                    out.input_token_logprobs.append(None)
                    out.input_top_logprobs.append(None)
            else:
                out.output_token_logprobs.append(None)
                out.output_top_logprobs.append(None)
                out.input_token_logprobs.append(None)
                out.input_top_logprobs.append(None)
            req.send_offset = len(req.output_ids)
            if req.finished_reason is not None:
                out.stages = out.stages or [None] * (len(out.rids) - 1)
                out.stages.append(list(req.stages))
            elif out.stages is not None:
                out.stages.append(None)
            if req.finished_reason is not None and self.reqs.pop(req.rid, None) is not None:
                # Every end (finish in a prefill, decode or verify step, abort, refusal) passes
                # here exactly once: the proposer learns of it here.
                spec = getattr(self, "speculator", None)
                if spec is not None:
                    spec.request_ended(req)
        self.outbox.append(out)

    # -- introspection ----------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Empties the prefix cache; refused while requests are running."""
        if self.has_work():
            return False
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        mm_cache = getattr(self.runner, "mm_cache", None)
        if mm_cache is not None:  # image embeddings are cached prefixes too
            mm_cache.clear()
        return True

    def stats(self) -> dict[str, Any]:
        total = self.runner.max_total_num_tokens
        free = self.allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        return {
            "max_total_num_tokens": total,
            "kv_free_tokens": free,
            "kv_evictable_tokens": evictable,
            "kv_used_tokens": total - free - evictable,
            "kv_usage": (total - free - evictable) / total,
            "num_running_reqs": len(self.running_batch.reqs) + (1 if self.chunked_req else 0),
            "num_waiting_reqs": len(self.waiting_queue),
            "num_retractions": self.num_retractions,
            "forward_steps": self.forward_steps,
            "decode_steps": self.decode_steps,
            "overlapped_decode_steps": self.overlapped_decode_steps,
            "overlap_schedule": self.enable_overlap,
            "cuda_graph_batch_sizes": list(getattr(self.runner.cuda_graph_runner, "batch_sizes", None) or []),
            "device_description": self.runner.platform.describe(),  # what result rows name the device by
            "graph_decode_steps": getattr(self.runner.cuda_graph_runner, "replays", 0),
            "decode_rows": self.decode_rows,
            "extend_tokens": self.extend_tokens,
            "extend_time_s": self.extend_time_s,
            "decode_time_s": self.decode_time_s,
            # Structured output: requests waiting for their grammar, compiles started, cache hits.
            "num_grammar_queue_reqs": len(self.grammar_queue.waiting),
            "grammar_compiles": self.grammar_queue.compiler.compiles,
            "grammar_cache_hits": self.grammar_queue.compiler.hits,
            **self._spec_stats(),
            **self._mm_stats(),
            **self._lora_stats(),
            **self._disagg_stats(),  # type: ignore[attr-defined]
            **self.tree_cache.stats(),
        }

    def _mm_stats(self) -> dict[str, Any]:
        """Vision-language models: the item-embedding cache's bytes, items embedded, cache hits."""
        if not getattr(self.runner, "multimodal", False):
            return {}
        cache = self.runner.mm_cache
        return {"mm_embedding_cache_bytes": cache.bytes, "mm_items_embedded": cache.computed,
                "mm_embedding_cache_hits": cache.hits}

    def _spec_stats(self) -> dict[str, Any]:
        """Speculative decoding counters (none when it is off)."""
        spec = getattr(self, "speculator", None)
        if spec is None:
            return {}
        st = spec.stats
        return {"spec_algorithm": spec.algorithm, "spec_verify_steps": st.verify_steps,
                "spec_proposed_tokens": st.proposed_tokens, "spec_accepted_tokens": st.accepted_tokens,
                "spec_fallback_steps": st.fallback_steps, "spec_tree_steps": st.tree_steps,
                "spec_verified_rows": st.verified_rows,
                "spec_emitted_tokens": st.emitted_tokens, "spec_mean_accept_length": st.mean_accept_length()}
