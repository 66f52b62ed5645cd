"""Qwen2-VL decode steps replayed from CUDA graphs carry M-RoPE positions: on a tiny random
checkpoint, a batch mixing image chats (whose positions after the prompt are offset by the
image's delta) and text prompts gives the same greedy output with graphs as without."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from engine_models_qwen2_vl.testing import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def png(seed: int, height: int, width: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_decode_graphs_follow_mrope_positions(tmp_path) -> None:
    from engine.entrypoints.engine import Engine

    directory = make_tiny_checkpoint(str(tmp_path / "vl"), "Qwen2VLForConditionalGeneration")
    prompts = [f"{IMAGE}What is this?", "Hello there, how", f"Look: {IMAGE} and say", "Count: one two"]
    images = [png(1, 112, 84), None, png(2, 56, 140), None]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    outputs, graph_sizes = {}, {}
    for graphs in (True, False):
        with Engine(model_path=directory, attention="triton", disable_cuda_graph=not graphs,
                    log_level="warning") as engine:
            graph_sizes[graphs] = engine.get_server_info()["cuda_graph_batch_sizes"]
            outs = engine.generate(prompts, params, image_data=images)
            outputs[graphs] = [o["output_ids"] for o in outs]
    assert graph_sizes[True], "the M-RoPE model captured no decode graphs"
    assert not graph_sizes[False]
    assert outputs[True] == outputs[False]
