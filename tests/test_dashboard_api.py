"""The HTTP API people (and the dashboard) use to decide on skills."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet.config import load_settings
from ratchet.dashboard.api import create_app
from ratchet.flows.runtime import open_library
from tests.factories import add_verified, local_client


def authorized(app: Any) -> Any:
    """A local client sending the data dir's token, as the dashboard page does."""
    client = local_client(app)
    client.headers["Authorization"] = f"Bearer {app.state.token}"
    return client


@pytest.fixture
def client_and_library(tmp_path: Path):  # type: ignore[no-untyped-def]
    settings = load_settings({"data_dir": tmp_path})
    library = open_library(settings)
    add_verified(library, "a", "Add left to right.")
    add_verified(library, "b", "Check the result twice.")
    return authorized(create_app(settings, library)), library


def unchanged(library: Any, name: str = "a") -> bool:
    statuses = [r.to_status for r in library.history(name)]
    return library.get(name).status == "verified" and statuses == ["candidate", "verified"]


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


# -- the token (dashboard/auth.py)


def _attacks() -> list[tuple[str, Callable[[str], dict[str, Any]], int]]:
    """(what, request options given the real token, status): each must change nothing."""
    evil, same_site = {"Origin": "http://evil.example"}, {"Origin": "http://127.0.0.1:9999"}
    return [
        ("no token", lambda t: {}, 401),
        ("a wrong token", lambda t: {"headers": {"Authorization": "Bearer " + "A" * len(t)}}, 403),
        ("the token cut short", lambda t: {"headers": {"Authorization": f"Bearer {t[:-1]}"}}, 403),
        ("the token and more", lambda t: {"headers": {"Authorization": f"Bearer {t}x"}}, 403),
        ("non-ASCII bytes", lambda t: {"headers": {"Authorization": b"Bearer \xe9\xff"}}, 403),
        ("another scheme", lambda t: {"headers": {"Authorization": f"Basic {t}"}}, 401),
        ("another header", lambda t: {"headers": {"X-Ratchet-Token": t}}, 401),
        ("a cookie", lambda t: {"headers": {"Cookie": f"token={t}; ratchet-token={t}"}}, 401),
        ("the query string", lambda t: {"params": {"token": t}}, 401),
        # a page elsewhere that learnt the URL `ratchet dashboard` printed posts to it
        ("the query string, cross-site", lambda t: {"params": {"token": t}, "headers": evil}, 403),
        ("the query string, another port", lambda t: {"params": {"token": t}, "headers": same_site}, 403),
    ]


@pytest.mark.parametrize(("what", "options", "code"), _attacks(), ids=[a[0] for a in _attacks()])
def test_a_change_without_the_token_is_refused_and_changes_nothing(  # type: ignore[no-untyped-def]
    client_and_library, what: str, options: Callable[[str], dict[str, Any]], code: int
) -> None:
    client, library = client_and_library
    bare = local_client(client.app)  # sends no Authorization of its own
    token = client.app.state.token
    for url in ("/api/skills/a/promote", "/api/skills/a/reject", "/api/skills/a/rollback"):
        r = bare.post(url, json=BODY, **options(token))
        assert r.status_code == code, (what, r.status_code, r.text)
        assert "\n" not in r.json()["detail"] and token not in r.text
    if code == 401:
        assert r.headers["www-authenticate"] == "Bearer"
    assert unchanged(library)


def test_reads_need_no_token_and_the_token_opens_changes(client_and_library) -> None:  # type: ignore[no-untyped-def]
    """The decision (dashboard/auth.py): reading shows the data dir, changing needs the token."""
    client, library = client_and_library
    bare = local_client(client.app)
    assert bare.get("/api/skills").status_code == 200 and bare.get("/api/policy").status_code == 200
    assert bare.get("/api/skills/a").status_code == 200
    header = {"Authorization": f"bearer  {client.app.state.token} "}
    ok = bare.post("/api/skills/a/promote", json=BODY, headers=header)
    assert ok.status_code == 200 and library.get("a").status == "promoted"


