"""Attacks on the gateway (`gateway/`), tried as an attacker would, against the real thing: uvicorn
on a real port, raw sockets where a client library would refuse to send what an attacker
sends, and a recording upstream that shows whether anything reached the model with the user's
key. What the gateway must not let through: a web page the user visits (DNS rebinding, a
cross-site post), a client that holds the process's files or memory, bodies built to confuse
whoever reads them after it, text that ends up in a response header, and, bound beyond
loopback, anyone without the gateway's token.
"""

from __future__ import annotations

import json
import os
import select
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ratchet.config import Settings
from ratchet.endpoint.limits import Limits
from ratchet.errors import StateFileError
from ratchet.gateway.guard import gateway_token, token_path
from ratchet.gateway.serve import Gateway
from ratchet.gateway.snapshot import POLICY_HEADER
from tests.test_endpoint_attacks import LogLines, _drops, _peak_rss_reset, _status, _status_kb, _stream
from tests.test_gateway import ASK, Upstream, data_dir


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    with Upstream() as up:
        yield up


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return data_dir(tmp_path_factory.mktemp("gateway-attacks"))


@pytest.fixture(scope="module")
def shared(settings: Settings, upstream: Upstream) -> Iterator[Gateway]:
    with Gateway(settings, upstream.url) as gw:
        yield gw


@pytest.fixture
def gw(shared: Gateway, upstream: Upstream) -> Gateway:
    upstream.seen.clear()
    upstream.status, upstream.delay, upstream.chunks, upstream.cut = 200, 0.0, 3, False
    return shared


def _one_line(got: httpx.Response) -> str:
    message = got.json()["error"]["message"]
    assert isinstance(message, str) and message and "\n" not in message and "Traceback" not in message
    return message


def _root(gw: Gateway) -> str:
    return gw.url.removesuffix("/v1")


# ---------------------------------------------------------------- a web page the user visits


PAGES = {
    "rebound Host": ({"Host": "evil.example"}, 421),
    "rebound Host with the port": ({"Host": "evil.example:8790"}, 421),
    "rebound Host, loopback prefix": ({"Host": "127.0.0.1.evil.example"}, 421),
    "rebound Host, userinfo": ({"Host": "127.0.0.1@evil.example"}, 421),
    "cross-site text/plain": ({"Content-Type": "text/plain", "Origin": "http://evil.example"}, 415),
    "text/plain, no Origin": ({"Content-Type": "text/plain"}, 415),
    "a form": ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
    "foreign Origin": ({"Origin": "http://evil.example"}, 403),
    "another local port's Origin": ({"Origin": "http://127.0.0.1:1"}, 403),
    "null Origin": ({"Origin": "null"}, 403),
    "Sec-Fetch-Site cross-site": ({"Sec-Fetch-Site": "cross-site"}, 403),
}
ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/mcp"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
]


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[p for _, p in ROUTES])
def test_a_web_page_is_refused_on_every_route_before_anything_reaches_the_model(
    gw: Gateway, upstream: Upstream, page: str, method: str, path: str
) -> None:
    headers, code = PAGES[page]
    if method == "GET" and code == 415:
        pytest.skip("a read has no body: no Content-Type rule")
    got = httpx.request(
        method,
        _root(gw) + path,
        content=json.dumps(ASK),
        headers={"Content-Type": "application/json", **headers},
        timeout=30,
    )
    assert got.status_code == code, got.text
    _one_line(got)
    assert upstream.seen == []


def test_a_stream_asked_for_from_a_page_is_refused_too(gw: Gateway, upstream: Upstream) -> None:
    body = json.dumps(ASK | {"stream": True})
    got = httpx.post(f"{gw.url}/chat/completions", content=body, headers={"Content-Type": "text/plain"})
    assert got.status_code == 415 and upstream.seen == []


# ---------------------------------------------------------------- routes and methods


