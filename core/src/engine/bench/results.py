"""``--result-file``: every benchmark (``engine bench ...`` and ``benchmarks/*.py``) appends its
rows to a JSON-lines file, one object per line, so runs of several commands collect in one file.

Each row is stamped with the command that produced it and the UTC date, the fields
``engine bench report`` (docs/benchmarks.md) needs beside the figures."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
from typing import Any


def run_command(argv: list[str] | None = None) -> str:
    """The command line as a user would type it again: ``engine bench ...`` for the CLI (however it
    was started), ``python3 PATH ...`` for a script."""
    argv = list(sys.argv if argv is None else argv)
    prog = os.path.basename(argv[0]) if argv else ""
    if prog == "__main__.py":  # python -m PACKAGE
        package = os.path.basename(os.path.dirname(argv[0]))
        head = ["engine"] if package == "engine" else ["python3", "-m", package]
        return shlex.join([*head, *argv[1:]])
    if prog == "engine":
        return shlex.join(["engine", *argv[1:]])
    if prog.endswith(".py"):
        path = os.path.relpath(argv[0]) if os.path.isabs(argv[0]) else argv[0]
        return shlex.join(["python3", path, *argv[1:]])
    return shlex.join(argv)


def append_rows(path: str | None, *rows: dict[str, Any]) -> None:
    """Appends each of ``rows`` as one JSON line to ``path``, with ``command`` and ``date`` (UTC,
    ``YYYY-MM-DD HH:MM``) added where a row has none; does nothing when ``path`` is empty (no
    ``--result-file`` given)."""
    if not path:
        return
    stamp = {"command": run_command(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")}
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({**row, **{k: v for k, v in stamp.items() if k not in row}}) + "\n")
