"""The detokenizer: token ids -> text, incrementally per request, with stop strings.

Runs as its own process (``detokenizer_process``) between the scheduler and the
tokenizer manager; ``DetokenizerManager.handle`` is the pure part tests call.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from engine.managers.incremental_detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.managers.io_struct import BatchStrOut, BatchTokenIDOut, ControlReq

logger = logging.getLogger(__name__)

# Finished rids remembered so late scheduler messages for them are dropped.
_FINISHED_MEMORY = 4096


@dataclass
class _DecodeState:
    detok: IncrementalDetokenizer | None
    matcher: StopStringMatcher | None
    # Characters of detok.output_text already sent.
    sent: int = 0


class DetokenizerManager:
    def __init__(self, tokenizer: Any | None) -> None:
        # None with --skip-tokenizer-init: only ids flow through.
        self.tokenizer = tokenizer
        self.states: dict[str, _DecodeState] = {}
        self.finished: dict[str, None] = {}

    def handle(self, msg: BatchTokenIDOut) -> BatchStrOut:
        out = BatchStrOut(rids=[], new_texts=[], new_token_ids=[], finished_reasons=[],
                          prompt_tokens=[], completion_tokens=[], cached_tokens=[],
                          output_token_logprobs=[], output_top_logprobs=[],
                          input_token_logprobs=[], input_top_logprobs=[])
        for i, rid in enumerate(msg.rids):
            if rid in self.finished:
                continue  # already ended by a stop string
            state = self.states.get(rid)
            if state is None:
                state = self._new_state(msg, i)
                self.states[rid] = state
            reason = msg.finished_reasons[i]
            text, reason = self._advance(state, msg.new_token_ids[i], reason)
            out.rids.append(rid)
            out.new_texts.append(text)
            out.new_token_ids.append(msg.new_token_ids[i])
            out.finished_reasons.append(reason)
            out.prompt_tokens.append(msg.prompt_tokens[i])
            out.completion_tokens.append(msg.completion_tokens[i])
            out.cached_tokens.append(msg.cached_tokens[i])
            for name in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"):
                src = getattr(msg, name)
                getattr(out, name).append(src[i] if src else None)
            if msg.spec_verify_ct is not None:
                out.spec_verify_ct = (out.spec_verify_ct or []) + [msg.spec_verify_ct[i]]
                out.spec_accepted_tokens = (out.spec_accepted_tokens or []) + [msg.spec_accepted_tokens[i]]
            if msg.stages is not None:
                out.stages = (out.stages or []) + [msg.stages[i]]
            if reason is not None:
                self.states.pop(rid, None)
                self.finished[rid] = None
                if len(self.finished) > _FINISHED_MEMORY:
                    self.finished.pop(next(iter(self.finished)))
        return out

    def _new_state(self, msg: BatchTokenIDOut, i: int) -> _DecodeState:
        if self.tokenizer is None:
            return _DecodeState(None, None)
        prompt_tail = msg.prompt_tail_ids[i] if msg.prompt_tail_ids else None
        detok = IncrementalDetokenizer(self.tokenizer, prompt_tail, msg.skip_special_tokens[i],
                                       msg.spaces_between_special_tokens[i])
        stops = msg.stop_strings[i]
        matcher = StopStringMatcher(stops, include_stop=msg.no_stop_trim[i]) if stops else None
        return _DecodeState(detok, matcher)

    def _advance(self, state: _DecodeState, new_ids: list[int], reason: dict[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
        if state.detok is None:
            return "", reason
        before = len(state.detok.output_text)
        state.detok.add_tokens(new_ids)
        if reason is not None:
            state.detok.flush()
        text = state.detok.output_text
        end = len(text)
        if state.matcher is not None:
            matched, cut = state.matcher.feed(text, before)
            if matched:
                # A stop string ends the request here, whatever the scheduler thought.
                reason = {"type": "stop", "matched": state.matcher.matched}
                end = cut
            elif reason is None:
                end = len(text) - state.matcher.holdback(text)
        end = max(end, state.sent)
        piece = text[state.sent : end]
        state.sent = end
        return piece, reason


def detokenizer_process(args: Any, model_path: str, ipc: Any, parent_pid: int, tokenizer_conn: Any = None) -> None:
    """Entry point of the detokenizer process.

    ``tokenizer_conn``: the main process sends its tokenizer here (None: load it here), so
    the tokenizer is loaded once and this process never imports torch.
    """
    import zmq

    from engine.managers.process_utils import exit_if_orphaned, ignore_group_signals, setup_child_logging
    from engine.managers.tokenizer_utils import load_tokenizer

    setup_child_logging(args.log_level, "detokenizer")
    ignore_group_signals()
    tokenizer = None
    if tokenizer_conn is not None:
        try:
            tokenizer = tokenizer_conn.recv()
        except EOFError:
            os._exit(0)  # the main process ended before it had a tokenizer to send
        tokenizer_conn.close()
    if tokenizer is None and not args.skip_tokenizer_init:
        tokenizer = load_tokenizer(args.tokenizer_path or model_path, args.trust_remote_code)
    manager = DetokenizerManager(tokenizer)
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(ipc.detokenizer)
    send = ctx.socket(zmq.PUSH)
    send.connect(ipc.tokenizer)
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    try:
        while True:
            if not poller.poll(500):
                exit_if_orphaned(parent_pid, ipc)
                continue
            msg = recv.recv_pyobj()
            if isinstance(msg, ControlReq):
                if msg.kind == "shutdown":
                    break  # the server asked, after draining its requests
                continue
            out = manager.handle(msg)
            if out.rids:
                send.send_pyobj(out)
    except Exception:
        logger.exception("detokenizer crashed")
        os._exit(1)
    finally:
        recv.close(0)
        send.close(0)
        ctx.term()
        os._exit(0)
