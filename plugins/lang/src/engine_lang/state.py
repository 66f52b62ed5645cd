"""``ProgramState``: the ``s`` of a program. ``s += expr`` queues ``expr`` and returns at once; a
worker thread per state runs the queue in order, so forks run in parallel. Reading
(``s["x"]``, ``s.text()``, ``s.messages()``) waits for what was queued before it and raises the
first error of the state (a ``ProgramError`` naming the variable and the call)."""

from __future__ import annotations

import math
import queue
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine_lang.backends.base import GenRequest, ScoreRequest
from engine_lang.ir import (
    RoleBegin,
    RoleEnd,
    SglExprList,
    SglGen,
    SglRole,
    SglSelect,
    VarScopeBegin,
    VarScopeEnd,
    _Evaluated,
)
from engine_lang.run_context import ProgramError, RunContext
from engine_lang.state_group import ProgramStateGroup
from engine_lang.streaming import StreamingMixin

_STOP = object()
# Seconds a state's worker waits for work before it leaves.
_IDLE_S = 1.0


class _Evaluate:
    """An un-added gen/select run on the text so far (a comparison in the program)."""

    def __init__(self, expr: _Evaluated) -> None:
        self.expr = expr
        self.result: Any = None


class ProgramState(StreamingMixin):
    def __init__(self, run: RunContext, text: str = "", messages: list[dict[str, Any]] | None = None,
                 variables: dict[str, Any] | None = None, meta_info: dict[str, Any] | None = None) -> None:
        self._run = run
        self._text = text
        self._messages = list(messages or [])
        self._variables = dict(variables or {})
        self._meta = dict(meta_info or {})
        self._role: str | None = None  # the open chat message's role
        self._role_start = 0  # where its content starts in the text
        self._scopes: dict[str, int] = {}
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._chunks: list[tuple[str | None, str]] = []  # (variable or None, text) as appended
        self._finished = False
        run.states.append(self)

    # -- queueing ----------------------------------------------------------------------------
    def __iadd__(self, expr: Any) -> ProgramState:
        self.submit(expr)
        return self

    def submit(self, expr: Any) -> None:
        with self._cond:  # one lock with the worker's exit, so nothing is queued behind a leaving worker
            self._pending += 1
            self._queue.put(expr)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="engine-lang-state", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            try:
                # An idle worker leaves (submit starts another): a state used after its run ended
                # holds no thread.
                expr = self._queue.get(timeout=_IDLE_S)
            except queue.Empty:
                expr = _STOP
            if expr is _STOP:
                with self._cond:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue  # added to after the run ended: keep working
            try:
                if self._error is None:
                    self._execute(expr)
            except BaseException as exc:  # noqa: BLE001 - kept and raised to the program at its next read
                self._error = exc
                self._run.cancel()  # the program has failed: stop its other requests too
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _stop_worker(self) -> None:
        with self._cond:
            if self._thread is not None:
                self._queue.put(_STOP)

    def sync(self) -> None:
        """Waits for everything queued so far; raises the state's first error."""
        with self._cond:
            while self._pending > 0:
                self._cond.wait(0.1)  # a timeout keeps Ctrl-C deliverable to this thread
        if self._error is not None:
            raise self._error

    def _finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            if error is not None and self._error is None:
                self._error = error
            self._finished = True
            self._cond.notify_all()

    # -- execution (worker thread) ------------------------------------------------------------
    def _execute(self, expr: Any) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, SglExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, (SglGen, SglSelect)):
            self._call(expr, append=True)
        elif isinstance(expr, _Evaluate):
            expr.result = self._call(expr.expr, append=False)
        elif isinstance(expr, SglRole):
            self._role_begin(expr.role)
            if expr.content is not None:
                self._execute(expr.content)
            self._role_end(expr.role)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self._scopes[expr.name] = len(self._text)
        elif isinstance(expr, VarScopeEnd):
            self._variables[expr.name] = self._text[self._scopes.pop(expr.name):]
        elif isinstance(expr, (int, float)) and not isinstance(expr, bool):
            self._append(str(expr))
        else:
            raise TypeError(f"s += {type(expr).__name__}: accepted: str, gen(), select(), system()/user()/assistant(), "
                            "or a sum of these")

    def _append(self, text: str, variable: str | None = None) -> None:
        self._text += text
        if self._run.stream and text:
            with self._cond:
                self._chunks.append((variable, text))
                self._cond.notify_all()

    def _call(self, expr: SglGen | SglSelect, append: bool) -> Any:
        try:
            return self._gen(expr, append) if isinstance(expr, SglGen) else self._select(expr, append)
        except ProgramError:
            raise
        except Exception as exc:
            raise ProgramError(repr(expr), expr.name, exc) from exc

    def _gen(self, expr: SglGen, append: bool) -> str:
        run = self._run
        at_turn_start = self._role == "assistant" and len(self._text) == self._role_start
        req = GenRequest(self._text, {**run.sampling, **expr.sampling}, run.new_rid(),
                         {**run.logprobs, **expr.logprobs}, list(self._messages) if at_turn_start else None)
        run.begin(req.rid)
        try:
            if run.stream and append:
                start, out = len(self._text), None
                for out in run.backend.generate_stream(req):
                    shown = self._text[start:]
                    if out.text.startswith(shown):
                        self._append(out.text[len(shown):], expr.name)
                    else:  # the server rewrote the tail (a stop string trimmed): keep the final text
                        self._text = self._text[:start] + out.text
                if out is None:
                    raise RuntimeError("the stream ended without an output")
                self._text = self._text[:start] + out.text
            else:
                out = run.backend.generate(req)
                if append:
                    self._append(out.text, expr.name)
        finally:
            run.end(req.rid)
        if expr.name:
            self._variables[expr.name] = out.text
            self._meta[expr.name] = out.meta_info
        return out.text

    def _select(self, expr: SglSelect, append: bool) -> str:
        run = self._run
        rid = run.new_rid()
        run.begin(rid)
        try:
            out = run.backend.score(ScoreRequest(self._text, expr.choices, rid, expr.method.requires_unconditional))
        finally:
            run.end(rid)
        decision = expr.method(out.choices)
        index = decision.index
        if expr.temperature > 0:
            top = max(decision.scores)
            weights = [math.exp((s - top) / expr.temperature) if s > -math.inf else 0.0 for s in decision.scores]
            index = random.choices(range(len(weights)), weights=weights)[0]
        choice = expr.choices[index]
        if append:
            self._append(choice, expr.name)
        if expr.name:
            self._variables[expr.name] = choice
            self._meta[expr.name] = {
                "choices_method": expr.method.name, "scores": decision.scores,
                "normalized_prompt_logprobs": [sum(c.logprobs) / max(len(c.logprobs), 1) for c in out.choices],
                "input_token_logprobs": [c.tokens for c in out.choices],
                "unconditional_token_logprobs": [c.unconditional for c in out.choices],
                **out.meta_info}
        return choice

    def _role_begin(self, role: str) -> None:
        if self._role is not None:
            raise ValueError(f"{role}(): the {self._role} message is still open; messages do not nest")
        self._append(self._run.chat_template().role_begin(self._messages, role))
        self._role, self._role_start = role, len(self._text)

    def _role_end(self, role: str) -> None:
        if self._role != role:
            raise ValueError(f"end of {role}(): the open message is {self._role!r}")
        content = self._text[self._role_start:]
        self._append(self._run.chat_template().role_end(self._messages, role, content))
        self._messages.append({"role": role, "content": content})
        self._role = None

    # -- reading (program thread) ---------------------------------------------------------------
    def evaluate(self, expr: _Evaluated) -> Any:
        """Runs an un-added gen/select on the text so far and returns its value (nothing appended)."""
        job = _Evaluate(expr)
        self.submit(job)
        self.sync()
        return job.result

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self._variables:
            raise KeyError(f"no variable {name!r} in this program state; defined: {sorted(self._variables)}")
        return self._variables[name]

    def get_var(self, name: str) -> Any:
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self._variables[name] = value

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._variables

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, Any]]:
        self.sync()
        return [dict(m) for m in self._messages]

    def get_meta_info(self, name: str) -> Any:
        self.sync()
        if name not in self._meta:
            raise KeyError(f"no meta info for {name!r}; variables with meta info: {sorted(self._meta)}")
        return self._meta[name]

    def error(self) -> BaseException | None:
        """The program's error (run_batch keeps each program's here), or None."""
        with self._cond:
            while self._pending > 0:
                self._cond.wait(0.1)
        return self._error

    # -- roles and scopes as context managers --------------------------------------------------
    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self.submit(RoleBegin(role))
        yield
        self.submit(RoleEnd(role))

    def system(self) -> Any:
        return self._role_scope("system")

    def user(self) -> Any:
        return self._role_scope("user")

    def assistant(self) -> Any:
        return self._role_scope("assistant")

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """The text added inside the block becomes variable ``name``."""
        self.submit(VarScopeBegin(name))
        yield
        self.submit(VarScopeEnd(name))

    # -- forks -----------------------------------------------------------------------------------
    def fork(self, size: int = 1) -> ProgramStateGroup:
        """``size`` branches that start from this state's text and run in parallel. With more than
        one, the text so far is sent first (a prefix hint), so every branch finds it in the cache."""
        if size < 1:
            raise ValueError(f"fork: size {size} is not accepted; accepted: >= 1")
        self.sync()
        if size > 1 and self._text:
            rid = self._run.new_rid()
            self._run.begin(rid)
            try:
                self._run.backend.cache_prefix(self._text, rid)
            finally:
                self._run.end(rid)
        branches = []
        for _ in range(size):
            branch = ProgramState(self._run, self._text, self._messages, self._variables, self._meta)
            branch._role, branch._role_start = self._role, self._role_start
            branches.append(branch)
        return ProgramStateGroup(branches, self)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"
