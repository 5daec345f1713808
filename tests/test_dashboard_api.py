"""The HTTP API people (and the dashboard) use to decide on skills."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ratchet.config import load_settings
from ratchet.dashboard.api import create_app
from ratchet.flows.runtime import open_library
from tests.factories import add_verified, local_client


@pytest.fixture
def client_and_library(tmp_path: Path):  # type: ignore[no-untyped-def]
    settings = load_settings({"data_dir": tmp_path})
    library = open_library(settings)
    add_verified(library, "a", "Add left to right.")
    add_verified(library, "b", "Check the result twice.")
    return local_client(create_app(settings, library)), library


def test_promote_then_rollback_through_http(client_and_library) -> None:  # type: ignore[no-untyped-def]
    client, library = client_and_library
    assert [s["status"] for s in client.get("/api/skills").json()] == ["verified", "verified"]
    start = client.get("/api/policy").json()["version"]
    ok = client.post("/api/skills/a/promote", json={"reason": "helps", "by": "ann"})
    assert ok.status_code == 200 and ok.json()["status"] == "promoted"
    assert ok.json()["policy_before"] == start != ok.json()["policy_after"]
    shown = client.get("/api/skills/a").json()
    assert [h["to_status"] for h in shown["history"]] == ["candidate", "verified", "promoted"]
    back = client.post("/api/skills/a/rollback", json={"reason": "regressed", "by": "bob"})
    assert back.status_code == 200 and back.json()["policy_after"] == start
    # every status change is also in the evolution's MLflow run, with who, why and evidence
    import json

    from mlflow.tracking import MlflowClient

    settings = load_settings({"data_dir": library.root.parent})
    mlf = MlflowClient(settings.mlflow_uri)
    exp = mlf.get_experiment_by_name("ratchet-default")
    (run,) = mlf.search_runs([exp.experiment_id], "tags.`ratchet.kind` = 'evolution'")
    files = [f.path for f in mlf.list_artifacts(run.info.run_id, "audit/a")]
    statuses = [p.rsplit("-", 1)[1].removesuffix(".json") for p in sorted(files)]
    assert statuses == ["candidate", "verified", "promoted", "retired"]
    promoted = next(p for p in files if p.endswith("promoted.json"))
    record = json.loads(Path(mlf.download_artifacts(run.info.run_id, promoted)).read_text())
    assert (record["who"], record["why"]) == ("ann", "helps")


def test_errors_are_clear_status_codes(client_and_library) -> None:  # type: ignore[no-untyped-def]
    client, _ = client_and_library
    assert client.post("/api/skills/nope/promote", json={"reason": "x", "by": "y"}).status_code == 404
    assert client.post("/api/skills/a/promote", json={"reason": "", "by": "y"}).status_code == 422
    assert client.post("/api/skills/a/fly", json={"reason": "x", "by": "y"}).status_code == 422
    retire = client.post("/api/skills/a/retire", json={"reason": "x", "by": "y"})
    assert (
        retire.status_code == 409
        and "is verified: it can move to promoted, rejected, not retired" in retire.json()["detail"]
    )


def test_two_people_promoting_at_once_one_wins_one_conflicts(client_and_library) -> None:  # type: ignore[no-untyped-def]
    client, library = client_and_library
    codes: list[int] = []
    barrier = threading.Barrier(2)

    def promote(who: str) -> None:
        barrier.wait()
        codes.append(client.post("/api/skills/b/promote", json={"reason": "mine", "by": who}).status_code)

    threads = [threading.Thread(target=promote, args=(w,)) for w in ("ann", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(codes) == [200, 409]
    assert [r.to_status for r in library.history("b")].count("promoted") == 1


BODY = {"reason": "helps", "by": "mallory"}


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        # DNS rebinding: attacker.example now resolves to 127.0.0.1; the browser sends its name
        ({"Host": "attacker.example", "Origin": "http://attacker.example"}, 421),
        ({"Host": "attacker.example:8780"}, 421),
        ({"Host": "127.0.0.1.attacker.example"}, 421),
        ({"Host": "localhost.attacker.example:8780"}, 421),
        ({"Host": "127.0.0.1@attacker.example"}, 421),
        ({"Host": ""}, 421),
        # cross-site: a page elsewhere (another port of this machine included) posts to us
        ({"Origin": "http://attacker.example"}, 403),
        ({"Origin": "http://127.0.0.1:9999"}, 403),
        ({"Origin": "http://localhost:8780"}, 403),  # another origin, though the same server
        ({"Origin": "null"}, 403),  # sandboxed iframes and file:// pages
        ({"Origin": "http://127.0.0.1:8780.attacker.example"}, 403),
        ({"Sec-Fetch-Site": "cross-site"}, 403),
    ],
)
def test_rebinding_and_cross_site_changes_are_refused_and_change_nothing(  # type: ignore[no-untyped-def]
    client_and_library, headers: dict[str, str], code: int
) -> None:
    client, library = client_and_library
    response = client.post("/api/skills/a/promote", json=BODY, headers=headers)
    assert response.status_code == code, response.text
    assert "\n" not in response.json()["detail"]
    assert library.get("a").status == "verified"
    assert [r.to_status for r in library.history("a")] == ["candidate", "verified"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_simple_cross_site_form_post_is_refused(client_and_library, content_type: str | None) -> None:  # type: ignore[no-untyped-def]
    # Forms and text/plain need no CORS preflight, so a foreign page could send them blind.
    client, library = client_and_library
    headers = {"Content-Type": content_type} if content_type else {}
    response = client.post("/api/skills/a/promote", content=b'{"reason": "x", "by": "y"}', headers=headers)
    assert response.status_code == 415
    assert library.get("a").status == "verified"


def test_reads_from_a_rebound_host_are_refused_too(client_and_library) -> None:  # type: ignore[no-untyped-def]
    client, _ = client_and_library
    assert client.get("/api/skills", headers={"Host": "attacker.example"}).status_code == 421
    assert client.get("/api/policy", headers={"Host": "localhost:8780"}).status_code == 200


@pytest.mark.parametrize("origin", [None, "http://127.0.0.1:8780"])
def test_the_dashboard_tab_and_scripts_still_decide(client_and_library, origin: str | None) -> None:  # type: ignore[no-untyped-def]
    client, library = client_and_library
    headers = {"Origin": origin, "Sec-Fetch-Site": "same-origin"} if origin else {}
    assert client.post("/api/skills/a/promote", json=BODY, headers=headers).status_code == 200
    assert library.get("a").status == "promoted"


def test_adapters_are_decided_on_through_the_same_api(client_and_library, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The champion adapter moves through the API like a skill: one decision path, one lifecycle."""
    from ratchet.training.registry import AdapterRegistry
    from tests.test_adapter_registry import _passed

    client, library = client_and_library
    registry = AdapterRegistry(load_settings({"data_dir": library.root.parent}))
    first, second = _passed(registry, tmp_path, 1), _passed(registry, tmp_path, 2)
    listed = client.get("/api/adapters").json()
    assert [(a["version"], a["status"], a["evidence"]["p_value"]) for a in listed] == [
        (first, "verified", 0.03),
        (second, "verified", 0.03),
    ]
    start = client.get("/api/policy").json()
    ok = client.post(
        f"/api/adapters/{first}/promote", json={"reason": "won", "by": "ann", "expect": "verified"}
    )
    assert ok.status_code == 200 and ok.json()["status"] == "promoted"
    assert ok.json()["policy_before"] == start["version"] != ok.json()["policy_after"]
    assert client.get("/api/policy").json()["adapter"] == registry.get(first).served_name
    stale = client.post(
        f"/api/adapters/{first}/reject", json={"reason": "x", "by": "bob", "expect": "verified"}
    )
    assert stale.status_code == 409 and "is promoted, not verified" in stale.json()["detail"]
    back = client.post(f"/api/adapters/{first}/rollback", json={"reason": "regressed", "by": "bob"})
    assert back.status_code == 200 and back.json()["changed"] == [str(first)]
    assert back.json()["policy_after"] == start["version"] and registry.champion() is None
    assert client.post("/api/adapters/99/promote", json={"reason": "x", "by": "y"}).status_code == 404
    # the same wall as skills: a foreign page cannot move the champion
    foreign = client.post(
        f"/api/adapters/{second}/promote", json=BODY, headers={"Origin": "http://evil.example"}
    )
    assert foreign.status_code == 403 and registry.get(second).status == "verified"
