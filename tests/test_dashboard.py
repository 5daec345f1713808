"""The dashboard's pages, read from real stores (journal, MLflow, skill library, trajectories)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ratchet.dashboard.app import create_dashboard
from ratchet.flows.runtime import open_library
from tests.dashboard_data import Built, build
from tests.factories import local_client


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build(tmp_path_factory.mktemp("dashboard"))


def authorized(app: Any) -> TestClient:
    """A local client that sends the data dir's token with every request, as the page does."""
    client = local_client(app)
    client.headers["Authorization"] = f"Bearer {app.state.token}"
    return client


@pytest.fixture
def client(built: Built) -> TestClient:
    return authorized(create_dashboard(built.settings))


def rows_of(html: str, table_id: str) -> list[str]:
    table = html.split(f'id="{table_id}"', 1)[1].split("</table>", 1)[0]
    return re.findall(r"<tr[ >].*?</tr>", table, flags=re.S)[1:]  # without the header


def test_overview_shows_generations_with_plots_and_links(client: TestClient, built: Built) -> None:
    html = client.get("/").text
    gens = rows_of(html, "generation-table")
    assert len(gens) == 2
    assert "1/10 = 10%" in gens[0] and "5/10 = 50%" in gens[1] and "30%" in gens[1]  # test; train
    assert "<svg" in html.split('id="success-plot"')[1][:400]
    # every success rate beside the random policy's and the gold path's on the same tasks
    assert '<td class="random">42%</td>' in gens[1] and '<td class="gold">90%</td>' in gens[1]
    assert '<td class="random">—</td>' in gens[0]  # a journal from before baselines were kept
    plot = html.split('id="success-plot"')[1].split("</svg>")[0]
    assert "random valid action (test)" in plot and "gold path (test)" in plot
    assert "<svg" in html.split('id="cost-plot"')[1][:400]
    # the generation's own MLflow run, at the configured UI
    mlflow_links = re.findall(r'class="mlflow" href="([^"]+)"', html)
    assert len(mlflow_links) == 2 and len(set(mlflow_links)) == 2
    assert all(u.startswith("http://127.0.0.1:5000/#/experiments/") for u in mlflow_links)
    assert 'href="http://127.0.0.1:4200/runs/flow-run/f-1-verify"' in gens[1]
    (cluster,) = rows_of(html, "cluster-table")
    assert "loop" in cluster and 'href="/trajectories/t1"' in cluster


def test_skill_library_shows_evidence_and_the_buttons_its_status_allows(client: TestClient) -> None:
    html = client.get("/").text
    rows = {re.search(r'data-candidate="([^"]+)"', r).group(1): r for r in rows_of(html, "skill-table")}  # type: ignore[union-attr]
    verified, candidate = rows["take-coin-first"], rows["open-doors"]
    assert 'data-status="verified"' in verified
    assert ">5<" in verified and ">1<" in verified and "0.031" in verified and ">32<" in verified
    assert re.findall(r'data-action="(\w+)"', verified) == ["promote", "reject"]
    assert re.findall(r'data-action="(\w+)"', candidate) == ["reject"]


def test_candidate_detail_has_pairs_provenance_and_history(client: TestClient) -> None:
    html = client.get("/skills/take-coin-first").text
    assert "repairs 5, regressions 1" in html and "p = 0.0312" in html
    pairs = rows_of(html, "pairs")
    assert 'class="repair"' in pairs[0] and 'class=""' in pairs[1]
    assert 'href="/trajectories/t-win"' in html and 'href="/trajectories/t-lost"' in html
    assert "t-gone" in html and "no longer in the trajectory store" in html
    assert "candidate → verified" in html and "significant net gain" in html


def test_trajectory_viewer_shows_each_step(client: TestClient) -> None:
    html = client.get("/trajectories/t-win").text
    assert "success · textworld-express:coin:train:1" in html
    assert html.count('class="step source-model') == 2 and "2 steps, 2/15 of the budget" in html
    assert 'act({"action": "take coin"})' in html
    # a rule that narrowed the menu is named on its step, linked to the skill
    (rules,) = re.findall(r'<p class="rules">.*?</p>', html, flags=re.S)
    assert 'href="/skills/coin-prefer-take-coin"' in rules and html.index(rules) > html.index("look around")


