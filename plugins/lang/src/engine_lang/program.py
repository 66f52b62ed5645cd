"""``@function`` programs: ``.run``, ``.run_batch``, streaming, and the default backend."""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine_lang.backends.base import Backend
from engine_lang.ir import RoleBegin, SglExpr, SglRole, current_state
from engine_lang.run_context import RunContext
from engine_lang.state import ProgramState

_default_backend: Backend | None = None


def set_default_backend(backend: Backend) -> None:
    """The backend programs run on when ``run`` gets none (SGLang's ``set_default_backend``)."""
    global _default_backend
    if not isinstance(backend, Backend):
        raise TypeError(f"set_default_backend: {backend!r} is not a backend; accepted: RuntimeEndpoint(url), "
                        "Engine(...), OpenAI(...) or another engine_lang.Backend")
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


class SglFunction:
    """A program: ``def prog(s, ...)`` decorated with ``@function``."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise TypeError(f"@function {func.__name__}: the first parameter must be the state (def {func.__name__}(s, ...))")
        self.arg_names = [p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        self._var_keyword = any(p.kind == p.VAR_KEYWORD for p in params)
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Called inside another program with its state first: runs there (a sub-program)."""
        if args and isinstance(args[0], ProgramState):
            return self.func(*args, **kwargs)
        return self.run(*args, **kwargs)

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > len(self.arg_names):
            raise TypeError(f"{self.__name__}() takes {len(self.arg_names)} arguments besides the state, "
                            f"{len(args)} given")
        bound = dict(zip(self.arg_names, args, strict=False))
        for name in kwargs:
            if name in bound:
                raise TypeError(f"{self.__name__}(): argument {name!r} given twice")
            if name not in self.arg_names and not self._var_keyword:
                raise TypeError(f"{self.__name__}(): unknown argument {name!r}; its arguments: "
                                f"{', '.join(self.arg_names) or 'none'}; run()'s sampling defaults: "
                                f"{', '.join([*_SAMPLING_DEFAULTS, *_LOGPROB_DEFAULTS])}")
        return {**bound, **kwargs}

    @staticmethod
    def _resolve_backend(backend: Backend | None) -> Backend:
        backend = backend or _default_backend
        if backend is None:
            raise RuntimeError("no backend: call engine_lang.set_default_backend(RuntimeEndpoint(url)) or pass "
                               "backend=... to run()")
        return backend

    def run(self, *args: Any, max_new_tokens: int = 128, stop: str | list[str] | None = None,
            stop_token_ids: list[int] | None = None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
            min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
            ignore_eos: bool = False, return_logprob: bool = False, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None, stream: bool = False,
            backend: Backend | None = None, **kwargs: Any) -> ProgramState:
        """Runs the program; keyword arguments other than the sampling defaults are its arguments.

        The sampling arguments are the defaults of every ``gen`` in the program (SGLang's).
        With ``stream=True`` it returns at once; read the text with ``state.text_iter()``.
        """
        arguments = self._bind(args, kwargs)
        run = _make_run(self._resolve_backend(backend), stream, max_new_tokens=max_new_tokens, stop=stop,
                        stop_token_ids=stop_token_ids, temperature=temperature, top_p=top_p, top_k=top_k,
                        min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                        ignore_eos=ignore_eos, return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                        top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs)
        state = ProgramState(run)
        if stream:
            threading.Thread(target=self._execute, args=(state, arguments, True), daemon=True,
                             name=f"engine-lang-{self.__name__}").start()
            return state
        self._execute(state, arguments, False)
        return state

    def _execute(self, state: ProgramState, arguments: dict[str, Any], keep_error: bool) -> None:
        """Runs the body; on any error (or Ctrl-C) aborts the run's requests in flight."""
        token = current_state.set(state)
        run = state._run
        try:
            self.func(state, **arguments)
            # Branches the program never read still finish (and report their errors) before run returns.
            for each in list(run.states):
                each.sync()
        except BaseException as exc:
            run.cancel()
            state._finish(exc)
            if not keep_error:
                raise
        else:
            state._finish()
        finally:
            current_state.reset(token)
            run.stop_workers()

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, num_threads: int | str = "auto",
                  progress_bar: bool = False, backend: Backend | None = None, **sampling: Any) -> list[ProgramState]:
        """Runs the program once per dict of arguments, ``num_threads`` at a time.

        A program that fails does not stop the others: its state's ``error()`` holds the
        exception, and reading its variables raises it. The constant text every run starts with
        is sent once first (a prefix hint), so the runs find it in the cache.
        """
        backend = self._resolve_backend(backend)
        if num_threads == "auto":
            workers = max(1, min(len(batch_kwargs), 64, (os.cpu_count() or 1) * 16))
        elif isinstance(num_threads, int) and num_threads >= 1:
            workers = num_threads
        else:
            raise ValueError(f"run_batch: num_threads {num_threads!r} is not accepted; accepted: 'auto' or an integer >= 1")
        bar = None
        if progress_bar:
            try:
                from tqdm import tqdm
            except ImportError:
                raise ImportError("run_batch(progress_bar=True) needs tqdm: pip install tqdm") from None
            bar = tqdm(total=len(batch_kwargs))
        if len(batch_kwargs) > 1:
            prefix = trace_prefix(self, backend)
            if prefix:
                backend.cache_prefix(prefix, RunContext.new_rid())

        def one(arguments: dict[str, Any]) -> ProgramState:
            run = _make_run(backend, False, **sampling)
            state = ProgramState(run)
            self._execute(state, self._bind((), arguments), keep_error=True)
            if bar is not None:
                bar.update(1)
            return state

        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                return list(pool.map(one, batch_kwargs))
        finally:
            if bar is not None:
                bar.close()


