"""The client library without a server: what importing it loads, the backend registry, chat
templates against transformers, the choice methods, argument errors."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import engine_lang as sgl
import pytest
from engine_lang.chat_template import CHATML_TEMPLATE, ChatTemplate
from engine_lang.choices import ChoiceLogprobs, resolve_method

HEAVY = ("torch", "transformers", "engine", "numpy")


def test_import_loads_no_torch_and_no_engine() -> None:
    # A fresh interpreter: the language, its three backends' registry and the HTTP backends.
    code = ("import sys, json, engine_lang, engine_lang.backends.runtime_endpoint, engine_lang.backends.openai, "
            "engine_lang.program, engine_lang.state; "
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_probe_sees_a_heavy_import() -> None:
    # Guards the check above: the probe does report a heavy module once something imports it.
    code = "import sys, engine_lang; import engine; print('engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr


def test_backends_are_registered_entry_points() -> None:
    assert sgl.list_backends() == {"engine": "engine_lang.backends.engine:Engine",
                                   "openai": "engine_lang.backends.openai:OpenAI",
                                   "runtime": "engine_lang.backends.runtime_endpoint:RuntimeEndpoint"}
    with pytest.raises(ValueError, match="unknown frontend-language backend 'runtim'; installed: engine, openai, runtime"):
        sgl.connect("runtim")


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye\nnow"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_roles_render_as_transformers(tokenizer: Any, messages: list[dict[str, str]]) -> None:
    template = ChatTemplate(tokenizer.chat_template, dict(tokenizer.special_tokens_map))
    text, done = "", []
    for message in messages:  # built one message at a time, as a program does
        text += template.role_begin(done, message["role"]) + message["content"]
        text += template.role_end(done, message["role"], message["content"])
        done.append(message)
    assert text == tokenizer.apply_chat_template(messages, tokenize=False)
    assert text + template.role_begin(done, "assistant") == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_a_template_that_is_not_incremental_is_refused() -> None:
    # Renders the last message differently from the others: a prefix cannot be built up.
    template = ChatTemplate("{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% else %}{{ m.content }}"
                            "{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="not incremental"):
        template.role_begin([{"role": "user", "content": "a"}], "user")
    assert ChatTemplate(CHATML_TEMPLATE).render([{"role": "user", "content": "x"}]) == "<|im_start|>user\nx<|im_end|>\n"


def _choices(*rows: list[float], uncond: list[list[float | None]] | None = None) -> list[ChoiceLogprobs]:
    return [ChoiceLogprobs([[lp, i, ""] for i, lp in enumerate(row)], None if uncond is None else uncond[k])
            for k, row in enumerate(rows)]


def test_choice_methods() -> None:
    rows = _choices([-1.0, -0.1, -0.1], [-0.5, -3.0], uncond=[[None, -0.1, -0.1], [None, -0.2]])
    assert resolve_method(None)(rows).index == 0  # means -0.4 vs -1.75
    assert resolve_method("greedy_token_selection")(rows).index == 1  # first token -0.5 beats -1.0
    # -0.4 - (-0.0667) = -0.333 vs -1.75 - (-0.1) = -1.65
    assert resolve_method("unconditional_likelihood_normalized")(rows).index == 0
    # Greedy: tied first tokens go on to the next; a shorter choice is padded with its mean.
    assert resolve_method("greedy_token_selection")(_choices([-0.5, -2.0], [-0.5, -1.0], [-0.5])).index == 2
    with pytest.raises(ValueError, match="choices_method: unknown method 'best'; accepted: token_length_normalized"):
        resolve_method("best")


def test_argument_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"select\('x'\): choices must be a non-empty list of strings"):
        sgl.select("x", choices=[])
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("x", dtype=list)
    with pytest.raises(TypeError, match="first parameter must be the state"):
        sgl.function(lambda: None)

    @sgl.function
    def prog(s: Any, a: int) -> None:
        s += str(a)

    with pytest.raises(TypeError, match=r"prog\(\): unknown argument 'temprature'; its arguments: a; run\(\)'s sampling"):
        prog.run(a=1, temprature=0, backend=sgl.Backend())
    with pytest.raises(RuntimeError, match="was compared with a value outside a running program"):
        bool(sgl.gen("x", choices=["a", "b"]) == "a")


class _FakeServer:
    """A local HTTP server answering from a table (path -> (status, body)) and keeping the
    requests' headers: for what a model server cannot show (a server without prompt logprobs)."""

    def __init__(self, routes: dict[str, tuple[int, Any]]) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.headers: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                outer.headers.append(dict(self.headers))
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                status, body = routes.get(self.path, (404, {"error": {"message": f"no route {self.path}"}}))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def test_openai_select_without_prompt_logprobs_is_unsupported() -> None:
    completion = {"id": "c", "choices": [{"index": i, "text": "x", "logprobs": None, "finish_reason": "length"}
                                         for i in range(2)], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    fake = _FakeServer({"/v1/completions": (200, completion)})
    try:
        @sgl.function
        def choose(s: Any) -> None:
            s += "Pick:"
            s += sgl.select("pick", choices=[" a", " b"])

        backend = sgl.OpenAI("m", base_url=fake.url + "/v1", api_key="k")
        with pytest.raises(sgl.ProgramError, match="variable 'pick'.*select: the OpenAI-compatible server") as info:
            choose.run(backend=backend)
        assert isinstance(info.value.__cause__, sgl.UnsupportedOperation)
        assert "does not return prompt logprobs" in str(info.value)
    finally:
        fake.close()


def test_runtime_endpoint_sends_the_api_key() -> None:
    fake = _FakeServer({"/get_model_info": (200, {"chat_template": None})})
    try:
        sgl.RuntimeEndpoint(fake.url, api_key="secret").close()
        assert fake.headers[-1]["Authorization"] == "Bearer secret"
        with pytest.raises(sgl.BackendError, match=r"RuntimeEndpoint: .*/get_model_info answered 404"):
            sgl.RuntimeEndpoint(fake.url + "/nothing-here")
    finally:
        fake.close()


class _Echo(sgl.Backend):
    """Answers every gen with its max_new_tokens: the executor's bookkeeping without a model."""

    name = "echo"

    def generate(self, req: Any) -> Any:
        from engine_lang.backends.base import GenOutput

        return GenOutput(f"<{req.sampling_params['max_new_tokens']}>", {"prompt": req.text})


def test_states_keep_order_across_forks_and_after_the_run() -> None:
    import threading
    import time

    @sgl.function
    def prog(s: Any, n: int) -> None:
        s += "a"
        forks = s.fork(3)
        forks += [sgl.gen("g", max_tokens=n + i) for i in range(3)]
        s += forks[2]["g"]
        forks.join()

    before = threading.active_count()
    for n in range(50):
        state = prog.run(n, backend=_Echo())
        assert state["g"] == [f"<{n}>", f"<{n + 1}>", f"<{n + 2}>"] and state.text() == f"a<{n + 2}>"
        state += "b"  # a state stays usable after its run
        state += sgl.gen("x", max_tokens=1)
        assert state.text() == f"a<{n + 2}>b<1>" and state.get_meta_info("x") == {"prompt": f"a<{n + 2}>b"}
    time.sleep(1.5)  # idle workers leave
    assert threading.active_count() <= before + 1
