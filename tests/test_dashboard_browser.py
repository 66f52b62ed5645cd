"""The live view in a real browser: headless Chromium (Debian's ``chromium`` package, which
scripts/install.sh installs) driven by Playwright's Python API against the session's shared
default-model server. The page loads with no console errors, its charts and in-flight table
update while requests run, and clicking a request shows its timeline; a screenshot is saved
(``$ENGINE_TEST_ARTIFACTS`` or the test's tmp dir; its path is printed)."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_e2e_harness import Server, shared_default_server  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Enough tokens that the requests are still decoding over several feed events on a CPU.
MAX_NEW_TOKENS = 40

playwright_api = pytest.importorskip("playwright.sync_api")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing (scripts/install.sh installs Debian's chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Server:
    return shared_default_server(request.config, tmp_path_factory)


def _generate(server: Server, rid: str, out: dict[str, Any]) -> None:
    r = httpx.post(server.url + "/generate", timeout=300, json={
        "rid": rid, "text": f"Write a long story about a lighthouse keeper number {rid}.",
        "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "min_new_tokens": MAX_NEW_TOKENS}})
    out[rid] = r.status_code


def test_live_view_in_chromium(server: Server, tmp_path: Path) -> None:
    artifacts = Path(os.environ.get("ENGINE_TEST_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    statuses: dict[str, Any] = {}
    rids = [f"browser-{i}" for i in range(3)]
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(server.url + "/dashboard")
            page.wait_for_function("Number(document.body.dataset.events) >= 1", timeout=30_000)
            threads = [threading.Thread(target=_generate, args=(server, rid, statuses)) for rid in rids]
            for t in threads:
                t.start()
            try:
                # The table shows the requests while they run, and the charts saw them.
                page.wait_for_selector("#inflight tbody tr[data-rid^='browser-']", timeout=60_000)
                page.wait_for_function(
                    "JSON.parse(document.getElementById('c-load').dataset.peaks || '[0]')[0] >= 1 && "
                    "JSON.parse(document.getElementById('c-tput').dataset.peaks || '[0,0]')[1] > 0",
                    timeout=60_000)
                page.click("#inflight tbody tr[data-rid^='browser-']")
                page.wait_for_selector("#timeline li[data-stage='prefill_chunk']", timeout=30_000)
                page.wait_for_selector("#timeline li[data-stage='first_token']", timeout=30_000)
                state_text = page.inner_text("#inflight tbody")
                assert "decoding" in state_text or "prefilling" in state_text or "queued" in state_text, state_text
                shot = artifacts / "dashboard.png"
                page.screenshot(path=str(shot), full_page=True)
                print(f"live view screenshot: {shot}")
            finally:
                for t in threads:
                    t.join(timeout=300)
            assert statuses == {rid: 200 for rid in rids}, statuses
            # A finished request stays pickable: its timeline ends with 'finished'.
            page.wait_for_selector(f"#recent tbody tr[data-rid='{rids[0]}']", timeout=30_000)
            page.click(f"#recent tbody tr[data-rid='{rids[0]}']")
            page.wait_for_selector("#timeline li[data-stage='finished']", timeout=30_000)
            points = int(page.get_attribute("#c-ttft", "data-points") or 0)
            peaks = json.loads(page.get_attribute("#c-ttft", "data-peaks") or "[0]")
            assert points >= 3 and peaks[0] > 0, (points, peaks)
        finally:
            browser.close()
    assert not problems, problems