def test_a_replayed_arm_says_so_and_links_the_rollout_it_repeats(client: TestClient) -> None:
    html = client.get("/trajectories/t-replayed").text
    (note,) = re.findall(r'<p class="note">.*?</p>', html, flags=re.S)
    assert "Not played" in note and 'href="/trajectories/t-win"' in note
    assert "Not played" not in client.get("/trajectories/t-win").text


def test_a_searched_rollout_shows_where_it_branched_and_its_evidence_says_searched(
    client: TestClient,
) -> None:
    html = client.get("/trajectories/t-searched").text
    (note,) = re.findall(r'<p class="note">.*?</p>', html, flags=re.S)
    assert "Searched" in note and 'href="/trajectories/t-lost"' in note and "first 1 step(s)" in note
    steps = html.split('<ol class="steps">')[1]
    assert (
        steps.index('class="step source-replay')
        < steps.index('class="branch"')
        < steps.index("source-search")
    )
    assert "Searched" not in client.get("/trajectories/t-win").text
    rows = rows_of(client.get("/skills/take-coin-first").text, "provenance")
    how = {re.search(r'href="/trajectories/([^"]+)"', r).group(1): r for r in rows if "href" in r}  # type: ignore[union-attr]
    assert "searched (branched at step 1)" in how["t-searched"] and "sampled" in how["t-win"]


def test_bad_addresses_get_one_line_and_the_fix(client: TestClient) -> None:
    r = client.get("/?evolution=nope")
    assert r.status_code == 404 and "no evolution &#39;nope&#39;" in r.text and "known: nightly" in r.text
    assert client.get("/skills/nope").status_code == 404
    assert client.get("/trajectories/nope").status_code == 404
    assert client.get("/api/skills/nope").status_code == 404


def test_every_asset_is_served_here(client: TestClient) -> None:
    """Offline: scripts and styles come from this server, never a CDN."""
    html = client.get("/").text
    assets = re.findall(r'<(?:script|link)[^>]+(?:src|href)="([^"]+)"', html)
    assert assets and all(a.startswith("http://127.0.0.1:8780/static/") for a in assets)
    for a in assets:
        assert client.get(a).status_code == 200


@pytest.mark.parametrize(
    "path",
    ["/", "/skills/take-coin-first", "/trajectories/t-win", "/skills/nope", "/api/docs", "/docs", "/redoc"],
)
def test_no_page_on_the_dashboards_origin_loads_a_script_from_elsewhere(
    client: TestClient, path: str
) -> None:
    """The token lives in this origin's localStorage: a script from a CDN (Swagger UI's, with
    no integrity check) could read it. No page names one, and every answer's CSP tells the
    browser to run scripts from this origin only, and never inside another site's frame."""
    r = client.get(path)
    assert "swagger" not in r.text.lower() and "redoc" not in r.text.lower()
    sources = re.findall(r"<script[^>]*\bsrc=[\"']?([^\"' >]+)", r.text, flags=re.I)
    assert all(s.startswith(("/static/", "http://127.0.0.1:8780/static/")) for s in sources), sources
    policy = r.headers.get("content-security-policy", "")
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";") if d.strip())
    assert directives.get("script-src") == "'self'" and directives.get("default-src") == "'self'"
    assert directives.get("frame-ancestors") == "'none'" and directives.get("object-src") == "'none'"


