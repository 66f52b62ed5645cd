"""Fenced code blocks of the Markdown manual, and how tests/test_docs_examples.py runs them
(this module holds no tests).

The convention (documented for authors in docs/README.md, "Writing docs"):

- every fenced block whose info string starts with ``bash``, ``sh``, ``console`` or ``python`` in
  README.md and docs/**/*.md is an example that runs, in page order;
- ``<!-- doc-test: skip REASON -->`` on the line right before the opening fence keeps a block from
  running (the reason is required and shows up as the pytest skip reason);
- ``<!-- doc-test: file NAME -->`` on that line writes the block's text (any language) to NAME in the
  page's working directory instead of running it, for the page's later blocks;
- a ``console`` block runs only its ``$ `` lines (and their ``\\`` continuations); the rest is output.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

RUNNABLE = ("bash", "sh", "console", "python")
BLOCK_TIMEOUT_S = 180.0
# Addresses of the documented default server; the test points them at its own server's port.
DEFAULT_ADDRESSES = ("127.0.0.1:30000", "localhost:30000")
# The same server's gRPC address (``--grpc-port 50051`` in docs/grpc.md), moved likewise.
GRPC_ADDRESSES = ("127.0.0.1:50051", "localhost:50051")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doc-test:(?P<body>.*?)-->\s*$")


class DocBlockError(ValueError):
    """A page breaks the convention (an unclosed fence, a directive without its argument...)."""


@dataclass(frozen=True)
class Block:
    page: str             # path relative to the repository root, with forward slashes
    line: int             # 1-based line of the opening fence
    lang: str             # first word of the info string, lower case ('' when there is none)
    text: str             # the block's content, the fence's indentation removed
    skip: str | None      # the reason given by a skip directive
    file: str | None      # the NAME of a file directive

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        """Whether the block is an example that runs (when not skipped)."""
        return self.file is None and self.lang in RUNNABLE

    def needs_server(self) -> bool:
        return self.runs and self.skip is None and any(a in self.text for a in DEFAULT_ADDRESSES + GRPC_ADDRESSES)


def pages(root: Path) -> list[Path]:
    """README.md first, then docs/README.md, then every other page of docs/ in path order."""
    docs = sorted((root / "docs").rglob("*.md"), key=lambda p: (p.name != "README.md", p.as_posix()))
    return [root / "README.md", *docs]


def parse_page(path: Path, root: Path) -> list[Block]:
    """Every fenced block of one page that the convention concerns: runnable ones and file ones.

    Raises:
        DocBlockError: an unclosed fence or a malformed directive, naming the page and line.
    """
    rel = path.relative_to(root).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            # A directive acts on the fence right below it; anywhere else it would be ignored silently.
            if _DIRECTIVE.match(lines[i]) and not (i + 1 < len(lines) and _FENCE.match(lines[i + 1])):
                raise DocBlockError(f"{rel}:{i + 1}: a doc-test directive must be the line right before "
                                    "a code fence")
            i += 1
            continue
        start, indent, fence = i, len(m["indent"]), m["fence"]
        lang = (m["info"].strip().split() or [""])[0].lower()
        body: list[str] = []
        i += 1
        while i < len(lines):
            stripped = lines[i].strip()
            if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
                break
            line = lines[i]
            body.append(line[min(indent, len(line) - len(line.lstrip())):])
            i += 1
        else:
            raise DocBlockError(f"{rel}:{start + 1}: the code fence {fence} is never closed")
        i += 1
        skip, file = _directive(lines[start - 1] if start else "", rel, start + 1)
        block = Block(rel, start + 1, lang, "\n".join(body) + "\n", skip, file)
        if block.file is not None or block.lang in RUNNABLE:
            blocks.append(block)
    return blocks


def _directive(line: str, page: str, fence_line: int) -> tuple[str | None, str | None]:
    m = _DIRECTIVE.match(line)
    if not m:
        return None, None
    verb, _, arg = m["body"].strip().partition(" ")
    arg = arg.strip()
    where = f"{page}:{fence_line - 1}"
    if verb == "skip":
        if not arg:
            raise DocBlockError(f"{where}: doc-test skip needs a reason: <!-- doc-test: skip REASON -->")
        return arg, None
    if verb == "file":
        name = PurePosixPath(arg)
        if not arg or name.is_absolute() or ".." in name.parts:
            raise DocBlockError(f"{where}: doc-test file: invalid NAME {arg!r}; accepted: a relative path "
                                "inside the page's working directory")
        return None, arg
    raise DocBlockError(f"{where}: unknown doc-test directive {verb!r}; accepted: skip REASON, file NAME")


def console_script(text: str) -> str:
    """The commands of a ``console`` block: its ``$ `` lines and the lines continuing them."""
    commands: list[str] = []
    continued = False
    for line in text.splitlines():
        if continued:
            commands.append(line)
        elif line.startswith("$ "):
            commands.append(line[2:])
        else:
            continue
        continued = line.rstrip().endswith("\\")
    return "\n".join(commands) + "\n"


def point_at(text: str, port: int | None, grpc_port: int | None = None) -> str:
    """``text`` with the default server's address moved to ``port`` and its gRPC address to
    ``grpc_port`` (each unchanged when None)."""
    for addresses, to in ((DEFAULT_ADDRESSES, port), (GRPC_ADDRESSES, grpc_port)):
        if to is not None:
            for address in addresses:
                text = text.replace(address, f"{address.split(':')[0]}:{to}")
    return text


@dataclass
class Outcome:
    returncode: int
    output: str
    timed_out: bool = False


# Runs a python block's file as ``python3 FILE`` would: (script, cwd, env, timeout) -> (status,
# output, timed out). tests/docs_warm.py's WarmPython.run is one.
PythonRunner = Callable[[Path, Path, dict[str, str], float], tuple[int, str, bool]]


def run_block(block: Block, text: str, cwd: Path, env: dict[str, str],
              timeout: float = BLOCK_TIMEOUT_S, python: PythonRunner | None = None) -> Outcome:
    """Runs one block (``python3`` for python, or ``python`` when given; ``bash -euo pipefail``
    otherwise) in ``cwd``.

    The block runs in its own process group, which is killed afterwards, so a block that leaves
    a process behind (or overruns its time) cannot hold a port or a core for the next one.
    """
    if block.lang == "python":
        script, argv = cwd / f".block-{block.line}.py", ["python3"]
        if python is not None:
            script.write_text(text, encoding="utf-8")
            return Outcome(*python(script, cwd, env, timeout))
    else:
        script, argv = cwd / f".block-{block.line}.sh", ["bash", "-euo", "pipefail"]
        if block.lang == "console":
            text = console_script(text)
    script.write_text(text, encoding="utf-8")
    proc = subprocess.Popen([*argv, script.name], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        out, _ = proc.communicate()
    _kill_group(proc.pid)
    return Outcome(proc.returncode, out.decode(errors="replace"), timed_out)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class PageRun:
    """One page's blocks run in order in one temporary directory, each at most once.

    A test item for block k asks for ``result(k)``: the blocks before it run first if this process
    has not run them yet, so the page's state is right however pytest orders or distributes items.
    """

    def __init__(self, blocks: list[Block], env: Callable[[], dict[str, str]],
                 port: Callable[[], int], grpc_port: Callable[[], int] | None = None,
                 python: PythonRunner | None = None) -> None:
        self.blocks = blocks
        self._python = python
        self._env, self._port, self._grpc_port = env, port, grpc_port
        self._dir = tempfile.TemporaryDirectory(prefix="doc-page-")
        self.cwd = Path(self._dir.name)
        self._results: dict[int, Outcome | str | None] = {}  # index -> outcome, skip reason, or None
        self._next = 0
        self._failed: Block | None = None

    def close(self) -> None:
        self._dir.cleanup()

    def result(self, index: int) -> Outcome | str | None:
        """The outcome of block ``index``, or why it did not run."""
        while self._next <= index:
            self._results[self._next] = self._step(self.blocks[self._next])
            self._next += 1
        return self._results[index]

    def _step(self, block: Block) -> Outcome | str | None:
        if self._failed is not None:
            return f"not run: the earlier block {self._failed.id} failed"
        port = self._port() if any(a in block.text for a in DEFAULT_ADDRESSES) and block.skip is None else None
        grpc = (self._grpc_port() if self._grpc_port is not None and block.skip is None
                and any(a in block.text for a in GRPC_ADDRESSES) else None)
        text = point_at(block.text, port, grpc)
        if block.file is not None:
            target = self.cwd / block.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            return None
        if block.skip is not None:
            return block.skip
        outcome = run_block(block, text, self.cwd, self._env(), python=self._python)
        if outcome.returncode != 0:
            self._failed = block
        return outcome


_HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$")
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def prose_lines(path: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    out: list[str] = []
    fence = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _FENCE.match(line)
        if m and (not fence or (m["fence"][0] == fence[0] and len(m["fence"]) >= len(fence)
                                and not m["info"].strip())):
            fence = "" if fence else m["fence"]
            continue
        if not fence:
            out.append(line)
    return out


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the page's headings (lower case, punctuation dropped, spaces as -)."""
    found: set[str] = set()
    for line in prose_lines(path):
        m = _HEADING.match(line)
        if m:
            found.add(re.sub(r"[^\w\- ]", "", m["title"].lower()).replace(" ", "-"))
    return found


def relative_links(path: Path) -> list[str]:
    """Link targets of the page's prose that are not URLs (``other.md#anchor``, ``#anchor``, ``dir/``)."""
    return [m["target"] for line in prose_lines(path) for m in _LINK.finditer(line)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", m["target"])]


def iter_blocks(root: Path) -> Iterator[Block]:
    for page in pages(root):
        yield from parse_page(page, root)
