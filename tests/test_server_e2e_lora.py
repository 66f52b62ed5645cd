"""End to end: ``engine serve --lora-paths`` on a tiny random Llama with random PEFT adapters.

One server for the module. PEFT (``PeftModel`` over transformers, greedy, float32) is the oracle:
a batch mixing adapters and the base model over /generate, the OpenAI client with
``model=<adapter>``, an adapter loaded at run time, and a request that keeps its adapter while
the adapter is unloaded under it all produce PEFT's tokens.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import MODEL_NAME, Server, launch  # noqa: E402

PROMPTS = [[5, 17, 99, 301, 7], [42, 8, 600, 11], [1000, 2, 33]]
NEW_TOKENS = 6
# The request kept running while its adapter is unloaded (long enough to be mid-decode then).
LONG_TOKENS = 96


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from engine.testing.checkpoints import make_tiny_checkpoint
    from engine.testing.conformance.lora import make_peft_adapter

    root = tmp_path_factory.mktemp("lora-e2e")
    ckpt = make_tiny_checkpoint(str(root / "base"), "LlamaForCausalLM")
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    dirs = {
        "a": make_peft_adapter(ckpt, str(root / "a"), 8, attention, 1),
        "b": make_peft_adapter(ckpt, str(root / "b"), 4, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], 2),
        "c": make_peft_adapter(ckpt, str(root / "c"), 8, attention + ["gate_proj", "up_proj", "down_proj"], 3),
    }
    server = launch(ckpt, str(root), "--lora-paths", f"a={dirs['a']}", f"b={dirs['b']}",
                    "--lora-target-modules", "all", "--max-loras-per-batch", "2")
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    yield {"server": server, "dirs": dirs, "ckpt": ckpt}
    server.stop()


@pytest.fixture(scope="module")
def peft_greedy(setup: dict[str, Any]) -> Any:
    """PEFT's greedy output ids for (adapter or None, prompt ids, count), memoised."""
    from peft import PeftModel

    from engine.testing.checkpoints import hf_greedy, load_hf_model

    model = PeftModel.from_pretrained(load_hf_model(setup["ckpt"]), setup["dirs"]["a"], adapter_name="a")
    for name in ("b", "c"):
        model.load_adapter(setup["dirs"][name], adapter_name=name)
    memo: dict[tuple[Any, ...], list[int]] = {}

    def run(adapter: str | None, prompt: list[int], count: int = NEW_TOKENS) -> list[int]:
        key = (adapter, tuple(prompt), count)
        if key not in memo:
            if adapter is None:
                with model.disable_adapter():
                    memo[key] = hf_greedy(model, prompt, count)
            else:
                model.set_adapter(adapter)
                memo[key] = hf_greedy(model, prompt, count)
        return memo[key]

    return run


def _generate(server: Server, prompts: Any, lora: Any, count: int = NEW_TOKENS) -> httpx.Response:
    return server.post("/generate", json={"input_ids": prompts, "lora_path": lora,
                                          "sampling_params": {"max_new_tokens": count, "temperature": 0}})


def test_mixed_adapter_batch_equals_peft(setup: dict[str, Any], peft_greedy: Any) -> None:
    server = setup["server"]
    # Three prompts x (a, b, base) in one batch: 9 requests, with 2 adapter slots per forward.
    prompts = [p for p in PROMPTS for _ in range(3)]
    loras = ["a", "b", None] * len(PROMPTS)
    r = _generate(server, prompts, loras)
    assert r.status_code == 200, r.text
    got = [out["output_ids"] for out in r.json()]
    assert got == [peft_greedy(lora, p) for p, lora in zip(prompts, loras, strict=True)]
    assert got[0] != got[1] != got[2]  # the adapters change the output
    # One adapter for every prompt of a batch; an adapter's path works as its name.
    r = _generate(server, PROMPTS[:2], setup["dirs"]["b"])
    assert [out["output_ids"] for out in r.json()] == [peft_greedy("b", p) for p in PROMPTS[:2]]
    metrics = server.get("/metrics").text
    assert f'engine_lora_requests_total{{lora_name="b",model_name="{MODEL_NAME}"}} 5.0' in metrics, metrics