def test_the_token_file_is_private_written_once_and_atomically(tmp_path: Path) -> None:
    from ratchet.dashboard.auth import TOKEN_RE, ensure_token, token_path

    old = os.umask(0)  # a careless umask must not make it readable
    try:
        tokens: list[str] = []
        barrier = threading.Barrier(6)

        def start() -> None:
            barrier.wait()
            tokens.append(ensure_token(tmp_path / "data"))

        threads = [threading.Thread(target=start) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.umask(old)
    path = token_path(tmp_path / "data")
    assert len(tokens) == 6 and len(set(tokens)) == 1 and TOKEN_RE.match(tokens[0])  # they agree
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["dashboard.token"]  # no temp file left
    # an existing token is never overwritten: a restart, a second dashboard, `ratchet api`
    mine = "k" * 43
    path.write_text(mine + "\n")
    assert ensure_token(tmp_path / "data") == mine
    settings = load_settings({"data_dir": tmp_path / "data"})
    assert create_app(settings, open_library(settings)).state.token == mine
    assert path.read_text() == mine + "\n"


def _unlink_and_mkdir(p: Path) -> None:
    p.unlink()
    p.mkdir()


@pytest.mark.parametrize(
    ("what", "spoil", "says"),
    [
        ("world-readable", lambda p: p.chmod(0o644), "may be read by others (mode 0644)"),
        ("group-readable", lambda p: p.chmod(0o640), "may be read by others (mode 0640)"),
        ("world-writable", lambda p: p.chmod(0o602), "may be read by others"),
        ("empty", lambda p: p.write_text(""), "is damaged"),
        ("not a token", lambda p: p.write_text("hunter2\n"), "is damaged"),
        ("a directory", _unlink_and_mkdir, "is not a file"),
        ("a FIFO", lambda p: (p.unlink(), os.mkfifo(p, 0o600)), "is not a file"),  # no hang on open
    ],
)
def test_a_token_file_others_could_read_is_refused(  # type: ignore[no-untyped-def]
    tmp_path: Path, what: str, spoil, says: str
) -> None:
    """Changing the mode back would not un-leak the token: the dashboard refuses to start
    with one line, and deleting the file gives a new token."""
    from ratchet.dashboard.auth import ensure_token, token_path
    from ratchet.errors import StateFileError

    settings = load_settings({"data_dir": tmp_path})
    first = ensure_token(tmp_path)
    spoil(token_path(tmp_path))
    with pytest.raises(StateFileError) as refused:
        create_app(settings, open_library(settings))
    line = str(refused.value)
    assert says in line and "delete it" in line and "\n" not in line and first not in line
    if what not in ("a directory", "a FIFO"):
        token_path(tmp_path).unlink()
        assert ensure_token(tmp_path) != first


def test_a_symlinked_or_foreign_token_file_is_refused(tmp_path: Path) -> None:
    from ratchet.dashboard.auth import ensure_token, token_path
    from ratchet.errors import StateFileError

    data = tmp_path / "data"
    data.mkdir()
    planted = tmp_path / "planted"
    planted.write_text("p" * 43 + "\n")
    planted.chmod(0o600)
    token_path(data).symlink_to(planted)  # a token someone else chose
    with pytest.raises(StateFileError, match="is a symlink"):
        ensure_token(data)
    token_path(data).unlink()
    token_path(data).symlink_to(tmp_path / "nowhere")  # dangling: nothing is written through it
    with pytest.raises(StateFileError, match="is a symlink"):
        ensure_token(data)
    assert not (tmp_path / "nowhere").exists()
    if os.geteuid() == 0:  # another user's file (a planted, known token)
        token_path(data).unlink()
        ensure_token(data)
        os.chown(token_path(data), 65534, 65534)
        with pytest.raises(StateFileError, match="belongs to another user"):
            ensure_token(data)


def test_a_token_file_hard_linked_to_another_data_dirs_is_refused(tmp_path: Path) -> None:
    """A hard link passes every other check (a regular file, this user's, mode 0600), but two
    data dirs would then share one token: a URL printed for one opens the other's changes."""
    from ratchet.dashboard.auth import ensure_token, token_path
    from ratchet.errors import StateFileError

    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    first = ensure_token(theirs)
    mine.mkdir()
    os.link(token_path(theirs), token_path(mine))
    for data in (mine, theirs):  # both names of the one file: neither is this data dir's alone
        settings = load_settings({"data_dir": data})
        with pytest.raises(StateFileError) as refused:
            create_app(settings, open_library(settings))
        line = str(refused.value)
        assert "2 hard links" in line and "delete it" in line and "\n" not in line and first not in line
    token_path(mine).unlink()  # what the line says to do: a new token here, the other one works again
    assert ensure_token(mine) != first and ensure_token(theirs) == first


# -- what arrives: sizes and text


def test_a_body_over_the_limit_is_413_and_changes_nothing(client_and_library) -> None:  # type: ignore[no-untyped-def]
    client, library = client_and_library
    padded = BODY | {"pad": "x" * 70_000}  # extra fields are ignored: the size is the attack
    r = client.post("/api/skills/a/promote", json=padded)
    assert r.status_code == 413 and "over 64 KiB" in r.json()["detail"]

    def stream() -> Iterator[bytes]:  # chunked: no Content-Length to check
        yield b'{"reason": "x", "by": "y", "pad": "'
        for _ in range(20):
            yield b"x" * 8192
        yield b'"}'

    r = client.post("/api/skills/a/promote", content=stream(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert unchanged(library)
    assert client.post("/api/skills/a/promote", json=BODY | {"pad": "x" * 60_000}).status_code == 200


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[int, str, Any]]:
    """The API on a real socket (uvicorn on 127.0.0.1), for what a test client cannot send."""
    import uvicorn

    from tests.conftest import _free_port

    settings = load_settings({"data_dir": tmp_path})
    library = open_library(settings)
    add_verified(library, "a", "Add left to right.")
    app = create_app(settings, library)
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port, app.state.token, library
    finally:
        server.should_exit = True
        thread.join(10)


def _head(port: int, token: str, extra: str) -> bytes:
    return (
        f"POST /api/skills/a/promote HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {token}\r\n{extra}\r\n"
    ).encode()


def test_a_declared_50_mb_body_is_refused_before_it_is_sent(served) -> None:  # type: ignore[no-untyped-def]
    port, token, library = served
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(_head(port, token, "Content-Length: 50000000\r\n"))  # and not one byte of it
        assert s.recv(100).startswith(b"HTTP/1.1 413")
    assert unchanged(library)


def test_an_endless_chunked_body_is_cut_at_the_limit(served) -> None:  # type: ignore[no-untyped-def]
    """80 KiB sent chunked, then the client stalls: the answer comes without waiting for the
    rest (the server read at most the limit and stopped)."""
    port, token, library = served
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(_head(port, token, "Transfer-Encoding: chunked\r\n"))
        for _ in range(10):
            s.sendall(b"2000\r\n" + b"x" * 0x2000 + b"\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 413")
    assert unchanged(library)


INPUTS = [
    ("reason: lone surrogate", rb'{"reason": "\ud800 oops", "by": "ann"}', 422),
    ("by: lone surrogate", rb'{"reason": "fine", "by": "\udfff"}', 422),
    ("reason: terminal escape", rb'{"reason": "ok\u001b[2J\u001b[31mpromoted by admin", "by": "ann"}', 422),
    ("reason: NUL", rb'{"reason": "a\u0000b", "by": "ann"}', 422),
    ("by: newline", rb'{"reason": "fine", "by": "ann\nroot"}', 422),
    ("reason: carriage return", rb'{"reason": "ok\rpromoted by admin", "by": "ann"}', 422),
    ("by: bidi override", rb'{"reason": "fine", "by": "ann\u202e\u2066nimda"}', 422),
    ("reason: too long, with a surrogate", b'{"reason": "' + b"x" * 600 + rb'\ud800", "by": "ann"}', 422),
    ("by: 300 characters", b'{"reason": "fine", "by": "' + b"b" * 300 + b'"}', 422),
    ("not UTF-8", b'{"reason": "\xff\xfe caf\xe9", "by": "ann"}', 400),
    ("not JSON", b'{"reason": ', 422),
    ("not an object", b"[1, 2]", 422),
]


@pytest.mark.parametrize(("what", "body", "code"), INPUTS, ids=[i[0] for i in INPUTS])
def test_bad_text_is_a_one_line_4xx_and_changes_nothing(  # type: ignore[no-untyped-def]
    client_and_library, what: str, body: bytes, code: int
) -> None:
    client, library = client_and_library
    r = client.post("/api/skills/a/reject", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == code, (what, r.status_code, r.text[:300])
    detail = r.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and len(detail) < 400, detail
    assert unchanged(library)


@pytest.mark.parametrize("name", ["a" * 300, "x" * 65, "A", "a--b", "a%00b", "%ED%A0%80"])
def test_a_name_no_candidate_can_have_is_a_one_line_404(client_and_library, name: str) -> None:  # type: ignore[no-untyped-def]
    client, library = client_and_library
    for r in (client.post(f"/api/skills/{name}/promote", json=BODY), client.get(f"/api/skills/{name}")):
        assert r.status_code == 404, (r.status_code, r.text[:200])
        assert "\n" not in r.json()["detail"] and len(r.json()["detail"]) < 300
    assert unchanged(library)


def test_every_ratchet_error_from_a_decision_is_a_one_line_4xx(  # type: ignore[no-untyped-def]
    client_and_library, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the lifecycle refuses (a name, a reason, a `by` it will not keep) is the
    caller's to fix: a 4xx with the error's one line, never a 500."""
    from ratchet.errors import RatchetError

    class ReasonRefused(RatchetError):
        pass

    def refuse(*args: Any, **kwargs: Any) -> list[str]:
        raise ReasonRefused("the reason 'x\ny' is not one line of text", "say why in words")

    monkeypatch.setattr("ratchet.dashboard.api.apply_decision", refuse)
    client, library = client_and_library
    r = client.post("/api/skills/a/promote", json=BODY)
    assert r.status_code == 422
    line = r.json()["detail"]
    assert line.startswith("the reason 'x") and line.endswith("say why in words") and "\n" not in line
    assert unchanged(library)
