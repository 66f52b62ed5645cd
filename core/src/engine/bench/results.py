"""``--result-file``: every benchmark (``engine bench ...`` and ``scripts/bench_*.py``) appends its
rows to a JSON-lines file, one object per line, so runs of several commands collect in one file."""

from __future__ import annotations

import json
from typing import Any


def append_rows(path: str | None, *rows: dict[str, Any]) -> None:
    """Appends each of ``rows`` as one JSON line to ``path``; does nothing when ``path`` is empty
    (no ``--result-file`` given)."""
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