@pytest.mark.parametrize(
    ("method", "path", "code"),
    [
        ("POST", "/v1/completions", 404),
        ("POST", "/v1/embeddings", 404),
        ("GET", "/docs", 404),
        ("GET", "/openapi.json", 404),
        ("GET", "/v1/chat/completions/../../health/x", 404),
        ("POST", "/v1/load_lora_adapter", 404),
        ("POST", "/reset_prefix_cache", 404),
        ("GET", "/", 404),
        ("GET", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
        ("PUT", "/health", 405),
    ],
)
def test_unknown_routes_and_methods_are_one_line_and_never_forwarded(
    gw: Gateway, upstream: Upstream, method: str, path: str, code: int
) -> None:
    head = {"Content-Type": "application/json"}
    with httpx.Client() as c:  # a raw path: httpx would fold the dot segments itself
        req = c.build_request(
            method, _root(gw) + "/", headers=head, content=b"{}" if method != "GET" else None
        )
        req.url = req.url.copy_with(raw_path=path.encode())
        got = c.send(req)
    assert got.status_code == code, got.text
    _one_line(got)
    assert upstream.seen == [] and upstream.loaded == []


# ---------------------------------------------------------------- bodies built to confuse


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        # two readers of the same bytes must not disagree on what was asked
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "messages": []}', "twice"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "a", "content": "b"}]}', "twice"),
        (b'{"model": "m", "messages": [], "temperature": NaN}', "NaN"),
        (b'{"model": "m", "messages": [], "max_tokens": Infinity}', "Infinity"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', "surrogate"),
        (b'{"model": "m", "messages": [], "stream": "true"}', "stream"),
        (b'{"model": "m", "messages": [], "tools": [{"type": "function", "function": 1}, 2]}', "entry 1"),
        (b'{"model": "m", "messages": [' + b"[" * 30_000 + b"]" * 30_000 + b"]}", "JSON"),
        (b"\xef\xbb\xbf\xff{}", "JSON"),
    ],
    ids=["duplicate key", "duplicate nested key", "NaN", "Infinity", "lone surrogate", "stream a string",
         "a tool not an object", "nested 30,000 deep", "not UTF-8"],
)  # fmt: skip
def test_bodies_built_to_confuse_are_one_line_400s_never_forwarded(
    gw: Gateway, upstream: Upstream, raw: bytes, says: str
) -> None:
    got = httpx.post(f"{gw.url}/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert got.status_code == 400 and says in _one_line(got)
    assert got.headers[POLICY_HEADER] == gw.snapshot.version
    assert upstream.seen == []


def test_text_in_the_model_name_never_becomes_a_header(gw: Gateway, upstream: Upstream) -> None:
    """A model name with CR LF and a header after it (and what an upstream echoes back of it)
    ends up in no response header: the gateway's headers come from its snapshot only."""
    evil = "gpt-4o\r\nX-Injected: 1\r\nSet-Cookie: session=stolen"
    got = httpx.post(f"{gw.url}/chat/completions", json=ASK | {"model": evil})
    assert got.status_code == 200
    assert "x-injected" not in got.headers and "set-cookie" not in got.headers
    assert upstream.seen[-1]["body"]["model"] == gw.snapshot.policy.served_model  # the name is replaced
    got = httpx.post(f"{gw.url}/chat/completions", json=ASK | {"model": evil, "stream": True})
    assert "x-injected" not in got.headers and got.headers[POLICY_HEADER] == gw.snapshot.version
    raw = b"\r\n".join(
        [b"GET /v1/models HTTP/1.1", b"Host: 127.0.0.1", b"X-Model: a\r\nX-Injected: 1", b"", b""]
    )
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(raw)
        answer = s.recv(65536)
    assert b"x-injected" not in answer.lower()


def test_an_upstream_error_passes_on_its_status_and_body_but_none_of_its_headers(
    gw: Gateway, upstream: Upstream
) -> None:
    upstream.status = 503
    got = httpx.post(f"{gw.url}/chat/completions", json=ASK)
    assert got.status_code == 503 and got.json()["error"]["message"] == "slow down"
    assert "set-cookie" not in got.headers and "x-upstream-secret" not in got.headers


# ---------------------------------------------------------------- starving the process


def test_an_oversized_body_is_refused_from_its_declared_length_unread(
    gw: Gateway, upstream: Upstream
) -> None:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 17000000\r\n\r\n"
    ).encode()
    # no byte of the body is sent before the answer: on a loaded machine a client still
    # uploading when the refusal comes gets a reset that can swallow the 413 it was sent
    with socket.create_connection(("127.0.0.1", gw.port), timeout=120) as s:
        s.sendall(head)
        readable = select.select([s], [], [], 120)[0]
        answer = s.recv(65536) if readable else b""
    assert _status(answer) == 413
    assert upstream.seen == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/mcp"])
