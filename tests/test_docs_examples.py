"""Every example of the manual runs as written (README.md and docs/**/*.md).

Blocks are collected by tests/docs_blocks.py under the convention described there and in
docs/README.md ("Writing docs"): one test per runnable block, a skip directive's reason as the
skip reason, a page's blocks in order in one temporary directory. A server on the embedded
default model (the session's shared one, ``shared_default_server``) is started on a free port
when the first block that mentions ``127.0.0.1:30000`` / ``localhost:30000`` runs, if no other
module started it already; those addresses and ``OPENAI_BASE_URL`` point at it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from docs_blocks import (  # noqa: E402
    BLOCK_TIMEOUT_S,
    Block,
    Outcome,
    PageRun,
    anchors,
    iter_blocks,
    pages,
    parse_page,
    relative_links,
)
from docs_warm import WarmPython  # noqa: E402
from test_server_e2e_harness import Server, shared_default_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BLOCKS: list[Block] = list(iter_blocks(ROOT))
_OUTPUT_TAIL = 6000


class DocsEnvironment:
    """What the blocks run with: the environment, and the default-model server started on demand."""

    def __init__(self, config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._config = config
        self._tmp_path_factory = tmp_path_factory
        self._server: Server | None = None
        self._start_error: str | None = None
        self._pages: dict[str, PageRun] = {}
        # Python blocks run in forks of one interpreter that imported the engine, torch and
        # transformers once (tests/docs_warm.py): a few CPU-seconds less per block.
        self._python: WarmPython | None = None

    def port(self) -> int:
        if self._start_error is not None:  # one failed start is reported by every block that needs it
            raise RuntimeError(self._start_error)
        if self._server is None:
            # No --model-path: the embedded default model, served as 'default', as the docs show
            # (the session's shared server, which other default-model modules use too).
            try:
                self._server = shared_default_server(self._config, self._tmp_path_factory)
            except RuntimeError as exc:
                self._start_error = f"the default-model server did not start: {exc}"
                raise
        return self._server.port

    def grpc_port(self) -> int:
        """The same server's gRPC port (it serves gRPC where plugserve-grpc is installed)."""
        self.port()
        assert self._server is not None
        if "grpc_port" not in self._server.extra:
            raise RuntimeError("the default-model server serves no gRPC: plugserve-grpc is not installed "
                               "(pip install -e plugins/grpc)")
        return int(self._server.extra["grpc_port"])

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # `python3` and `engine` in a block are this interpreter's, whatever PATH the runner had.
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        if self._server is not None:
            env["OPENAI_BASE_URL"] = f"http://127.0.0.1:{self._server.port}/v1"
            env["OPENAI_API_KEY"] = "none"
        return env

    def page(self, block: Block) -> PageRun:
        if self._python is None:
            self._python = WarmPython(self.env())
        if block.page not in self._pages:
            self._pages[block.page] = PageRun([b for b in BLOCKS if b.page == block.page], self.env, self.port,
                                              self.grpc_port, self._python.run)
        return self._pages[block.page]

    def close(self) -> None:
        for run in self._pages.values():
            run.close()
        if self._python is not None:
            self._python.close()


@pytest.fixture(scope="module")
def docs_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocsEnvironment]:
    environment = DocsEnvironment(request.config, tmp_path_factory)
    try:
        yield environment
    finally:
        environment.close()


def _params() -> list[object]:
    # The block's place goes with the reason: pytest reports every skip at this test function.
    return [pytest.param(b, id=b.id, marks=[pytest.mark.skip(reason=f"{b.skip} [{b.id}]")] if b.skip else [])
            for b in BLOCKS if b.runs]


@pytest.mark.parametrize("block", _params())
def test_doc_example_runs(block: Block, docs_env: DocsEnvironment) -> None:
    run = docs_env.page(block)
    result = run.result(run.blocks.index(block))
    if isinstance(result, str):
        pytest.skip(result)
    assert isinstance(result, Outcome)
    if result.returncode != 0:
        state = f"timed out after {BLOCK_TIMEOUT_S:.0f} s" if result.timed_out else f"exited with status {result.returncode}"
        pytest.fail(f"{block.id} ({block.lang}) {state}\n--- block ---\n{block.text}"
                    f"--- output (tail) ---\n{result.output[-_OUTPUT_TAIL:]}", pytrace=False)


def test_the_convention_is_checked(tmp_path: Path) -> None:
    """The collector sees what it must: languages, directives, indentation, console commands."""
    from docs_blocks import DocBlockError, console_script, run_block

    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "p.md"
    page.write_text("text\n\n<!-- doc-test: skip needs a CUDA GPU -->\n```bash\nnvidia-smi\n```\n\n"
                    "<!-- doc-test: file a.yaml -->\n```yaml\nport: 1\n```\n\n```json\n{}\n```\n\n"
                    "- item\n\n  ```console\n  $ echo one \\\n    two\n  one two\n  ```\n")
    blocks = parse_page(page, tmp_path)
    assert [(b.line, b.lang, b.skip, b.file) for b in blocks] == [
        (4, "bash", "needs a CUDA GPU", None), (9, "yaml", None, "a.yaml"), (19, "console", None, None)]
    assert console_script(blocks[2].text) == "echo one \\\n  two\n"
    failing = Block("docs/p.md", 1, "python", "raise SystemExit(3)\n", None, None)
    assert run_block(failing, failing.text, tmp_path, dict(os.environ)).returncode == 3
    bash = Block("docs/p.md", 2, "bash", "false | true\n", None, None)
    assert run_block(bash, bash.text, tmp_path, dict(os.environ)).returncode == 1  # pipefail is on
    page.write_text("# The `Engine` API, step 2\n\nSee [x](other.md#a-b) and [y](https://x.org/#z).\n"
                    "```bash\n# not a heading [z](in-code.md)\n```\n")
    assert anchors(page) == {"the-engine-api-step-2"}
    assert relative_links(page) == ["other.md#a-b"]
    page.write_text("<!-- doc-test: skip -->\n```bash\ntrue\n```\n")
    with pytest.raises(DocBlockError, match="needs a reason"):
        parse_page(page, tmp_path)
    page.write_text("<!-- doc-test: skip needs a GPU -->\n\n```bash\ntrue\n```\n")
    with pytest.raises(DocBlockError, match="right before a code fence"):
        parse_page(page, tmp_path)
    page.write_text("```python\nprint(1)\n")
    with pytest.raises(DocBlockError, match="never closed"):
        parse_page(page, tmp_path)


def test_the_index_leads_to_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    pages_ = [p.relative_to(ROOT / "docs").as_posix() for p in sorted((ROOT / "docs").rglob("*.md"))
              if p != ROOT / "docs" / "README.md"]
    missing = [rel for rel in pages_ if f"]({rel}" not in index]
    assert not missing, f"docs/README.md links no page {missing}; add each to its table"


def test_relative_links_resolve() -> None:
    broken: list[str] = []
    for page in pages(ROOT):
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading gives #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)
