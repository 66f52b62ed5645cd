"""``append_rows``: the ``--result-file`` writer every benchmark shares."""

from __future__ import annotations

import json
import pathlib

from engine.bench.results import append_rows


def test_rows_append_as_json_lines(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "r.jsonl"
    append_rows(str(path), {"a": 1})
    append_rows(str(path), {"b": [2, 3]}, {"c": "x"})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"a": 1}, {"b": [2, 3]}, {"c": "x"}]


def test_no_path_writes_nothing(tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    append_rows(None, {"a": 1})
    append_rows("", {"a": 1})
    assert list(tmp_path.iterdir()) == []
