"""``one-batch`` with ``--lora-name`` and ``engine bench vision`` on tiny random checkpoints, in
process: the adapters really run (round-robin rows equal each row run alone on its adapter, and
differ from the base model and from another adapter), and the vision bench times an image prompt
whose token counts come from the model's own processor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.bench.one_batch import run_one
from engine.config import ServerArgs
from engine.managers.scheduler import Scheduler


@pytest.fixture(scope="module")
def lora_scheduler(tmp_path_factory: pytest.TempPathFactory) -> Scheduler:
    from transformers import AutoConfig

    from engine.lora.adapter import write_random_adapter
    from engine.testing.checkpoints import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("bench-lora")
    path = make_tiny_checkpoint(str(root / "base"), "LlamaForCausalLM")
    config = AutoConfig.from_pretrained(path)
    targets = ["q_proj", "v_proj", "down_proj"]
    loras = {name: write_random_adapter(config, str(root / name), 8, targets, seed=seed, scale=0.3)
             for seed, name in enumerate(("a", "b"))}
    args = ServerArgs.from_dict({"model_path": path, "max_total_tokens": 4096, "lora_paths": loras})
    return Scheduler(args, path)


def test_lora_names_run_round_robin(lora_scheduler: Scheduler) -> None:
    mixed = run_one(lora_scheduler, 3, 8, 6, seed=2, overlap=False, lora_names=["a", "b"])
    alone = {name: run_one(lora_scheduler, 1, 8, 6, seed=2, overlap=False, lora_names=[name]).output_ids[0]
             for name in ("a", "b")}
    base = run_one(lora_scheduler, 1, 8, 6, seed=2, overlap=False).output_ids[0]
    assert mixed.output_ids[0] == alone["a"]  # row 0 is on "a", row 1 on "b", row 2 on "a"
    assert alone["a"] != base and alone["b"] != alone["a"]
    with pytest.raises(ValueError, match="lora_path 'c': no adapter of that name is loaded"):
        run_one(lora_scheduler, 1, 8, 2, lora_names=["c"])


def test_vision_bench_times_an_image_prompt(tmp_path: Path) -> None:
    from engine_models_qwen2_vl.testing import make_tiny_checkpoint

    from engine.bench.vision import bench_vision

    path = make_tiny_checkpoint(str(tmp_path / "vl"), "Qwen2VLForConditionalGeneration")
    rows = tmp_path / "rows.jsonl"
    result = bench_vision(ServerArgs.from_dict({"model_path": path, "max_total_tokens": 4096}), 2, "56x84", 4, 1,
                          str(rows))
    # Two images of one size: two equal runs of placeholder tokens, inside a longer prompt.
    assert result["image_tokens"] % 2 == 0 and 0 < result["image_tokens"] < result["prompt_tokens"]
    assert min(result["encoder_ms"], result["image_prefill_ms"], result["text_prefill_ms"]) > 0
    assert json.loads(rows.read_text())["bench"] == "vision"
