"""`ratchet dashboard` in a real browser (Debian's chromium, driven by Playwright): the page
loads offline, shows the generations plot, and a person promotes a verified skill."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ratchet.flows.runtime import open_library
from tests.conftest import _free_port, stop_process_group
from tests.dashboard_data import build

pytestmark = pytest.mark.integration
RATCHET = Path(sys.executable).parent / "ratchet"


def chromium() -> str:
    found = os.environ.get("RATCHET_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail("no chromium on PATH: ./install.sh installs Debian's chromium (or set RATCHET_CHROMIUM)")
    return found


@pytest.fixture
def dashboard(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`ratchet dashboard` as a person starts it, on a data dir two generations old."""
    settings = build(tmp_path / "data").settings
    port = _free_port()
    log = (tmp_path / "dashboard.log").open("w")
    cmd = [str(RATCHET), "--data-dir", str(settings.data_dir), "--evolution", "nightly"]
    proc = subprocess.Popen(
        [*cmd, "dashboard", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/api/skills", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "dashboard.log").read_text()
            assert time.monotonic() < deadline, "the dashboard did not answer in 120 s"
            time.sleep(0.5)
        yield url, settings.data_dir
    finally:
        stop_process_group(proc)
        log.close()


def test_promote_a_verified_skill_in_the_browser(dashboard: tuple[str, Path]) -> None:
    from playwright.sync_api import expect, sync_playwright

    url, data_dir = dashboard
    expect.set_options(timeout=30_000)  # a shared 2-core machine
    requested: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("request", lambda r: requested.append(r.url))
            page.goto(url)

            expect(page.locator("#success-plot svg")).to_be_visible()
            expect(page.locator("#generation-table tbody tr")).to_have_count(2)
            row = page.locator('tr[data-kind="skills"][data-candidate="take-coin-first"]')
            expect(row.locator("td.status")).to_have_text("verified")

            # a reason is required before anything changes
            row.locator('button[data-action="promote"]').click()
            expect(page.locator("#decision-message")).to_contain_text("Say why first")
            expect(row.locator("td.status")).to_have_text("verified")

            page.fill("#who", "ann")
            page.fill("#why", "repairs 5 coin tasks for 1 regression")
            row.locator('button[data-action="promote"]').click()
            expect(row.locator("td.status")).to_have_text("promoted")
            expect(row.locator("button")).to_have_text(["Retire"])
            expect(page.locator("#decision-message")).to_contain_text("verified → promoted")

            # another tab still shows it verified: its Reject is a conflict, not a second change
            stale = browser.new_page()
            stale.goto(url)  # fresh: shows promoted; make it stale by hand as a slow person would be
            stale_row = stale.locator('tr[data-kind="skills"][data-candidate="take-coin-first"]')
            stale_row.evaluate("r => { r.dataset.status = 'verified' }")
            stale.fill("#why", "no")
            stale_row.evaluate(
                "r => { r.querySelector('td.actions').innerHTML = "
                '\'<button type="button" data-action="reject">Reject</button>\' }'
            )
            stale_row.locator('button[data-action="reject"]').click()
            expect(stale.locator("#decision-message")).to_contain_text("is promoted, not verified")
            expect(stale_row.locator("td.status")).to_have_text("promoted")

            page.reload()
            expect(page.locator("#champion-history")).to_contain_text("take-coin-first")
            expect(page.locator("#champion-history")).to_contain_text("ann")
        finally:
            browser.close()

    # the change went through the library: on disk, audited once, with who and why
    settings_dir = data_dir
    from ratchet.config import load_settings

    library = open_library(load_settings({"data_dir": settings_dir, "evolution": "nightly"}))
    assert library.get("take-coin-first").status == "promoted"
    promoted = [r for r in library.history("take-coin-first") if r.to_status == "promoted"]
    assert [(r.who, r.why) for r in promoted] == [("ann", "repairs 5 coin tasks for 1 regression")]
    assert [r.to_status for r in library.history("take-coin-first")][-1] == "promoted"
    # offline: the page asked nothing of any other host
    elsewhere = [u for u in requested if not u.startswith(url)]
    assert requested and not elsewhere, elsewhere


def test_move_the_champion_adapter_in_the_browser(dashboard: tuple[str, Path], tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    from ratchet.config import load_settings
    from ratchet.decisions import decide
    from ratchet.training.registry import AdapterRegistry
    from tests.test_adapter_registry import _passed

    url, data_dir = dashboard
    registry = AdapterRegistry(load_settings({"data_dir": data_dir, "evolution": "nightly"}))
    first, second = _passed(registry, tmp_path, 1), _passed(registry, tmp_path, 2)
    decide(registry, str(first), "promote", who="ann", why="gen 1")
    expect.set_options(timeout=30_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(url)
            old = page.locator(f'tr[data-kind="adapters"][data-candidate="{first}"]')
            new = page.locator(f'tr[data-kind="adapters"][data-candidate="{second}"]')
            expect(old.locator("td.champion")).to_have_text("★")
            page.fill("#who", "bob")
            page.fill("#why", "gen 2 won its gate")
            new.locator('button[data-action="promote"]').click()
            expect(new.locator("td.status")).to_have_text("promoted")
            expect(new.locator("td.champion")).to_have_text("★")  # the champion moved on the page
            expect(old.locator("td.champion")).to_have_text("")
            expect(page.locator("#decision-message")).to_contain_text(
                f"adapter v{second}: verified → promoted"
            )
        finally:
            browser.close()
    assert registry.champion().version == second
    assert [(r.who, r.why) for r in registry.audit() if r.to_status == "promoted"][-1] == (
        "bob",
        "gen 2 won its gate",
    )
