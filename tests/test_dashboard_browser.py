"""`ratchet dashboard` in a real browser (Debian's chromium, driven by Playwright): the page
loads offline, shows the generations plot, and a person who opened the URL the command
printed (with its `?token=`) promotes a verified skill; a tab without the token, and a page
on another local port that knows the token, change nothing."""

from __future__ import annotations

import os
import re
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
def dashboard(tmp_path: Path) -> Iterator[tuple[str, Path, str]]:
    """`ratchet dashboard` as a person starts it, on a data dir two generations old: its
    address, the data dir, and the URL it printed (with the token)."""
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
        said = (tmp_path / "dashboard.log").read_text()
        printed = re.search(r"dashboard on (http://\S+/\?token=[\w-]+)", said)
        assert printed, said
        yield url, settings.data_dir, printed.group(1)
    finally:
        stop_process_group(proc)
        log.close()


def test_promote_a_verified_skill_in_the_browser(dashboard: tuple[str, Path, str]) -> None:
    from playwright.sync_api import expect, sync_playwright

    url, data_dir, printed = dashboard
    expect.set_options(timeout=30_000)  # a shared 2-core machine
    requested: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.on("request", lambda r: requested.append(r.url))
            page.goto(printed)
            expect(page).to_have_url(f"{url}/")  # the token left the address bar (and history)

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
            stale.goto(printed)  # fresh: shows promoted; make it stale by hand as a slow person would be
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


@pytest.mark.slow  # in CI: the same decision through the API (test_dashboard_api), a skill's in the browser
def test_move_the_champion_adapter_in_the_browser(dashboard: tuple[str, Path, str], tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    from ratchet.config import load_settings
    from ratchet.decisions import decide
    from ratchet.training.registry import AdapterRegistry
    from tests.test_adapter_registry import _passed

    url, data_dir, printed = dashboard
    registry = AdapterRegistry(load_settings({"data_dir": data_dir, "evolution": "nightly"}))
    first, second = _passed(registry, tmp_path, 1), _passed(registry, tmp_path, 2)
    decide(registry, str(first), "promote", who="ann", why="gen 1")
    expect.set_options(timeout=30_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(printed)
            page.goto(url)  # the tab keeps the token: a later visit without it still decides
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


EVIL = """<!doctype html><title>cat pictures</title><script>
// A page on another local port that learnt the printed URL (history, a log, a shoulder).
const target = "TARGET", token = "TOKEN";
const body = JSON.stringify({reason: "pwned", by: "admin"});
async function attack() {
  const tries = [
    // no preflight: text/plain, the token in the query string
    fetch(`${target}/api/skills/take-coin-first/promote?token=${token}`, {method: "POST", mode: "no-cors",
      headers: {"content-type": "text/plain"}, body}),
    // the real header: the browser asks first (CORS preflight) and is never told yes
    fetch(`${target}/api/skills/take-coin-first/promote`, {method: "POST",
      headers: {"content-type": "application/json", authorization: `Bearer ${token}`}, body}),
  ];
  const out = await Promise.allSettled(tries);
  document.title = "tried " + out.map((o) => o.status).join(",");
  const form = document.getElementById("f");  // and a plain form post, navigating there
  form.action = `${target}/api/skills/take-coin-first/promote?token=${token}`;
  form.submit();
}
attack();
</script>
<form id="f" method="POST" enctype="text/plain"><input name='{"reason":"x","by":"y","z":"' value='"}'></form>
"""


def test_a_tab_without_the_token_and_a_foreign_page_with_it_change_nothing(
    dashboard: tuple[str, Path, str], tmp_path: Path
) -> None:
    import http.server
    import threading
    from functools import partial

    from playwright.sync_api import expect, sync_playwright

    from ratchet.config import load_settings

    url, data_dir, printed = dashboard
    token = printed.rsplit("=", 1)[1]
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "index.html").write_text(EVIL.replace("TARGET", url).replace("TOKEN", token))
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "evil"))
    evil = http.server.ThreadingHTTPServer(("127.0.0.1", _free_port()), handler)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    expect.set_options(timeout=30_000)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
            try:
                # a tab opened without the printed URL: the buttons say how to get the token
                bare = browser.new_page()
                bare.goto(url)
                row = bare.locator('tr[data-kind="skills"][data-candidate="take-coin-first"]')
                bare.fill("#why", "no token")
                row.locator('button[data-action="promote"]').click()
                expect(bare.locator("#decision-message")).to_contain_text("no token")
                # a wrong token in the link is named, and not kept
                wrong = browser.new_page()
                wrong.goto(f"{url}/?token={'x' * len(token)}")
                expect(wrong.locator("#decision-message")).to_contain_text("not this dashboard's")
                assert wrong.evaluate("localStorage.getItem('ratchet.token')") is None
                # a browser that holds the token for the dashboard's origin visits the foreign
                # page: its fetches and its form post (token in the URL) change nothing
                context = browser.new_context()
                mine = context.new_page()
                mine.goto(printed)
                assert mine.evaluate("localStorage.getItem('ratchet.token')") == token
                foreign = context.new_page()
                foreign.goto(f"http://127.0.0.1:{evil.server_address[1]}/index.html")
                foreign.wait_for_url(f"{url}/api/**")  # the form post landed, and was refused
                assert "refused" in foreign.content()
            finally:
                browser.close()
    finally:
        evil.shutdown()
    library = open_library(load_settings({"data_dir": data_dir, "evolution": "nightly"}))
    assert library.get("take-coin-first").status == "verified"
    assert [r.to_status for r in library.history("take-coin-first")] == ["candidate", "verified"]
