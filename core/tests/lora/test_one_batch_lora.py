"""``engine bench one-batch --lora-name``: what a run reports (the printed line and the result row)
is what its batch ran: the adapters the rows were attached to, counted once each, and the largest
rank among them, for batches smaller than, equal to and larger than the list of names (a name
given twice included)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.bench.one_batch import bench_one_batch, lora_rows
from engine.config import ServerArgs
from engine.managers.scheduler import Scheduler

RANKS = {"a": 4, "b": 8, "c": 16}
NAMES = ["a", "a", "b", "c"]


def test_lora_rows_follow_the_round_robin() -> None:
    assert lora_rows(None, 4) == {} and lora_rows([], 4) == {}
    assert lora_rows(NAMES, 1) == {"a": 1}
    assert lora_rows(NAMES, 2) == {"a": 2}
    assert lora_rows(NAMES, 6) == {"a": 4, "b": 1, "c": 1}
    assert lora_rows(["x", "y"], 5) == {"x": 3, "y": 2}


def test_reported_adapters_are_the_ones_attached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoConfig

    from engine.lora.adapter import write_random_adapter
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / "base"), "LlamaForCausalLM")
    config = AutoConfig.from_pretrained(path)
    loras = {name: write_random_adapter(config, str(tmp_path / name), r, ["q_proj", "v_proj"], seed=r)
             for name, r in RANKS.items()}
    attached: list[str] = []
    original = Scheduler._attach_lora

    def attach(self: Scheduler, req: Any, name: str | None) -> str | None:
        attached.append(name)
        return original(self, req, name)

    monkeypatch.setattr(Scheduler, "_attach_lora", attach)
    rows_file = tmp_path / "rows.jsonl"
    sizes = [1, 2, 3, 6]
    args = ServerArgs.from_dict({"model_path": path, "max_total_tokens": 4096, "lora_paths": loras,
                                 "max_lora_rank": 32})
    bench_one_batch(args, sizes, [6], [2], str(rows_file), warmup=False, lora_names=NAMES)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("batch ")]
    assert len(rows) == len(printed) == len(sizes)
    start = 0
    for bs, row, line in zip(sizes, rows, printed, strict=True):
        ran = attached[start : start + bs]
        start += bs
        used = list(dict.fromkeys(ran))
        assert row["batch_size"] == bs and row["lora_names"] == used and row["lora_adapters"] == len(used)
        assert row["lora_rank"] == max(RANKS[n] for n in used) and row["lora_slot_rank"] == 32
        assert f"(LoRA: {len(used)} adapter{'s' if len(used) > 1 else ''} {', '.join(used)}, round-robin:" in line
    assert attached == ["a"] + ["a", "a"] + ["a", "a", "b"] + ["a", "a", "b", "c", "a", "a"]
    assert [r["lora_adapters"] for r in rows] == [1, 1, 2, 3]  # min(names, batch) said 1, 2, 3, 4
    assert printed[-1].endswith("round-robin: 1-4 rows each)")


def test_offline_row_counts_the_adapters_its_prompts_ran(tmp_path: Path) -> None:
    """``engine bench offline --lora-name``: prompt ``i`` runs on ``names[i % len]``; the row counts
    the distinct adapters that ran and the largest rank among them, not every name given."""
    from transformers import AutoConfig

    from engine.bench.offline import _lora_fields
    from engine.lora.adapter import write_random_adapter
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / "base"), "LlamaForCausalLM")
    config = AutoConfig.from_pretrained(path)
    loras = {name: write_random_adapter(config, str(tmp_path / name), r, ["q_proj", "v_proj"], seed=r)
             for name, r in RANKS.items()}
    args = ServerArgs.from_dict({"model_path": path, "lora_paths": loras, "max_lora_rank": 32})
    assert _lora_fields(args, NAMES, 2) == {"lora_adapters": 1, "lora_rank": 4}
    assert _lora_fields(args, NAMES, 3) == {"lora_adapters": 2, "lora_rank": 8}
    assert _lora_fields(args, NAMES, 100) == {"lora_adapters": 3, "lora_rank": 16}
