"""The embedded model server's HTTP routes, attacked as a web page and as another local user would.

A page from anywhere reaches the loopback server through the user's browser (DNS rebinding:
`Host: attacker.example`; a cross-site post, even a preflight-free `text/plain` one), and
any local process reaches it directly. Neither may load an adapter (any path, under the
champion's name), unload one or empty the prefix cache; `/v1/models` names no path.

The first half runs the app over a stand-in engine (fast, every variant); the second half
attacks the real server the test session starts (`embedded_server`), as the loop runs it.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

MODEL = "smollm2-135m-instruct"
TOKEN = "t" * 43
LOAD, UNLOAD, RESET = "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/reset_prefix_cache"
ADMIN = [(LOAD, {"lora_name": "champion", "lora_path": "/tmp/x"}), (UNLOAD, {"lora_name": "a"}), (RESET, {})]
ROUTES = [
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    *[("POST", path, body) for path, body in ADMIN],
]
REBOUND_HOSTS = [
    "attacker.example",
    "attacker.example:8000",
    "127.0.0.1.attacker.example",
    "localhost.attacker.example:8000",
    "127.0.0.1@attacker.example",
    "",
]
FOREIGN_ORIGINS = [
    "http://attacker.example",
    "http://127.0.0.1:9999",  # another port of this machine
    "http://localhost:8000",  # another loopback name of the same server
    "null",  # a sandboxed iframe, a file:// page
    "http://127.0.0.1:8000.attacker.example",
]
SIMPLE_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]


class FakeEngine:
    """What `create_app` reads of an Engine, and a record of every change made to it."""

    def __init__(self) -> None:
        self.adapters: dict[str, str] = {}
        self.resets = 0
        self.dtype = self.kv_dtype = "torch.float32"
        self.stats: dict[str, Any] = {}
        self.pool = SimpleNamespace(capacity=1, slot_bytes=1, in_use=lambda: 0)
        self.prefix_cache = SimpleNamespace(evictions=0)
        self.shape_buckets = 0

    def load_adapter(self, name: str, path: str) -> None:
        self.adapters[name] = path

    def unload_adapter(self, name: str) -> None:
        self.adapters.pop(name)

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    def changes(self) -> tuple[dict[str, str], int]:
        return dict(self.adapters), self.resets


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Any, FakeEngine, Path]]:
    """A client of the app on 127.0.0.1:8000 over a stand-in engine, its data dir `tmp_path/data`."""
    from fastapi.testclient import TestClient

    from ratchet.server.app import create_app

    data = tmp_path / "data"
    data.mkdir()
    engine = FakeEngine()
    engine.adapters["a"] = str(data / "adapters" / "a")
    app = create_app(engine, MODEL, token=TOKEN, data_dir=data)  # type: ignore[arg-type]
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        yield client, engine, data


def _send(client: Any, method: str, path: str, body: Any, **headers: str | None) -> Any:
    head = {k.replace("_", "-"): v.encode("latin-1") for k, v in headers.items() if v is not None}
    content = None if body is None else json.dumps(body)
    if content is not None and "content-type" not in head:
        head["content-type"] = b"application/json"
    return client.request(method, path, content=content, headers=head)


def _adapter(folder: Path) -> Path:
    """A LoRA adapter directory (its config; the stand-in engine reads no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    return folder


# ------------------------------------------------------------ a web page, through the browser
@pytest.mark.parametrize("host", REBOUND_HOSTS)
@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_a_rebound_page_reaches_no_route(served, host: str, method: str, path: str, body: Any) -> None:  # type: ignore[no-untyped-def]
    client, engine, _ = served
    before = engine.changes()
    r = _send(client, method, path, body, host=host, origin=f"http://{host}", authorization=f"Bearer {TOKEN}")
    assert r.status_code == 421 and "loopback" in r.json()["detail"]
    assert engine.changes() == before


@pytest.mark.parametrize("origin", FOREIGN_ORIGINS)
@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_a_foreign_origin_reaches_no_route(served, origin: str, method: str, path: str, body: Any) -> None:  # type: ignore[no-untyped-def]
    """Reads too: a page that got past the Host check some other way reads nothing."""
    client, engine, _ = served
    before = engine.changes()
    r = _send(client, method, path, body, origin=origin, authorization=f"Bearer {TOKEN}")
    assert r.status_code == 403 and engine.changes() == before
    r = _send(client, method, path, body, sec_fetch_site="cross-site", authorization=f"Bearer {TOKEN}")
    assert r.status_code == 403 and engine.changes() == before


@pytest.mark.parametrize("content_type", SIMPLE_TYPES)
@pytest.mark.parametrize(("path", "body"), [*ADMIN, ROUTES[2][1:]], ids=[LOAD, UNLOAD, RESET, "chat"])
def test_a_preflight_free_post_is_refused(served, content_type: str | None, path: str, body: Any) -> None:  # type: ignore[no-untyped-def]
    """A `text/plain` or form post needs no CORS preflight: a page could send it blind."""
    client, engine, _ = served
    before = engine.changes()
    head = {"authorization": f"Bearer {TOKEN}"} | (
        {} if content_type is None else {"content-type": content_type}
    )
    r = client.post(path, content=json.dumps(body), headers=head)
    assert r.status_code == 415 and engine.changes() == before


# ------------------------------------------------------------------ a local process, any user
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer not-needed", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Basic {TOKEN}", "Bearer \xe9"],
    ids=["no token", "the api key", "cut short", "one more byte", "another scheme", "non-ASCII"],
)
@pytest.mark.parametrize(("path", "body"), ADMIN, ids=[LOAD, UNLOAD, RESET])
def test_an_admin_route_without_this_starts_token_changes_nothing(  # type: ignore[no-untyped-def]
    served, authorization: str | None, path: str, body: Any
) -> None:
    client, engine, data = served
    if path == LOAD:  # a real adapter inside the data dir, under the champion's name
        body = {"lora_name": "champion", "lora_path": str(_adapter(data / "adapters" / "other"))}
    before = engine.changes()
    r = _send(client, "POST", path, body, authorization=authorization)
    assert r.status_code in (401, 403) and engine.changes() == before
    assert TOKEN not in r.text