def test_the_api_is_described_as_json_not_a_page(client: TestClient) -> None:
    """`ratchet dashboard` and `ratchet api` print /api/docs: it leads to the OpenAPI JSON."""
    r = client.get("/api/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert "/api/skills/{name}/{action}" in r.json()["paths"]
    for gone in ("/docs", "/redoc", "/api/redoc", "/docs/oauth2-redirect"):
        assert client.get(gone).status_code == 404


def test_a_decision_shows_up_in_the_champion_history(tmp_path: Path) -> None:
    settings = build(tmp_path).settings
    client = authorized(create_dashboard(settings))
    decision = {"reason": "fixes coin", "by": "ann", "expect": "verified"}
    before = client.get("/").text
    ok = client.post("/api/skills/take-coin-first/promote", json=decision)
    assert ok.status_code == 200
    live = re.compile(r'<span id="live">(.*?)</span>')
    assert live.findall(before) == ["live: no promoted candidates"]
    history = rows_of(client.get("/").text, "champion-history")
    assert len(history) == 1 and "verified → promoted" in history[0] and "ann" in history[0]
    # what is live, counted by kind (a promoted rule or tool is live as much as a procedure)
    assert live.findall(client.get("/").text) == ["live: 1 procedure"]
    row = next(r for r in rows_of(client.get("/").text, "skill-table") if "take-coin-first" in r)
    assert re.findall(r'data-action="(\w+)"', row) == ["retire"]


def test_a_malformed_skill_file_is_named_not_fatal(tmp_path: Path) -> None:
    settings = build(tmp_path).settings
    (settings.skills_dir / "open-doors" / "SKILL.md").write_text("---\nname: [broken\n---\n")
    client = local_client(create_dashboard(settings, open_library(settings)))
    html = client.get("/").text
    assert "refused skill file" in html and "take-coin-first" in html
    assert client.get("/skills/open-doors").status_code == 422


def test_prefect_links_follow_the_setting_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from ratchet.config import load_settings
    from ratchet.dashboard.views import prefect_ui

    for var in ("PREFECT_UI_URL", "PREFECT_API_URL"):
        monkeypatch.delenv(var, raising=False)
    assert prefect_ui(load_settings({})) == "http://127.0.0.1:4200"
    monkeypatch.setenv("PREFECT_API_URL", "http://10.0.0.5:4300/api")
    assert prefect_ui(load_settings({})) == "http://10.0.0.5:4300"
    monkeypatch.setenv("PREFECT_UI_URL", "http://ui.local:4200/")
    assert prefect_ui(load_settings({})) == "http://ui.local:4200"
    assert prefect_ui(load_settings({"dashboard.prefect_url": "http://x:1"})) == "http://x:1"


def test_adapters_show_their_gate_evidence_the_champion_and_their_buttons(tmp_path: Path) -> None:
    from ratchet.config import load_settings
    from ratchet.decisions import decide
    from ratchet.training.registry import AdapterRegistry
    from tests.test_adapter_registry import _passed

    settings = load_settings({"data_dir": tmp_path / "data"})
    registry = AdapterRegistry(settings)
    first, second = _passed(registry, tmp_path, 1), _passed(registry, tmp_path, 2)
    decide(registry, str(first), "promote", who="ann", why="won the gate")
    html = local_client(create_dashboard(settings)).get("/").text
    rows = rows_of(html, "adapter-table")
    assert [re.search(r'data-candidate="(\d+)"', r).group(1) for r in rows] == [str(second), str(first)]  # type: ignore[union-attr]
    newer, champion = rows
    assert '<td class="champion">★</td>' in champion and '<td class="champion"></td>' in newer
    assert "0.030" in champion and ">16<" in champion  # the gate's p and rollouts
    assert re.findall(r'data-action="(\w+)"', champion) == ["retire"]
    assert re.findall(r'data-action="(\w+)"', newer) == ["promote", "reject"]
    assert 'id="why"' in html  # the decision bar is there though no skill is
    history = rows_of(html, "champion-history")
    assert any(f"adapter v{first}" in r and "verified → promoted" in r for r in history)


def test_a_rule_page_shows_the_rule_it_applies(tmp_path: Path) -> None:
    from ratchet.config import load_settings
    from ratchet.types import RuleSpec
    from tests.factories import a_rule

    settings = load_settings({"data_dir": tmp_path / "data"})
    skill = a_rule(RuleSpec(name="coin-no-repeat", no_repeat=True))
    open_library(settings).add(skill)
    html = local_client(create_dashboard(settings)).get("/skills/coin-no-repeat").text
    shown = html.split('id="rule"', 1)[1].split("</pre>", 1)[0]
    assert "&#34;no_repeat&#34;: true" in shown or '"no_repeat": true' in shown


def test_an_exemplar_page_lists_its_solved_tasks_linked_to_their_runs(tmp_path: Path) -> None:
    from ratchet.config import load_settings
    from ratchet.skills.exemplars import exemplar_skill
    from ratchet.skills.format import Demo

    settings = load_settings({"data_dir": tmp_path / "data"})
    demos = [
        Demo(task="Find the <b>coin</b>.", actions=("act: move north", "act: take coin"), trajectory="t-1"),
        Demo(task="Find the coin again.", actions=("act: take coin",), trajectory="t-2"),
    ]
    open_library(settings).add(exemplar_skill("textworld-express:coin", demos, "default", 1))
    html = local_client(create_dashboard(settings)).get("/skills/coin-exemplars").text
    shown = html.split('id="exemplars"', 1)[1].split("</ol>", 1)[0]
    assert shown.count("<li>") == 2 and "act: move north → act: take coin" in shown
    assert 'href="/trajectories/t-1"' in shown and 'href="/trajectories/t-2"' in shown
    assert "&lt;b&gt;coin&lt;/b&gt;" in shown and "<b>coin</b>" not in shown  # task text is data, escaped


def test_the_page_knows_whether_its_link_carried_the_token_but_never_shows_it(
    client: TestClient, built: Built
) -> None:
    """The script keeps a `?token=` only when the server says it is this dashboard's; the
    token itself is never written into a page (reading a page needs no token)."""
    from ratchet.dashboard.auth import read_token

    token = read_token(built.settings.data_dir)
    bare = local_client(create_dashboard(built.settings))
    plain = bare.get("/")
    assert plain.status_code == 200 and "data-token-link" not in plain.text and token not in plain.text
    right = bare.get(f"/?token={token}")
    assert 'data-token-link="ok"' in right.text and right.text.count(token) == 0
    wrong = bare.get("/skills/take-coin-first?token=" + "x" * 43)
    assert 'data-token-link="wrong"' in wrong.text
    assert '<meta name="referrer" content="same-origin">' in plain.text  # no token in a Referer


@pytest.mark.parametrize("name", ["a" * 300, "A" * 65, "x%00y", "%ED%A0%80"])
def test_a_name_no_skill_can_have_is_a_404_page_not_a_500(client: TestClient, name: str) -> None:
    for path in (f"/skills/{name}", f"/api/skills/{name}"):
        r = client.get(path)
        assert r.status_code == 404, (path, r.status_code)
    assert "lowercase letters, digits and hyphens" in client.get(f"/api/skills/{name}").json()["detail"]


DAMAGED = [
    ("summary is a list", lambda st: st[0].update(summary=[1, 2])),
    ("generation is text", lambda st: st[0].update(generation="one")),
    ("successes is text", lambda st: st[-1]["summary"].update(successes="five")),
    ("ci95 is a number", lambda st: st[-1]["summary"].update(ci95=0.5)),
    ("tokens is text", lambda st: st[0]["summary"].update(tokens="many")),
    ("success_rate is text", lambda st: st[1]["summary"].update(success_rate="high")),
    ("flow run ids are a list", lambda st: st[0].update(flow_run_id=["f"])),
    ("stages is an object", None),
]


@pytest.mark.parametrize(("what", "damage"), DAMAGED, ids=[d[0] for d in DAMAGED])
def test_a_journal_with_wrong_field_types_is_one_line_on_the_front_page(  # type: ignore[no-untyped-def]
    tmp_path: Path, what: str, damage
) -> None:
    """The pre-flight (`Journal.load`) refuses it with one line, and the front page shows
    that line where the generations were, with the rest of the page (skills, decisions)."""
    from ratchet.errors import StateFileError
    from ratchet.flows.journal import Journal

    settings = build(tmp_path).settings
    body = json.loads(settings.evolve_journal.read_text())
    if damage is None:
        body["stages"] = {"0": body["stages"][0]}
    else:
        damage(body["stages"])
    settings.evolve_journal.write_text(json.dumps(body))
    with pytest.raises(StateFileError) as refused:
        Journal.load(settings)
    assert "\n" not in str(refused.value) and "move it away" in str(refused.value)

    response = local_client(create_dashboard(settings)).get("/")
    assert response.status_code == 200
    (line,) = re.findall(r'<p class="error" id="journal-error">(.*?)</p>', response.text, flags=re.S)
    assert "evolution journal" in line and "move it away" in line and "\n" not in line.strip()
    assert "take-coin-first" in response.text and 'id="why"' in response.text  # decisions still work