def test_a_chunked_body_is_cut_at_the_limit_while_it_streams(
    gw: Gateway, upstream: Upstream, path: str
) -> None:
    """256 MiB chunked (no length to refuse from the headers): the gateway stops reading at its
    16 MiB limit, so neither the upload nor the memory grows, and it still serves."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\nContent-Type: application/json\r\n"
        "Accept: application/json, text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    rss = _peak_rss_reset()
    sent, answer = _stream(gw.port, head, 256 << 20)
    grown_mb = (_status_kb("VmHWM") - rss) / 1024
    assert sent < 64 << 20, f"the gateway read {sent >> 20} MiB"
    assert _status(answer) in (None, 413)
    assert grown_mb < 150, f"peak memory grew by {grown_mb:.0f} MB"
    assert upstream.seen == []
    assert httpx.post(f"{gw.url}/chat/completions", json=ASK, timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("data", "trickle"),
    [
        (b"", b""),
        (b"POST /v1/chat/completions HTTP/1.1\r\n", b""),
        (b"POST /v1/chat/completions HTTP/1.1\r\n", b"X-Slow: 1\r\n"),
        (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /health HTTP/1.1\r\n", b"X"),
    ],
    ids=["silent", "half a request", "a header line now and then", "keep-alive, then half a request"],
)
def test_slowloris_a_connection_that_never_finishes_its_headers_is_dropped(
    settings: Settings, upstream: Upstream, data: bytes, trickle: bytes
) -> None:
    with Gateway(settings, upstream.url, limits=Limits(header_timeout_s=1)) as gw:
        seconds, _ = _drops(gw.port, data, trickle)
    assert seconds < 30, "the connection was never dropped"


def test_a_body_that_never_arrives_is_408(settings: Settings, upstream: Upstream) -> None:
    upstream.seen.clear()
    with Gateway(settings, upstream.url, limits=Limits(body_timeout_s=1)) as gw:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"messages": '
        )
        seconds, answer = _drops(gw.port, head, b" ")
    assert seconds < 30 and _status(answer) == 408
    assert upstream.seen == []


def test_hundreds_of_slow_connections_neither_starve_a_call_nor_the_log(
    settings: Settings, upstream: Upstream
) -> None:
    """300 connections that send half a request each and then nothing: the gateway keeps at
    most `max_waiting` of them, still answers a real call, and writes a short log."""
    lim = Limits(max_waiting=20, max_connections=60, backlog=16, grace_s=0.2)
    socks: list[socket.socket] = []
    with Gateway(settings, upstream.url, limits=lim) as gw, LogLines() as log:
        try:
            for _ in range(300):
                try:
                    s = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
                    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                    socks.append(s)
                except OSError:
                    pass
            time.sleep(1)
            held = len(gw._server.server_state.connections)
            got = None
            for _ in range(3):  # as OpenAI's client retries a dropped connection
                try:
                    got = httpx.post(f"{gw.url}/chat/completions", json=ASK, timeout=60)
                    break
                except httpx.TransportError:
                    continue
        finally:
            for s in socks:
                s.close()
    assert got is not None and got.status_code == 200
    assert held <= lim.max_waiting + 2 * lim.backlog, held
    assert log.count <= 25, [r.getMessage() for r in log.records[:5]]


# ---------------------------------------------------------------- the token


def test_a_change_on_loopback_needs_the_token(gw: Gateway, settings: Settings) -> None:
    url = f"{_root(gw)}/admin/reload"
    assert httpx.post(url, json={}).status_code == 401
    assert httpx.post(url, json={}, headers={"Authorization": "Bearer " + "x" * 43}).status_code == 403
    token = gateway_token(settings.data_dir)
    got = httpx.post(url, json={}, headers={"Authorization": f"Bearer {token}"})
    assert got.status_code == 200 and got.json()["policy"] == gw.snapshot.version
    # asking the model is no change: a loopback client needs no token for it
    assert httpx.post(f"{gw.url}/chat/completions", json=ASK).status_code == 200


def _local_address() -> str | None:
    """An address of this machine that is not loopback (None: it has none)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the kernel picks the route's address
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_bound_beyond_loopback_every_request_needs_the_token(settings: Settings, upstream: Upstream) -> None:
    address = _local_address()
    if address is None:
        pytest.skip("this machine has no address beyond loopback")
    upstream.seen.clear()
    token = gateway_token(settings.data_dir)
    with Gateway(settings, upstream.url, host=address) as gw, LogLines() as log:
        assert gw.public
        base = gw.url
        for method, path in ROUTES:  # no token, reads included
            got = httpx.request(method, base.removesuffix("/v1") + path, json=ASK)
            assert got.status_code == 401 and "gateway.token" in _one_line(got), path
        wrong = {"Authorization": "Bearer " + token[:-1] + ("A" if token[-1] != "A" else "B")}
        assert httpx.post(f"{base}/chat/completions", json=ASK, headers=wrong).status_code == 403
        assert upstream.seen == []
        ok = {"Authorization": f"Bearer {token}"}
        got = httpx.post(f"{base}/chat/completions", json=ASK, headers=ok | {"Host": "gateway.example.com"})
        assert got.status_code == 200 and len(upstream.seen) == 1  # any Host, once the token is there
        # the token does not open the door to a web page's request
        page = ok | {"Origin": "http://evil.example"}
        assert httpx.post(f"{base}/chat/completions", json=ASK, headers=page).status_code == 403
        plain = ok | {"Content-Type": "text/plain"}
        assert (
            httpx.post(f"{base}/chat/completions", content=json.dumps(ASK), headers=plain).status_code == 415
        )
        for _ in range(200):  # a flood of guesses writes a bounded log
            httpx.get(f"{base}/models")
    assert log.count <= 25
    with pytest.raises(httpx.TransportError):  # not on loopback: bound to that address only
        httpx.get(f"http://127.0.0.1:{gw.port}/health", timeout=2)