def test_the_token_opens_the_admin_routes_and_chat_needs_none(served) -> None:  # type: ignore[no-untyped-def]
    client, engine, data = served
    adapter = _adapter(data / "adapters" / "v2")
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert (
        _send(client, "POST", LOAD, {"lora_name": "v2", "lora_path": str(adapter)}, **auth).status_code == 200
    )
    assert engine.adapters["v2"] == str(adapter.resolve())
    assert _send(client, "POST", UNLOAD, {"lora_name": "v2"}, **auth).status_code == 200
    assert _send(client, "POST", RESET, {}, **auth).status_code == 200 and engine.resets == 1
    chat = _send(client, "POST", "/v1/chat/completions", {"model": "nope", "messages": []})
    assert chat.status_code == 404 and "nope" in chat.text  # past the guards, to the route itself
    assert client.get("/health").status_code == 200  # a local reader needs no token


def test_an_app_started_without_a_token_opens_no_admin_route(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from ratchet.server.app import create_app

    engine = FakeEngine()
    client = TestClient(create_app(engine, MODEL), base_url="http://127.0.0.1:8000")  # type: ignore[arg-type]
    for path, body in ADMIN:
        assert _send(client, "POST", path, body, authorization="Bearer ").status_code == 401
        assert _send(client, "POST", path, body, authorization="Bearer anything").status_code == 403
    assert engine.changes() == ({}, 0)


# ---------------------------------------------------------------------- what may be loaded
def _outside() -> Path:
    """A folder outside any test's data dir (the session's temporary tree)."""
    return Path(tempfile.mkdtemp(prefix="ratchet-outside-"))


def _loop(link: Path) -> Path:
    link.symlink_to(link)
    return link


def _spoilers(data: Path) -> list[tuple[str, str]]:
    outside = _adapter(_outside() / "evil")
    (data / "adapters").mkdir(parents=True, exist_ok=True)
    (data / "adapters" / "link").symlink_to(outside)  # a link inside pointing out
    mixed = _adapter(data / "adapters" / "mixed")
    (mixed / "adapter_model.safetensors").unlink()
    (mixed / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    sibling = _adapter(data.parent / f"{data.name}-evil" / "a")  # a prefix of the path, not inside
    return [
        ("a path outside", str(outside)),
        ("a symlink pointing out", str(data / "adapters" / "link")),
        ("a weights file linked out", str(mixed)),
        ("dot-dot out of the data dir", str(data / "adapters" / ".." / ".." / outside.name / "evil")),
        ("a sibling whose name starts like the data dir", str(sibling)),
        ("a relative path", "adapters/x"),
        ("a NUL byte", str(data / "adapters" / "a\0b")),
        ("a link loop", str(_loop(data / "adapters" / "loop"))),
        ("/", "/"),
        ("/etc", "/etc"),
    ]


def test_adapters_load_only_from_inside_the_data_dir(served) -> None:  # type: ignore[no-untyped-def]
    client, engine, data = served
    auth = {"authorization": f"Bearer {TOKEN}"}
    for what, path in _spoilers(data):
        before = engine.changes()
        r = _send(client, "POST", LOAD, {"lora_name": "champion", "lora_path": path}, **auth)
        assert r.status_code == 400, what
        assert any(w in r.text for w in ("inside the server's data dir", "absolute", "resolved")), what
        assert engine.changes() == before, what
    from ratchet.server.app import create_app

    nowhere = create_app(FakeEngine(), MODEL, token=TOKEN)  # type: ignore[arg-type]
    from fastapi.testclient import TestClient

    inside = str(_adapter(data / "adapters" / "ok"))
    r = _send(
        TestClient(nowhere, base_url="http://127.0.0.1:8000"),
        "POST",
        LOAD,
        {"lora_name": "x", "lora_path": inside},
        **auth,
    )
    assert r.status_code == 400 and "loads no adapters" in r.text


def test_the_model_list_names_adapters_never_their_paths(served) -> None:  # type: ignore[no-untyped-def]
    client, engine, data = served
    listed = client.get("/v1/models").text
    assert '"a"' in listed and str(data) not in listed and "/adapters/" not in listed
    assert str(data) not in client.get("/health").text


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
def test_no_swagger_page_on_the_servers_origin(served, path: str) -> None:  # type: ignore[no-untyped-def]
    """Swagger's page loads its script from a CDN, with no integrity check."""
    client, _, _ = served
    assert client.get(path).status_code == 404


# ------------------------------------------------------------------- the real server


def _noop_adapter(folder: Path) -> Path:
    """A LoRA adapter the real server loads: rank 4 on layer 0's q_proj, all zeros (a no-op)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj"],
        "layers_to_transform": [0],
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{prefix}.lora_A.weight": torch.zeros(4, 576), f"{prefix}.lora_B.weight": torch.zeros(576, 4)},
        str(folder / "adapter_model.safetensors"),
    )
    return folder


def _served_ids(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{url}/models").json()["data"]]


def _raw(url: str, method: str, path: str, body: Any, **headers: str | None) -> httpx.Response:
    """A request as a browser (or curl) sends it, to the real server's root."""
    root = url.removesuffix("/v1")
    head = {k.replace("_", "-"): v.encode("latin-1") for k, v in headers.items() if v is not None}
    content = None if body is None else json.dumps(body).encode()
    return httpx.request(method, f"{root}{path}", content=content, headers=head, timeout=60)


@pytest.fixture
def real(embedded_server: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The session's real server and a no-op adapter inside its data dir (the session's
    temporary tree); whatever a test got loaded is unloaded after it."""
    before = set(_served_ids(embedded_server))
    adapter = _noop_adapter(tmp_path / "adapters" / "noop")
    yield embedded_server, adapter
    from ratchet.server.launcher import admin_headers

    # near=: a test may have emptied this process's started-servers table (the autouse
    # fixtures' monkeypatch is undone only after this teardown); the token file is found then
    for name in set(_served_ids(embedded_server)) - before:
        unloaded = httpx.post(
            f"{embedded_server}/unload_lora_adapter",
            json={"lora_name": name},
            headers=admin_headers(embedded_server, near=adapter),
        )
        assert unloaded.status_code == 200, f"{name} left loaded: {unloaded.text}"


@pytest.mark.integration
@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example"])
def test_a_rebound_page_cannot_load_unload_or_reset_on_the_real_server(real, host: str) -> None:  # type: ignore[no-untyped-def]
    url, adapter = real
    port = httpx.URL(url).port
    shown = host if ":" in host else f"{host}:{port}"
    for path, body in [
        (LOAD, {"lora_name": "champion", "lora_path": str(adapter)}),
        (UNLOAD, {"lora_name": "champion"}),
        (RESET, {}),
    ]:
        r = _raw(
            url, "POST", path, body, host=shown, origin=f"http://{shown}", content_type="application/json"
        )
        assert r.status_code == 421, (path, r.status_code, r.text)
    assert _raw(url, "GET", "/v1/models", None, host=shown).status_code == 421
    assert "champion" not in _served_ids(url)


@pytest.mark.integration
def test_a_cross_site_text_plain_post_cannot_reset_the_real_servers_cache(real) -> None:  # type: ignore[no-untyped-def]
    url, _ = real
    here = f"127.0.0.1:{httpx.URL(url).port}"
    r = _raw(url, "POST", RESET, None, host=here, origin="http://attacker.example", content_type="text/plain")
    assert r.status_code in (403, 415)
    r = _raw(url, "POST", RESET, None, host=here, content_type="text/plain")  # no Origin: still no JSON
    assert r.status_code == 415
    r = _raw(
        url, "POST", RESET, {}, host=here, origin="http://attacker.example", content_type="application/json"
    )
    assert r.status_code == 403


@pytest.mark.integration
def test_another_local_process_cannot_load_an_adapter_under_the_champions_name(real) -> None:  # type: ignore[no-untyped-def]
    """Right Host, no Origin, JSON: what any local user's curl sends. Without the token of
    this start nothing loads, unloads or resets."""
    url, adapter = real
    body = {"lora_name": "champion", "lora_path": str(adapter)}
    for auth in (None, "Bearer not-needed", "Bearer x"):
        r = _raw(url, "POST", LOAD, body, content_type="application/json", authorization=auth)
        assert r.status_code in (401, 403), r.text
    assert "champion" not in _served_ids(url)
    assert _raw(url, "POST", RESET, {}, content_type="application/json").status_code == 401


@pytest.mark.integration
def test_the_real_server_loads_from_its_data_dir_only_and_lists_no_paths(real, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from ratchet.server.launcher import admin_headers

    url, adapter = real
    auth = admin_headers(url)
    outside = _noop_adapter(_outside() / "evil")
    link = tmp_path / "adapters" / "link"
    link.symlink_to(outside)
    for path in (outside, link):
        r = httpx.post(
            f"{url}/load_lora_adapter", json={"lora_name": "evil", "lora_path": str(path)}, headers=auth
        )
        assert r.status_code == 400 and "inside the server's data dir" in r.text
    r = httpx.post(
        f"{url}/load_lora_adapter", json={"lora_name": "noop", "lora_path": str(adapter)}, headers=auth
    )
    assert r.status_code == 200, r.text
    listed = httpx.get(f"{url}/models").text
    assert '"noop"' in listed and str(tmp_path) not in listed and "adapters" not in listed
    assert "evil" not in _served_ids(url)


@pytest.mark.integration
def test_the_token_is_in_no_argv_and_its_file_is_private(real) -> None:  # type: ignore[no-untyped-def]
    from ratchet.server.launcher import admin_token, token_file
    from ratchet.server.memory import server_pids

    url, adapter = real
    port = httpx.URL(url).port
    token = admin_token(url)
    assert token and len(token) >= 32
    (pid,) = server_pids("--port", str(port))
    assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()  # `ps` shows argv to everyone
    found = [token_file(p, port) for p in (adapter, *adapter.parents) if token_file(p, port).is_file()]
    assert found, "no token file above the data dir's adapters"
    info = found[0].stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid() and info.st_nlink == 1
    assert found[0].read_text().strip() == token


@pytest.mark.integration
def test_another_process_of_this_user_loads_through_the_token_file(  # type: ignore[no-untyped-def]
    real, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ratchet evolve` in a second process against the same server (model.endpoint): the
    token is found by walking up from the adapter's path; outside the data dir it is not."""
    from ratchet.errors import EndpointError
    from ratchet.server import launcher

    url, adapter = real
    monkeypatch.setattr(launcher, "_STARTED", {})  # this process did not start it
    launcher.ensure_adapter(url, "noop-walked", adapter)
    assert "noop-walked" in _served_ids(url)
    with pytest.raises(EndpointError, match="admin token") as refused:
        launcher.ensure_adapter(url, "evil", _noop_adapter(_outside() / "evil"))
    assert "\n" not in str(refused.value)
    with pytest.raises(httpx.HTTPStatusError):
        launcher.reset_prefix_cache(url)  # no token known, no path to find one from
    launcher.reset_prefix_cache(url, near=adapter)
