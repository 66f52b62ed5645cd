"""engine bench's LoRA and image workloads, without a server or a model: the --lora-name flag
(several values after one flag, checked against --lora-paths), adapter picks and payloads, the
image dataset and its chat payload, the prompt length an image request takes from the server's
usage, random-lora's adapters, and where the report puts their rows."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from engine.bench.backends import BACKENDS, RequestOptions, send_request
from engine.bench.images import parse_resolution, sample_image_requests
from engine.bench.report import complete_row, infer_area
from engine.bench.requests import BenchRequest
from engine.bench.serving import build_requests
from engine.bench.serving_args import BenchServingArgs
from engine.cli import app
from engine.cli_args import split_multi_value_flags

OPTS = RequestOptions(model="base", stream=True, ignore_eos=True, extra_body={}, headers={})


def test_lora_name_takes_several_values_after_one_flag() -> None:
    argv = ["bench", "one-batch", "--lora-name", "a", "b", "c", "--batch-size", "1"]
    assert split_multi_value_flags(argv) == ["bench", "one-batch", "--lora-name", "a", "--lora-name", "b",
                                             "--lora-name", "c", "--batch-size", "1"]


def test_payloads_name_the_adapter() -> None:
    req = BenchRequest([1, 2, 3], 3, 4, lora_name="sql")
    assert BACKENDS["engine"].build_payload(req, OPTS)["lora_path"] == "sql"
    assert BACKENDS["openai"].build_payload(req, OPTS)["model"] == "sql"
    plain = BenchRequest([1, 2, 3], 3, 4)
    assert "lora_path" not in BACKENDS["engine"].build_payload(plain, OPTS)
    assert BACKENDS["openai"].build_payload(plain, OPTS)["model"] == "base"


def test_each_request_picks_an_adapter_seeded(word_tokenizer: Any) -> None:
    args = BenchServingArgs(num_prompts=40, random_input_len=8, random_output_len=4, lora_name=["a", "b", "c"],
                            seed=3)
    picks = [r.lora_name for r in build_requests(args, word_tokenizer)]
    assert set(picks) == {"a", "b", "c"}
    assert picks == [r.lora_name for r in build_requests(args, word_tokenizer)]
    with pytest.raises(ValueError, match="--lora-name"):
        BenchServingArgs(lora_name=[])


def test_image_dataset_sends_distinct_images_through_chat(word_tokenizer: Any) -> None:
    from PIL import Image

    reqs = sample_image_requests(3, 2, "40x24", "png", 6, 5, 1.0, 1, word_tokenizer)
    assert len(reqs) == 3 and all(len(r.images) == 2 for r in reqs)
    assert len({url for r in reqs for url in r.images}) == 6
    head, data = reqs[0].images[0].split(",", 1)
    assert head == "data:image/png;base64"
    assert Image.open(io.BytesIO(base64.b64decode(data))).size == (40, 24)
    content = BACKENDS["openai-chat"].build_payload(reqs[0], OPTS)["messages"][0]["content"]
    assert [p["type"] for p in content] == ["image_url", "image_url", "text"]
    assert content[2]["text"] == reqs[0].prompt and len(reqs[0].prompt.split()) == 6


@pytest.mark.parametrize("call, message", [
    (lambda tok: sample_image_requests(1, 1, "1024", "png", 4, 4, 0.0, 1, tok), "--image-resolution"),
    (lambda tok: sample_image_requests(1, 1, "8x8", "gif", 4, 4, 0.0, 1, tok), "--image-format: invalid value 'gif'"),
    (lambda tok: sample_image_requests(1, 0, "8x8", "png", 4, 4, 0.0, 1, tok), "--image-count: invalid value 0"),
    (lambda tok: sample_image_requests(1, 1, "8x8", "png", 4, 4, 0.0, 1, None), "needs a tokenizer"),
    (lambda tok: BenchServingArgs(dataset_name="image", backend="engine"), "accepted --backend: openai-chat"),
])
def test_image_dataset_errors_name_the_flag(word_tokenizer: Any, call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(word_tokenizer)


def test_parse_resolution() -> None:
    assert parse_resolution("1024x768") == (1024, 768)


def test_image_request_takes_its_prompt_length_from_the_server() -> None:
    events = [{"choices": [{"delta": {"content": "hi"}}]},
              {"choices": [], "usage": {"prompt_tokens": 1400, "completion_tokens": 1}}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    async def run(req: BenchRequest) -> Any:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://x", BACKENDS["openai-chat"], req, OPTS)

    with_image = asyncio.run(run(BenchRequest("look", 1, 1, images=["data:image/png;base64,AA=="])))
    assert with_image.success and with_image.prompt_len == 1400 and with_image.output_len == 1
    assert asyncio.run(run(BenchRequest("look", 1, 1))).prompt_len == 1  # text: the client's count stands


def test_random_lora_writes_loadable_adapters(tmp_path: Path) -> None:
    import torch

    from engine.lora.adapter import load_adapter

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 64}))
    out = CliRunner().invoke(app, ["bench", "random-lora", "--model-path", str(model), "--output",
                                   str(tmp_path / "a"), "--rank", "4", "--num", "2", "--targets", "q_proj down_proj"])
    assert out.exit_code == 0, out.output
    words = out.output.split()
    assert words == [f"lora0={tmp_path / 'a' / 'lora0'}", f"lora1={tmp_path / 'a' / 'lora1'}"]
    adapter = load_adapter("lora1", str(tmp_path / "a" / "lora1"), torch.float32)
    assert adapter.config.rank == 4 and set(adapter.config.target_modules) == {"q_proj", "down_proj"}
    bad = CliRunner().invoke(app, ["bench", "random-lora", "--model-path", str(model), "--output", str(tmp_path),
                                   "--targets", "lm_head"])
    assert bad.exit_code == 2 and "--targets: invalid value 'lm_head'" in bad.output


def test_lora_name_must_be_a_loaded_adapter(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["bench", "one-batch", "--model-path", str(tmp_path), "--lora-name", "x"])
    assert out.exit_code == 2
    assert "--lora-name: invalid value 'x'; accepted: the --lora-paths adapters: none" in out.output


def test_one_batch_refuses_more_adapters_than_slots(tmp_path: Path) -> None:
    paths = [f"a{i}={tmp_path}" for i in range(3)]
    argv = ["bench", "one-batch", "--model-path", str(tmp_path), "--lora-paths", *paths, "--max-loras-per-batch", "2",
            "--lora-name", "a0", "a1", "a2", "--batch-size", "1 4"]
    out = CliRunner().invoke(app, split_multi_value_flags(argv))
    assert out.exit_code == 2, out.output
    assert "--lora-name: 3 distinct adapters in a batch of 4; accepted: at most --max-loras-per-batch (2)" in out.output


def test_one_batch_counts_the_adapters_the_largest_batch_uses(tmp_path: Path) -> None:
    # Round-robin: a batch of 2 runs a0, a0 (one adapter), within --max-loras-per-batch 1; the run
    # then stops at the next check, the missing --json-schema file.
    argv = ["bench", "one-batch", "--model-path", str(tmp_path), "--lora-paths", f"a0={tmp_path}", f"a1={tmp_path}",
            "--max-loras-per-batch", "1", "--lora-name", "a0", "a0", "a1", "--batch-size", "1 2",
            "--json-schema", str(tmp_path / "missing.json")]
    out = CliRunner().invoke(app, split_multi_value_flags(argv))
    assert out.exit_code == 2, out.output
    assert "distinct adapters" not in out.output and "--json-schema: cannot read" in out.output, out.output


def test_report_places_lora_and_vision_rows() -> None:
    base = {"bench": "one-batch", "device": "cuda:0 NVIDIA H200 (sm_90)", "date": "2026-11-28", "command": "c",
            "attention": "triton", "batch_size": 64, "input_len": 128, "output_len": 128, "model_path": "m",
            "median_decode_latency_s": 0.007, "median_decode_throughput": 9000.0}
    lora = complete_row({**base, "lora_adapters": 8, "lora_rank": 16, "lora_backend": "triton"}, "t:1")
    assert lora["area"] == "lora" and lora["config"].endswith("8 rank-16 LoRA adapters (triton)")
    assert infer_area(base) == "decode"
    vision = complete_row({"bench": "vision", "device": "d", "date": "2026-11-28", "command": "c",
                           "model_path": "q", "image_count": 1, "image_resolution": "1024x1024",
                           "prompt_tokens": 1461, "image_tokens": 1369, "encoder_ms": 47.8,
                           "image_prefill_ms": 89.3, "text_prefill_ms": 49.1, "encoder_share": 0.54}, "t:2")
    assert vision["area"] == "vlm" and "1369 of images" in vision["config"]
    assert infer_area({"bench": "serving", "dataset_name": "image"}) == "vlm"