def test_prefix_is_not_shared_across_adapters(setup: dict[str, Any]) -> None:
    server = setup["server"]
    prompt = [9, 8, 7, 6, 5, 4, 3 + 100, 2 + 100, 1 + 200] * 3
    first = _generate(server, prompt, "a", 1).json()["meta_info"]
    again = _generate(server, prompt, "a", 1).json()["meta_info"]
    other = _generate(server, prompt, "b", 1).json()["meta_info"]
    assert first["cached_tokens"] == 0 and again["cached_tokens"] > 0 and other["cached_tokens"] == 0


def test_openai_client_selects_the_adapter_by_model(setup: dict[str, Any], peft_greedy: Any) -> None:
    import openai

    server = setup["server"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL_NAME, "a", "b"}
    assert models["a"].model_extra["parent"] == MODEL_NAME and models["a"].model_extra["root"] == setup["dirs"]["a"]
    plain = _generate(server, PROMPTS[0], None).json()["text"]
    for model, lora in (("a", "a"), (f"{MODEL_NAME}:b", "b")):
        out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0)
        assert out.model == model and out.choices[0].text == _generate(server, PROMPTS[0], lora).json()["text"]
        assert out.choices[0].text != plain
    with pytest.raises(openai.NotFoundError, match="model 'zz' does not exist"):
        client.chat.completions.create(model="zz", messages=[{"role": "user", "content": "hi"}])


def test_load_use_unload_reload(setup: dict[str, Any], peft_greedy: Any) -> None:
    server = setup["server"]
    c_dir = setup["dirs"]["c"]
    r = server.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": c_dir})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a", "b", "c"}, r.text
    r = _generate(server, [PROMPTS[0], PROMPTS[1]], ["c", "a"])
    assert [o["output_ids"] for o in r.json()] == [peft_greedy("c", PROMPTS[0]), peft_greedy("a", PROMPTS[1])]
    r = server.post("/unload_lora_adapter", json={"lora_name": "c"})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a", "b"}
    r = _generate(server, [PROMPTS[0], PROMPTS[1]], ["a", "c"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path[1]" and "'c'" in r.text
    r = server.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": c_dir})
    assert r.status_code == 200, r.text
    assert _generate(server, PROMPTS[0], "c").json()["output_ids"] == peft_greedy("c", PROMPTS[0])
    # The scheduler's own checks, named: a directory that is no adapter.
    r = server.post("/load_lora_adapter", json={"lora_name": "d", "lora_path": setup["ckpt"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path" and "adapter_config.json" in r.text
    assert "d" not in r.json()["loaded_adapters"]


def test_a_running_request_keeps_its_adapter_through_an_unload(setup: dict[str, Any], peft_greedy: Any) -> None:
    server = setup["server"]
    if "c" not in server.get("/v1/models").text:
        server.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": setup["dirs"]["c"]})
    body = {"input_ids": PROMPTS[2], "lora_path": "c", "stream": True,
            "sampling_params": {"max_new_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}}
    started, events = threading.Event(), []

    def stream() -> None:
        with httpx.stream("POST", server.url + "/generate", json=body, headers=server.headers, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    r = server.post("/unload_lora_adapter", json={"lora_name": "c"})
    at_unload = len(events)
    reader.join(120)
    assert r.status_code == 200 and "c" not in r.json()["loaded_adapters"]
    last = json.loads(events[-1].removeprefix("data: "))
    assert at_unload < len(events), "the request had finished before the unload; nothing was tested"
    assert last["output_ids"] == peft_greedy("c", PROMPTS[2], LONG_TOKENS)
    # Gone for new requests, while the others run on.
    assert _generate(server, PROMPTS[2], "c").status_code == 400
    assert _generate(server, PROMPTS[2], "a").json()["output_ids"] == peft_greedy("a", PROMPTS[2])