def test_a_token_file_others_may_read_is_refused_in_one_line(tmp_path: Path) -> None:
    gateway_token(tmp_path)
    path = token_path(tmp_path)
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IROTH)
    with pytest.raises(StateFileError, match="may be read by others") as info:
        gateway_token(tmp_path)
    assert "\n" not in str(info.value) and path.read_text().strip() not in str(info.value)
    other = tmp_path / "elsewhere"
    other.mkdir()
    os.symlink(path, token_path(other))
    with pytest.raises(StateFileError, match="symlink"):
        gateway_token(other)


def test_refused_clients_do_not_flood_the_log(gw: Gateway) -> None:
    with LogLines() as log, httpx.Client(timeout=30) as c:
        for _ in range(300):
            c.post(f"{_root(gw)}/admin/reload", json={})
        for _ in range(100):
            with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as s:
                s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
                s.recv(4096)
    assert log.count <= 50, [r.getMessage() for r in log.records[:3]]


CONVERT_FN = ASK["tools"][0]["function"]
HOSTILE = {
    "a tool name not text": {"tools": [{"type": "function", "function": {"name": 5}}]},
    "parameters not a schema": {
        "tools": [{"type": "function", "function": {"name": "convert", "parameters": "x"}}]
    },
    "properties not an object": {
        "tools": [{"type": "function", "function": CONVERT_FN | {"parameters": {"properties": "x"}}}]
    },
    "a unit's schema not an object": {
        "tools": [
            {"type": "function", "function": CONVERT_FN | {"parameters": {"properties": {"from_unit": 7}}}}
        ]
    },
    "an enum not a list": {
        "tools": [
            {
                "type": "function",
                "function": CONVERT_FN | {"parameters": {"properties": {"to_unit": {"enum": "km"}}}},
            }
        ]
    },
    "a tool of another type": {"tools": [{"type": "code_interpreter"}]},
    "a tool without a function": {"tools": [{"type": "function"}]},
    "content a number": {"messages": [{"role": "user", "content": 5}]},
    "content parts of numbers": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}, 3]}]},
    "no role": {"messages": [{"content": "hi"}]},
    "tool calls not a list": {
        "messages": [{"role": "user", "content": "3 km"}, {"role": "assistant", "tool_calls": "convert"}]
    },
    "tool call arguments an object": {
        "messages": [
            {"role": "user", "content": "3 km"},
            {"role": "assistant", "tool_calls": [{"function": {"name": "convert", "arguments": {"a": 1}}}]},
            {"role": "tool", "content": 5},
        ]
    },
    "tool call arguments not JSON": {
        "messages": [
            {"role": "assistant", "tool_calls": [{"function": {"name": "convert", "arguments": "{nope"}}, 3]},
        ]
    },
    "a model not text": {"model": {"$gt": ""}},
    "tool_choice naming nothing": {"tool_choice": {"type": "function", "function": {"name": None}}},
}


@pytest.mark.parametrize("change", HOSTILE.values(), ids=list(HOSTILE))
def test_hostile_shapes_under_a_live_constraint_are_never_a_500(
    gw: Gateway, upstream: Upstream, change: dict
) -> None:
    """Shapes no agent should send, under a champion whose constraint rewrites `convert`'s
    schema: passed on as they are (the model server judges them) or one 400 line, never a 500,
    and the gateway still serves."""
    got = httpx.post(f"{gw.url}/chat/completions", json=ASK | change, timeout=30)
    assert got.status_code in (200, 400), got.text
    if got.status_code == 400:
        _one_line(got)
    assert httpx.post(f"{gw.url}/chat/completions", json=ASK, timeout=30).status_code == 200
