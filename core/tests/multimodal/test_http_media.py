"""Images through the HTTP app in-process (no engine processes): chat ``image_url`` parts and
``/generate``'s ``image_data`` become prompt ids with pad ids and items; bad images, too many, and
images sent to a text-only model are 400s naming the field."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine.config import ServerArgs
from engine.entrypoints.http_server import create_app
from engine.managers.io_struct import SchedulerReady
from engine.managers.tokenizer_manager import GenerateRequest, ReqState, TokenizerManager
from engine.managers.tokenizer_pool import TokenizerPool
from engine.router.router import Router

from .conftest import IMAGE_TOKENS, png_data_url


class RecordingManager(TokenizerManager):
    """Real tokenizing and media processing; generation answers one token and records the request."""

    sends_on_submit = False  # no scheduler: requests go through ``generate``

    def __init__(self, args: Any, model_path: str, ipc: Any, ready: SchedulerReady, processes: list[Any],
                 tokenizer: Any) -> None:
        self.args, self.model_path, self.ready, self.tokenizer, self.processes = args, model_path, ready, tokenizer, processes
        self.context_len = ready.context_len
        self.states: dict[str, ReqState] = {}
        self.dead: str | None = None
        self.on_finish: list[Any] = []
        self.on_route: list[Any] = []
        self.router = Router(1)
        self.draining = False
        self.groups: dict[str, set[str]] = {}
        self._group_of: dict[str, list[str]] = {}
        self.pool = TokenizerPool(tokenizer, 1, ready.context_len)
        self.sent: list[tuple[GenerateRequest, list[int]]] = []

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def generate(self, req: GenerateRequest, prepared: Any = None) -> AsyncIterator[dict[str, Any]]:
        ids, _ = prepared or await self.prepare_async(req)
        self.sent.append((req, ids))
        state = ReqState(req.rid or "r", ids)
        state.output_ids, state.text = [5], "x"
        state.finished_reason = {"type": "length", "length": 1}
        yield self._output(state)


def _client(path: str, multimodal: bool, vocab: int, **args: Any) -> TestClient:
    from engine.managers.tokenizer_utils import load_tokenizer

    server_args = ServerArgs(model_path=path, **args)
    ready = SchedulerReady(max_total_num_tokens=512, max_running_requests=8, context_len=256, vocab_size=vocab,
                           device="cpu", attention_backend="torch_native", platform="cpu", dtype="float32",
                           eos_token_ids=[3], plugins=[], multimodal=multimodal)
    runtime = SimpleNamespace(args=server_args, model_path=path, ipc=None, ready=ready, processes=[])
    return TestClient(create_app(runtime, load_tokenizer(path), manager_factory=RecordingManager))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def client(llava_ckpt: str) -> Iterator[TestClient]:
    with _client(llava_ckpt, True, 2049, limit_mm_per_prompt=2) as c:
        yield c


def _chat(client: TestClient, *parts: dict[str, Any]) -> Any:
    content = [{"type": "text", "text": "Look:"}, *parts]
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}], "max_tokens": 1})


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_image_parts_become_items(client: TestClient, tmp_path: Any) -> None:
    png = base64.b64decode(png_data_url(3).split(",", 1)[1])
    (tmp_path / "cat.png").write_bytes(png)
    r = _chat(client, _image(png_data_url(3)), _image(f"file://{tmp_path / 'cat.png'}"))
    assert r.status_code == 200, r.text
    req, ids = client.app.state.ctx.manager.sent[-1]
    a, b = req.mm_items
    assert a.length == b.length == IMAGE_TOKENS and a.hash == b.hash and a.offset < b.offset
    assert a.features["pixel_values"].shape == (1, 3, 42, 42)
    image_token = client.app.state.ctx.tokenizer.convert_tokens_to_ids("<image>")
    assert image_token not in ids and ids[a.offset:a.end] == ids[b.offset:b.end]
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_generate_takes_image_data(client: TestClient) -> None:
    r = client.post("/generate", json={"text": "<image>\nWhat is it?", "image_data": png_data_url(4),
                                       "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text
    req, _ = client.app.state.ctx.manager.sent[-1]
    assert len(req.mm_items) == 1
    # The offline Engine's path: the same processing, on the calling thread.
    sync = GenerateRequest(text="<image>\nWhat is it?", image_data=[png_data_url(4)])
    ids, _ = client.app.state.ctx.manager.prepare(sync)
    assert [it.hash for it in sync.mm_items] == [it.hash for it in req.mm_items] and len(ids) > IMAGE_TOKENS
    r = client.post("/generate", json={"text": "What is it?", "image_data": [png_data_url(4)],
                                       "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "placeholder" in r.json()["error"]["message"]


@pytest.mark.parametrize("url, param, reason", [
    ("data:image/png;base64,not-base64!", "messages[0].content[1].image_url", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"no image here").decode(), "messages[0].content[1].image_url",
     "cannot decode"),
    ("http://127.0.0.1:9/cat.png", "messages[0].content[1].image_url", "--allow-remote-media"),
    ("/no/such/file.png", "messages[0].content[1].image_url", "no such file"),
])
def test_a_bad_image_is_a_400_naming_the_part(client: TestClient, url: str, param: str, reason: str) -> None:
    r = _chat(client, _image(url))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and reason in err["message"], err


def test_too_many_images_is_a_400(client: TestClient) -> None:
    r = _chat(client, *[_image(png_data_url(i)) for i in range(3)])
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and "at most 2" in err["message"] and "--limit-mm-per-prompt" in err["message"]


def test_an_image_on_a_text_only_model_is_a_400(llama_ckpt: str) -> None:
    with _client(llama_ckpt, False, 2048) as c:
        r = _chat(c, _image(png_data_url(1)))
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "messages[0].content[1].image_url" and "takes no image input" in err["message"], err
        r = c.post("/generate", json={"text": "hi", "image_data": png_data_url(1)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "image_data"
        ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_remote_images_are_fetched_within_the_limits() -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from engine.multimodal.media import MediaError, MediaLimits, load_image

    png = base64.b64decode(png_data_url(5).split(",", 1)[1])

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/cat.png" else 404)
            self.end_headers()
            if self.path == "/cat.png":
                self.wfile.write(png)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert load_image(f"{url}/cat.png", "p", MediaLimits(allow_remote=True)).size == (37, 30)
        with pytest.raises(MediaError, match="larger than 100 bytes"):
            load_image(f"{url}/cat.png", "p", MediaLimits(allow_remote=True, max_bytes=100))
        with pytest.raises(MediaError, match="404"):
            load_image(f"{url}/dog.png", "p", MediaLimits(allow_remote=True))
        with pytest.raises(MediaError, match="--allow-remote-media"):
            load_image(f"{url}/cat.png", "p", MediaLimits())
    finally:
        server.shutdown()


def test_video_on_an_image_only_model_is_a_400(client: TestClient) -> None:
    r = _chat(client, {"type": "video_url", "video_url": {"url": [png_data_url(1), png_data_url(2)]}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1].video_url" and "takes no video input" in err["message"], err
    r = _chat(client, {"type": "video_url", "video_url": {"url": png_data_url(1)}})
    assert r.status_code == 400 and "list of frame URLs" in r.json()["error"]["message"]
