"""``append_rows``: the ``--result-file`` writer every benchmark shares."""

from __future__ import annotations

import json
import pathlib
import re
import sys

from engine.bench.results import append_rows, run_command


def test_rows_append_as_json_lines(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "r.jsonl"
    append_rows(str(path), {"a": 1})
    append_rows(str(path), {"b": [2, 3]}, {"c": "x"})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k not in ("command", "date")} for r in rows] == [{"a": 1}, {"b": [2, 3]},
                                                                                          {"c": "x"}]


def test_rows_carry_their_command_and_utc_date_unless_they_name_their_own(tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/usr/bin/engine", "bench", "one-batch", "--batch-size", "1 64"])
    path = tmp_path / "r.jsonl"
    append_rows(str(path), {"a": 1}, {"a": 2, "date": "2026-11-22", "command": "by hand"})
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first["command"] == "engine bench one-batch --batch-size '1 64'"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}", first["date"])
    assert (second["date"], second["command"]) == ("2026-11-22", "by hand")


def test_run_command_spells_scripts_and_the_cli_as_typed() -> None:
    assert run_command(["/x/lib/python3/site-packages/engine/__main__.py", "bench", "spec"]) == "engine bench spec"
    assert run_command(["/x/site-packages/pytest/__main__.py", "-q", "t.py"]) == "python3 -m pytest -q t.py"
    assert run_command(["benchmarks/bench_moe_small.py", "--tokens", "1", "2"]) == (
        "python3 benchmarks/bench_moe_small.py --tokens 1 2")


def test_no_path_writes_nothing(tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    append_rows(None, {"a": 1})
    append_rows("", {"a": 1})
    assert list(tmp_path.iterdir()) == []
