"""Plain-text tables for the CLI that fit ``TABLE_WIDTH`` columns: the last column wraps.

Kept apart from the commands so listing plugins needs nothing beyond the registry's metadata.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.plugin_registry import PluginInfo

#: Columns a table may take: readable in a default terminal and in a pasted issue.
TABLE_WIDTH = 100
_GAP = "  "
#: The wrapped last column keeps at least this many columns, however wide the others are.
_MIN_LAST = 24


def render_table(header: Sequence[str], rows: Iterable[Sequence[str]], width: int = TABLE_WIDTH) -> str:
    """Left-aligned columns; the last one wraps onto continuation lines so no line passes ``width``.

    The other columns keep their full text (names, versions); a table whose fixed columns alone
    pass ``width`` still gives its last column ``_MIN_LAST`` columns.
    """
    table = [tuple(header)] + [tuple(row) for row in rows]
    fixed = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    indent = sum(fixed) + len(_GAP) * len(fixed)
    last_width = max(_MIN_LAST, width - indent)
    lines = []
    for row in table:
        head = _GAP.join(cell.ljust(w) for cell, w in zip(row[:-1], fixed, strict=True)) + (_GAP if fixed else "")
        parts = wrap_cell(row[-1], last_width)
        lines.append((head + parts[0]).rstrip())
        lines.extend((" " * indent + part).rstrip() for part in parts[1:])
    return "\n".join(lines)


def wrap_cell(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width``, broken after ``;`` or ``,`` where it can be, so a
    ``kind: name`` pair stays on one line; a part longer than ``width`` wraps at its spaces, and a
    word longer than ``width`` (a URL) stays whole."""
    lines: list[str] = []
    for unit in re.split(r"(?<=[;,]) ", text):
        if lines and len(lines[-1]) + 1 + len(unit) <= width:
            lines[-1] += " " + unit
        elif len(unit) <= width:
            lines.append(unit)
        else:
            lines.extend(textwrap.wrap(unit, width, break_on_hyphens=False, break_long_words=False))
    return lines or [""]


def frontend_infos() -> list[PluginInfo]:
    """The installed frontends (entry points in ``engine.frontends``: plugserve-grpc), as plugins
    registering kind ``frontend``. They are not in the hook registry: the server loads one only when
    its flag is set (``--grpc-port``), so listing reads their metadata and imports nothing."""
    from engine.plugin_registry import PluginInfo
    from engine.preflight import frontend_entry_points

    infos = []
    for ep in frontend_entry_points():
        dist = ep.dist
        infos.append(PluginInfo(name=ep.name, distribution=dist.name if dist else "?",
                                version=dist.version if dist else "?", kinds={"frontend": [ep.name]}))
    return infos


def plugin_rows(infos: Iterable[PluginInfo], verbose: bool = False) -> list[tuple[str, str, str, str, str]]:
    """``engine plugins list`` rows: name, distribution, version, status, registrations.

    Options a plugin registers are counted (``options: 8``) unless ``verbose`` names them; a broken plugin's
    status carries its error (wrapped with the last column when long).
    """
    rows = []
    for info in infos:
        kinds = dict(sorted(info.kinds.items()))
        options = kinds.pop("option", []) if not verbose else []
        registers = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in kinds.items())
        if options:
            count = f"options: {len(options)}"
            registers = f"{registers}; {count}" if registers else count
        status = info.status
        if info.status != "ok" and info.error:
            # The error is long (an exception's text): it goes under REGISTERS, which wraps.
            problem = f"{info.status}: {info.error}"
            registers = f"{registers}; {problem}" if registers else problem
        rows.append((info.name, info.distribution, info.version, status, registers or "-"))
    return rows
