"""End to end: the gRPC service of ``engine serve --grpc-port`` through the packaged stubs.

Generation runs on the session's shared tiny-Llama server, which serves gRPC beside HTTP when
plugserve-grpc is installed (no start of its own). ``Embed`` is checked on the embedding server of
tests/test_server_e2e_embeddings.py, which serves gRPC too.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("engine_grpc", reason="plugserve-grpc is not installed")
import grpc  # noqa: E402
from engine_grpc.client import Client, collect  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import (  # noqa: E402
    API_KEY,
    MODEL_NAME,
    Server,
    assert_no_kv_leak,
    free_port,
    server_info,
    shared_server,
    wait_idle,
)

PROMPT = "The gRPC door opens onto"


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, llama_ckpt_dir: str) -> Server:
    return shared_server(request.config, tmp_path_factory, llama_ckpt_dir)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Client]:
    assert "grpc_port" in server.extra, "the shared server was started without --grpc-port"
    with Client(f"127.0.0.1:{server.extra['grpc_port']}", api_key=API_KEY, timeout=60) as client:
        yield client


def _finished_requests(server: Server) -> float:
    """engine_requests_total summed over finish reasons: requests that ran to their end."""
    total = 0.0
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("engine_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_streamed_generate_equals_native_generate(server: Server, client: Client) -> None:
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    http = server.post("/generate", json={"text": PROMPT, "sampling_params": params, "return_logprob": True,
                                          "logprob_start_len": 0}).json()
    responses = list(client.generate(text=PROMPT, sampling_params=params, stream=True, return_logprob=True,
                                     logprob_start_len=0))
    # A response per increment (increments arriving together while the loop is busy come as one).
    assert len(responses) > 1 and all(r.token_ids for r in responses)
    (out,) = collect(responses)
    assert out.text == http["text"] and out.token_ids == http["output_ids"]
    meta = http["meta_info"]
    assert (out.finish_reason, out.prompt_tokens, out.completion_tokens) == ("length", meta["prompt_tokens"], 12)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([e[0] for e in meta["output_token_logprobs"]], abs=1e-4)
    prompt = meta["input_token_logprobs"]  # [logprob, id, text], the first logprob null
    assert [lp.token_id for lp in out.input_logprobs] == [e[1] for e in prompt]
    assert math.isnan(out.input_logprobs[0].logprob)
    assert [lp.logprob for lp in out.input_logprobs[1:]] == pytest.approx([e[0] for e in prompt[1:]], abs=1e-4)
    # The same prompt again, not streamed: one response, the whole output, the prompt from the cache.
    (again,) = list(client.generate(input_ids=None, text=PROMPT, sampling_params=params))
    assert list(again.token_ids) == out.token_ids and again.text == out.text
    assert again.cached_tokens > 0 and again.finish_reason.type == "length"
    # n choices: each its own index and rid.
    two = collect(client.generate(text=PROMPT, sampling_params={"max_new_tokens": 3, "n": 2, "seed": 7}, rid="grpc-n",
                                  stream=True))
    assert [o.rid for o in two] == ["grpc-n-0", "grpc-n-1"] and all(len(o.token_ids) == 3 for o in two)


def test_a_cancelled_stream_frees_the_request(server: Server, client: Client) -> None:
    finished = _finished_requests(server)
    call = client.generate(text=PROMPT, stream=True, rid="grpc-cancel",
                           sampling_params={"max_new_tokens": 900, "ignore_eos": True})
    for count, _ in enumerate(call, 1):
        if count == 3:
            call.cancel()
            break
    info = wait_idle(server)
    assert_no_kv_leak(info)
    assert info["num_inflight_reqs"] == 0, info
    # It was aborted, not run to its end: nothing runs under its id, and no request finished.
    with pytest.raises(grpc.RpcError) as gone:
        client.abort("grpc-cancel")
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert _finished_requests(server) == finished


def test_abort_ends_a_stream_with_aborted(server: Server, client: Client) -> None:
    call = client.generate(text=PROMPT, stream=True, rid="grpc-abort",
                           sampling_params={"max_new_tokens": 900, "ignore_eos": True})
    responses = iter(call)
    first = next(responses)
    assert first.rid == "grpc-abort"
    assert client.abort("grpc-abort") == ["grpc-abort"]
    rest = []
    with pytest.raises(grpc.RpcError) as ended:
        for response in responses:
            rest.append(response)
    assert ended.value.code() == grpc.StatusCode.ABORTED, ended.value.details()
    assert rest and rest[-1].finish_reason.type == "abort"
    assert_no_kv_leak(wait_idle(server))


def test_health_and_infos(server: Server, client: Client) -> None:
    assert client.health() == "ok"
    model = client.model_info()
    http_model = server.get("/get_model_info").json()
    assert (model.served_model_name, model.context_len) == (MODEL_NAME, http_model["context_len"])
    assert model.is_generation and model.model_path == http_model["model_path"]
    info = client.server_info()
    assert info["grpc_port"] == server.extra["grpc_port"] and info["api_key"] == "<redacted>"
    assert info["max_total_num_tokens"] == server_info(server)["max_total_num_tokens"]


def test_bad_requests_name_the_field(server: Server, client: Client) -> None:
    def status(**kw: object) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as failed:
            list(client.generate(**kw))  # type: ignore[arg-type]
        return failed.value

    bad = status(text="x", sampling_params={"temperature": -1.0})
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in bad.details()
    assert ("param", "temperature") in list(bad.trailing_metadata())
    bad = status(input_ids=[1, 10**6])
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and bad.details().startswith("input_ids: token id 1000000")
    bad = status()  # no prompt
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in bad.details()
    with Client(f"127.0.0.1:{server.extra['grpc_port']}", api_key="wrong") as stranger:
        with pytest.raises(grpc.RpcError) as refused:
            stranger.model_info()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stranger.health() == "ok"  # as /health, no key needed


def test_a_busy_grpc_port_fails_before_the_model_loads(llama_ckpt_dir: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "engine", "serve", "--model-path", llama_ckpt_dir,
                              "--port", str(free_port()), "--grpc-port", str(port)],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: --grpc-port: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(is another server running? pick another --grpc-port)")