# run()'s sampling defaults by name, as SGLang's.
_SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False}
_LOGPROB_DEFAULTS: dict[str, Any] = {"return_logprob": False, "logprob_start_len": None, "top_logprobs_num": None,
                                     "return_text_in_logprobs": None}


def _make_run(backend: Backend, stream: bool, **values: Any) -> RunContext:
    unknown = set(values) - set(_SAMPLING_DEFAULTS) - set(_LOGPROB_DEFAULTS)
    if unknown:
        raise TypeError(f"run: unknown sampling argument(s) {sorted(unknown)}; accepted: "
                        f"{', '.join([*_SAMPLING_DEFAULTS, *_LOGPROB_DEFAULTS])}")
    sampling = {k: values.get(k, v) for k, v in _SAMPLING_DEFAULTS.items()}
    logprobs = {k: values.get(k, v) for k, v in _LOGPROB_DEFAULTS.items()}
    return RunContext(backend, {k: v for k, v in sampling.items() if v is not None},
                      {k: v for k, v in logprobs.items() if v is not None and v is not False}, stream)


class _StopTracing(Exception):
    pass


def _stop(*args: Any, **kwargs: Any) -> Any:
    raise _StopTracing


class _Placeholder:
    """A program argument while tracing: using it in any way ends the constant prefix."""

    def __init__(self, name: str) -> None:
        self._name = name

    # Operators look special methods up on the type, so each is set here, not in __getattr__.
    __getattr__ = __str__ = __repr__ = __format__ = __add__ = __radd__ = __mod__ = _stop
    __iter__ = __len__ = __getitem__ = __contains__ = __eq__ = __bool__ = __hash__ = _stop


class _Tracer:
    """Stands in for the state while tracing: collects the text every run begins with."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.text = ""
        self.messages: list[dict[str, Any]] = []

    def __iadd__(self, expr: Any) -> _Tracer:
        if isinstance(expr, str):
            self.text += expr
        elif isinstance(expr, SglRole):
            template = self.backend.chat_template()
            self.text += template.role_begin(self.messages, expr.role)
            if not isinstance(expr.content, str):
                raise _StopTracing
            self.text += expr.content + template.role_end(self.messages, expr.role, expr.content)
            self.messages.append({"role": expr.role, "content": expr.content})
        elif isinstance(expr, RoleBegin):
            self.text += self.backend.chat_template().role_begin(self.messages, expr.role)
            raise _StopTracing  # the message's content may depend on the arguments
        else:
            raise _StopTracing
        return self

    def _role(self, role: str) -> Any:
        self.__iadd__(RoleBegin(role))

    def system(self) -> Any:
        return self._role("system")

    def user(self) -> Any:
        return self._role("user")

    def assistant(self) -> Any:
        return self._role("assistant")

    def __getattr__(self, name: str) -> Any:
        raise _StopTracing


def trace_prefix(program: SglFunction, backend: Backend) -> str:
    """The text a program adds before it first uses an argument or calls the model: what every
    run of a batch shares (SGLang traces programs the same way before a batch)."""
    tracer = _Tracer(backend)
    try:
        program.func(tracer, **{name: _Placeholder(name) for name in program.arg_names})
    except Exception:  # noqa: BLE001 - _StopTracing, or anything else the body does: the prefix ends
        pass
    return tracer.text


def function(func: Callable[..., Any] | None = None) -> Any:
    """``@function`` (or ``@function()``): makes ``def prog(s, ...)`` a program."""
    if func is None:
        return SglFunction
    return SglFunction(func)


__all__ = ["SglFunction", "SglExpr", "function", "get_default_backend", "set_default_backend", "trace_prefix"]
