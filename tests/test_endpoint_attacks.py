"""Attacks on the intervention endpoint (`endpoint/`), tried as an attacker would, against the
real thing: uvicorn on 127.0.0.1, real HTTP over sockets, and a scripted model upstream that
keeps every request that reached it and the credentials it carried. Each test is a row of
docs/security.md, "The intervention endpoint (your own agent)":

* a web page or a local process spending the user's model key through the endpoint;
* a client starving the loop's process (files, log) or its memory;
* requests the recording cannot read, or JSON the model's API cannot carry.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response

from ratchet.agents.rollout import RolloutSlot
from ratchet.config import AgentSettings, TaskFileSettings
from ratchet.endpoint.agent import YourAgent, run_agent_rollout
from ratchet.endpoint.recording import Arm
from ratchet.endpoint.serve import InterventionEndpoint
from ratchet.suites.task_file import TaskFileSuite
from ratchet.types import Policy, Trajectory

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "units"
MODEL = "smollm2-135m-instruct"
USER_KEY = "sk-the-users-own-upstream-key"
HI = {"model": "gpt-4o", "messages": [{"role": "user", "content": "What is 3 km in m?"}]}
COMPLETION = {
    "id": "c1",
    "object": "chat.completion",
    "created": 0,
    "model": MODEL,
    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "3000 m"}}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
}


class FakeModel:
    """A scripted OpenAI-compatible model on a real port: answers `reply` (bytes, as written) to
    anything under /v1, and keeps each request (path, its Authorization header, its body)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.reply = json.dumps(COMPLETION).encode()
        app = FastAPI()

        @app.api_route("/v1/{path:path}", methods=["GET", "POST"])
        async def anything(path: str, request: Request) -> Response:
            self.seen.append(
                {"path": path, "auth": request.headers.get("authorization"), "body": await request.body()}
            )
            return Response(self.reply, media_type="application/json")

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve(sockets=[self._sock])), daemon=True
        )

    def __enter__(self) -> FakeModel:
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


@pytest.fixture(scope="module")
def model() -> Iterator[FakeModel]:
    with FakeModel() as fake:
        yield fake


@pytest.fixture(scope="module")
def shared(model: FakeModel) -> Iterator[InterventionEndpoint]:
    """One endpoint with the default limits, in front of the fake model."""
    with InterventionEndpoint(model.url, USER_KEY, timeout_s=10) as ep:
        yield ep


@pytest.fixture
def ep(shared: InterventionEndpoint, model: FakeModel) -> InterventionEndpoint:
    model.seen.clear()
    model.reply = json.dumps(COMPLETION).encode()
    return shared


def _arm(max_steps: int = 4) -> Arm:
    return Arm(Policy(model=MODEL), temperature=0.0, seed=3, max_steps=max_steps)


def _one_line_error(got: httpx.Response) -> str:
    """The refusal's message: JSON, one line, no traceback."""
    body = got.json()
    message = body["error"]["message"] if "error" in body else body["detail"]
    assert isinstance(message, str) and message and "\n" not in message and "Traceback" not in message
    return message


def _status(answer: bytes) -> int | None:
    """The status code of a raw HTTP answer (None: nothing came back)."""
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


class LogLines(logging.Handler):
    """Counts the records of WARNING and above that reach the root or uvicorn's loggers."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self._loggers = [logging.getLogger(), logging.getLogger("uvicorn")]

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> LogLines:
        for lg in self._loggers:
            lg.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for lg in self._loggers:
            lg.removeHandler(self)

    @property
    def count(self) -> int:
        return len({id(r) for r in self.records})


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _connections(ep: InterventionEndpoint) -> int:
    """The connections the endpoint's server holds open."""
    return len(ep._server.server_state.connections)


# ---------------------------------------------------------------- 3: the user's key, spent by others


@pytest.mark.parametrize(
    ("method", "path", "headers", "body", "codes"),
    [
        ("POST", "/v1/chat/completions", {}, HI, {401}),
        ("POST", "/v1/chat/completions", {}, HI | {"stream": True}, {401}),
        ("POST", "/v1/chat/completions", {"X-Ratchet-Rollout": ""}, HI, {401}),
        ("GET", "/v1/models", {}, None, {401}),
        ("POST", "/v1/completions", {}, {"model": "gpt-4o", "prompt": "hi"}, {401, 404}),
        # a web page: a preflight-free text/plain post (fetch no-cors, a form), a foreign Origin,
        # DNS rebinding (Host of the attacker's name, with or without the port)
        (
            "POST",
            "/v1/chat/completions",
            {"Content-Type": "text/plain", "Origin": "http://evil.example"},
            HI,
            {415},
        ),
        ("POST", "/v1/chat/completions", {"Origin": "http://evil.example"}, HI, {403}),
        ("POST", "/v1/chat/completions", {"Host": "evil.example"}, HI, {421}),
        ("POST", "/v1/chat/completions", {"Host": "127.0.0.1.evil.example:80"}, HI, {421}),
        ("GET", "/v1/models", {"Host": "evil.example"}, None, {421}),
    ],
    ids=[
        "no key",
        "no key, streamed",
        "empty header key",
        "models without a key",
        "another API path",
        "cross-site text/plain",
        "foreign Origin",
        "rebound Host",
        "rebound Host, loopback prefix",
        "models from a rebound Host",
    ],
)
def test_a_call_without_a_key_never_reaches_the_model_with_the_users_key(
    ep: InterventionEndpoint,
    model: FakeModel,
    method: str,
    path: str,
    headers: dict[str, str],
    body: Any,
    codes: set[int],
) -> None:
    before = ep.rollouts.unattributed
    content = None if body is None else json.dumps(body).encode()
    head = {"Content-Type": "application/json"} if content is not None else {}
    got = httpx.request(method, ep.url + path, content=content, headers=head | headers, timeout=30)
    assert got.status_code in codes, got.text
    _one_line_error(got)
    assert model.seen == []  # nothing forwarded: not the user's key, not the caller's model
    if got.status_code == 401:
        assert ep.rollouts.unattributed > before  # still counted, as /health shows


def test_models_needs_a_key_and_is_answered_here(ep: InterventionEndpoint, model: FakeModel) -> None:
    """The list names the one model a rollout is served (its `model` is overridden anyway), and
    the upstream's own list (adapter names, the user's account) is never asked for."""
    rec = ep.rollouts.open(_arm())
    by_path = httpx.get(f"{ep.rollout_url(rec.key)}/models", timeout=30)
    by_header = httpx.get(f"{ep.url}/v1/models", headers={"X-Ratchet-Rollout": rec.key}, timeout=30)
    for got in (by_path, by_header):
        assert got.status_code == 200, got.text
        assert [m["id"] for m in got.json()["data"]] == [MODEL]
    assert httpx.get(f"{ep.url}/r/{'x' * len(rec.key)}/v1/models", timeout=30).status_code == 404
    assert model.seen == [] and rec.calls == []


def test_a_keyed_call_still_reaches_the_model_with_the_users_key(
    ep: InterventionEndpoint, model: FakeModel
) -> None:
    """The agent the rollout was given to: forwarded as before, with the policy's model."""
    rec = ep.rollouts.open(_arm())
    got = httpx.post(f"{ep.rollout_url(rec.key)}/chat/completions", json=HI, timeout=30)
    assert got.status_code == 200 and got.json()["choices"][0]["message"]["content"] == "3000 m"
    (seen,) = model.seen
    assert seen["auth"] == f"Bearer {USER_KEY}" and json.loads(seen["body"])["model"] == MODEL
    assert len(rec.calls) == 1 and rec.calls[0].reply is not None


ROUTES = [
    ("POST", "/r/{key}/v1/chat/completions"),
    ("GET", "/r/{key}/v1/models"),
    ("POST", "/r/{key}/mcp"),
    ("GET", "/health"),
]
PAGES = {  # what a page's request carries, and the refusal it gets
    "rebound Host": ({"Host": "evil.example"}, 421),
    "rebound Host with the port": ({"Host": "evil.example:{port}"}, 421),
    "loopback name as a prefix": ({"Host": "localhost.evil.example"}, 421),
    "userinfo trick": ({"Host": "127.0.0.1@evil.example"}, 421),
    "foreign Origin": ({"Origin": "http://evil.example"}, 403),
    "Origin null": ({"Origin": "null"}, 403),
    "another local port": ({"Origin": "http://127.0.0.1:9"}, 403),
    "Origin suffix trick": ({"Origin": "http://127.0.0.1:{port}.evil.example"}, 403),
    "Sec-Fetch-Site cross-site": ({"Sec-Fetch-Site": "cross-site"}, 403),
    "text/plain": ({"Content-Type": "text/plain"}, 415),
    "form": ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
    "no Content-Type": ({"Content-Type": ""}, 415),
}


@pytest.mark.parametrize(("method", "route"), ROUTES, ids=[r for _, r in ROUTES])
@pytest.mark.parametrize(("headers", "code"), list(PAGES.values()), ids=list(PAGES))
def test_a_web_page_holding_a_key_is_refused_on_every_route(
    ep: InterventionEndpoint, model: FakeModel, method: str, route: str, headers: dict[str, str], code: int
) -> None:
    """The dashboard's Host/Origin/Content-Type rules on every route, reads included (a key
    leaked into a page's hands is still no way in)."""
    if method == "GET" and "Content-Type" in headers:
        pytest.skip("a read has no body: no Content-Type rule")
    rec = ep.rollouts.open(_arm())
    head = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    head |= {k: v.format(port=ep.port) for k, v in headers.items()}
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"} if "mcp" in route else HI
    content = json.dumps(body).encode() if method == "POST" else None
    got = httpx.request(method, ep.url + route.format(key=rec.key), content=content, headers=head, timeout=30)
    assert got.status_code == code, got.text
    _one_line_error(got)
    assert model.seen == [] and rec.calls == [] and rec.tool_runs == []


# ---------------------------------------------------------------- 4: starving the loop's process


def _stream(port: int, head: bytes, total: int, piece: bytes | None = None) -> tuple[int, bytes]:
    """Send `head`, then `piece` (default: a 1 MiB body chunk) again and again until the server
    answers or stops reading (or `total` bytes went out): the bytes sent, and what came back."""
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    chunked = piece is None
    piece = piece or b"100000\r\n" + b"x" * (1 << 20) + b"\r\n"
    sent, answer = 0, b""
    try:
        s.sendall(head)
        while sent < total and not select.select([s], [], [], 0)[0]:
            s.sendall(piece)
            sent += len(piece)
        if sent >= total and chunked:
            s.sendall(b"0\r\n\r\n")
        answer = s.recv(65536)
    except OSError:  # the server closed the connection under the upload: it stopped reading
        pass
    finally:
        s.close()
    return sent, answer


def _peak_rss_reset() -> int:
    """Reset this process's peak resident size (Linux `clear_refs`), and return the current one (kB)."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


@pytest.mark.parametrize("keyed", [True, False], ids=["with a key", "without a key"])
def test_a_chunked_body_is_cut_at_the_limit_while_it_streams(
    ep: InterventionEndpoint, model: FakeModel, keyed: bool
) -> None:
    """256 MiB chunked (no length to refuse from the headers): the server stops reading at its
    16 MiB limit (without a key: before the body), so neither the upload nor the memory grows."""
    rec = ep.rollouts.open(_arm())
    path = f"/r/{rec.key}/v1/chat/completions" if keyed else "/v1/chat/completions"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{ep.port}\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    rss = _peak_rss_reset()
    sent, answer = _stream(ep.port, head, 256 << 20)
    grown_mb = (_status_kb("VmHWM") - rss) / 1024
    assert sent < 64 << 20, f"the server read {sent >> 20} MiB"
    assert _status(answer) in (None, 413 if keyed else 401)  # or it closed under the upload
    assert grown_mb < 150, f"peak memory grew by {grown_mb:.0f} MB"
    assert rec.calls == [] and model.seen == []
    # and the endpoint still serves
    ok = httpx.post(f"{ep.rollout_url(rec.key)}/chat/completions", json=HI, timeout=30)
    assert ok.status_code == 200


def test_endless_headers_are_cut_at_16_kib(ep: InterventionEndpoint, model: FakeModel) -> None:
    """Header lines that never end (no blank line): refused once they pass h11's 16 KiB, where
    the parser uvicorn picks by default (httptools) keeps every header it was sent."""
    rec = ep.rollouts.open(_arm())
    head = f"POST /r/{rec.key}/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
    sent, answer = _stream(ep.port, head, 64 << 20, b"X-Pad: " + b"a" * 1000 + b"\r\n")
    assert sent < 8 << 20, f"the server read {sent >> 20} MiB of headers"
    assert _status(answer) in (None, 400, 431)
    assert rec.calls == [] and model.seen == []


SLOWLORIS = r"""
import socket, sys, time
port, n, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"

def connect():
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(head)
    return s

socks = [connect() for _ in range(n)]
print(len(socks), flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:  # a header line now and then, never the end; reconnect when dropped
    for i, s in enumerate(socks):
        try:
            s.send(b"X-Slow: 1\r\n")
        except OSError:
            s.close()
            try:
                socks[i] = connect()
            except OSError:
                pass
    time.sleep(0.5)
"""


def _keyed_call(ep: InterventionEndpoint, rec_key: str, attempts: int = 3) -> httpx.Response:
    """A rollout's call, retried as OpenAI's client retries a dropped connection (twice)."""
    for attempt in range(attempts):
        try:
            return httpx.post(f"{ep.rollout_url(rec_key)}/chat/completions", json=HI, timeout=120)
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("limits", "attackers"),
    [({}, 500), ({"max_waiting": 10, "max_connections": 40, "backlog": 16}, 300)],
    ids=["default limits", "tight limits"],
)
def test_slowloris_neither_starves_a_keyed_call_nor_the_process_of_files(
    model: FakeModel, limits: dict[str, int], attackers: int
) -> None:
    """Hundreds of connections that send header lines and never finish, reconnecting as soon
    as they are dropped (from another process, so this process's open files are the
    endpoint's): a rollout's call is still served, and the log stays short. The connections
    held stay near `max_waiting` (the median of samples under attack), and even while hundreds
    reconnect at once within the cap plus the accept batches in flight (`backlog`)."""
    from ratchet.endpoint.limits import Limits, connection_cap

    lim = Limits(**limits)
    usual, most = min(lim.max_waiting, connection_cap(lim)), connection_cap(lim) + 2 * lim.backlog
    with InterventionEndpoint(model.url, USER_KEY, timeout_s=10, limits=lim) as ep:
        before = _fds()
        attacker = subprocess.Popen(
            [sys.executable, "-c", SLOWLORIS, str(ep.port), str(attackers), "120"],
            stdout=subprocess.PIPE,
            text=True,
        )
        held: list[tuple[int, int]] = []  # (connections, more open files), sampled under attack
        try:
            with LogLines() as log:
                assert attacker.stdout is not None and int(attacker.stdout.readline()) == attackers
                time.sleep(2 * lim.grace_s)
                for _ in range(15):
                    time.sleep(0.2)
                    held.append((_connections(ep), _fds() - before))
                rec = ep.rollouts.open(_arm())
                started = time.monotonic()
                got = _keyed_call(ep, rec.key)
                waited = time.monotonic() - started
                for _ in range(10):
                    time.sleep(0.2)
                    held.append((_connections(ep), _fds() - before))
        finally:
            attacker.kill()
            attacker.wait()
    assert got.status_code == 200 and len(rec.calls) == 1
    assert waited < 60, f"a keyed call waited {waited:.1f} s"
    connections, files = sorted(c for c, _ in held), sorted(f for _, f in held)
    assert connections[len(held) // 2] <= usual + 20 and files[len(held) // 2] <= usual + 40, held
    assert connections[-1] <= most and files[-1] <= most + 40, held
    assert log.count <= 25, [r.getMessage() for r in log.records[:5]]


def test_floods_of_garbage_or_unkeyed_calls_write_a_bounded_log(ep: InterventionEndpoint) -> None:
    """Each request uvicorn cannot parse, and each call without a key, used to be a log line of
    its own: 400 of each are now a handful of lines."""
    with LogLines() as log:
        for _ in range(400):
            with socket.create_connection(("127.0.0.1", ep.port), timeout=30) as s:
                s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
                s.recv(4096)
        with httpx.Client(timeout=30) as client:
            for _ in range(400):
                client.post(f"{ep.url}/v1/chat/completions", json=HI)
    assert log.count <= 50, f"{log.count} log lines: {[r.getMessage() for r in log.records[:3]]}"


def _drops(port: int, data: bytes, trickle: bytes = b"", within: float = 60.0) -> tuple[float, bytes]:
    """Connect, send `data`, then `trickle` every 0.2 s; the seconds until the server closes the
    connection (inf: not within `within`) and what it answered."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    started = time.monotonic()
    answer = b""
    try:
        s.sendall(data)
        s.settimeout(0.2)
        while time.monotonic() - started < within:
            try:
                got = s.recv(65536)
            except TimeoutError:
                if trickle:
                    s.sendall(trickle)
                continue
            if not got:
                return time.monotonic() - started, answer
            answer += got
    except OSError:
        return time.monotonic() - started, answer
    finally:
        s.close()
    return float("inf"), answer


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
def test_a_connection_that_never_finishes_its_headers_is_dropped(
    model: FakeModel, data: bytes, trickle: bytes
) -> None:
    from ratchet.endpoint.limits import Limits

    with InterventionEndpoint(model.url, USER_KEY, timeout_s=10, limits=Limits(header_timeout_s=1)) as ep:
        seconds, _ = _drops(ep.port, data, trickle)
    assert seconds < 30, "the connection was never dropped"


def test_a_body_that_never_arrives_is_dropped(model: FakeModel) -> None:
    from ratchet.endpoint.limits import Limits

    with InterventionEndpoint(model.url, USER_KEY, timeout_s=10, limits=Limits(body_timeout_s=1)) as ep:
        rec = ep.rollouts.open(_arm())
        head = (
            f"POST /r/{rec.key}/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"messages": '
        ).encode()
        seconds, answer = _drops(ep.port, head, b" ")
        assert seconds < 30 and _status(answer) == 408
        assert rec.calls == [] and model.seen == []


def test_a_client_that_never_reads_its_answer_is_dropped(model: FakeModel) -> None:
    """A 16 MiB answer to a client with a tiny receive window that never reads: uvicorn waited
    on the write forever, holding the connection (and its answer) until the attacker left."""
    from ratchet.endpoint.limits import Limits

    model.reply = json.dumps(COMPLETION | {"padding": "x" * (16 << 20)}).encode()
    with InterventionEndpoint(model.url, USER_KEY, timeout_s=30, limits=Limits(write_timeout_s=1)) as ep:
        rec = ep.rollouts.open(_arm())
        body = json.dumps(HI).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", ep.port))
        s.sendall(
            f"POST /r/{rec.key}/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{ep.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 60
        while not rec.calls and time.monotonic() < deadline:  # the call is under way
            time.sleep(0.1)
        while _connections(ep) and time.monotonic() < deadline:
            time.sleep(0.2)
        held = _connections(ep)
        s.close()
    model.reply = json.dumps(COMPLETION).encode()
    assert rec.calls and rec.calls[0].reply is not None  # answered: the write is what stalled
    assert held == 0, "the connection that reads nothing is still held"


# ---------------------------------------------------------------- 5: what the recording cannot read


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": NaN}',
        b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
        b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -Infinity}',
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        b'{"messages": [{"role": "user", "content": "\\udc80"}]}',
        b'{"messages": [{"role": "user", "content": "hi"}], "user": {"\\ud83d": 1}}',
        b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
        b'{"name": "f", "parameters": {"type": "object", "properties": {"x": {"default": NaN}}}}}]}',
    ],
    ids=[
        "NaN",
        "Infinity",
        "-Infinity",
        "lone high surrogate",
        "lone low surrogate",
        "surrogate key",
        "NaN in a tool",
    ],
)
def test_json_the_model_api_cannot_carry_is_a_one_line_400(
    ep: InterventionEndpoint, model: FakeModel, raw: bytes
) -> None:
    rec = ep.rollouts.open(_arm())
    got = httpx.post(
        f"{ep.rollout_url(rec.key)}/chat/completions",
        content=raw,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert got.status_code == 400, got.text
    _one_line_error(got)
    assert rec.calls == [] and model.seen == []  # nothing half-recorded, nothing forwarded


@pytest.mark.parametrize(
    "reply",
    [
        b'{"choices": [{"message": {"role": "assistant", "content": NaN}}]}',
        b'{"choices": [{"message": {"role": "assistant", "content": "\\ud800"}}]}',
        b"[1, 2]",
    ],
    ids=["NaN", "lone surrogate", "not an object"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_model_reply_json_cannot_carry_is_a_recorded_error_not_a_500(
    ep: InterventionEndpoint, model: FakeModel, reply: bytes, stream: bool
) -> None:
    model.reply = reply
    rec = ep.rollouts.open(_arm())
    got = httpx.post(f"{ep.rollout_url(rec.key)}/chat/completions", json=HI | {"stream": stream}, timeout=30)
    assert got.status_code == 502, got.text
    _one_line_error(got)
    (call,) = rec.calls
    assert call.reply is None and call.error and "\n" not in call.error  # recorded as why, not half


def test_a_streamed_reply_is_sent_whole_or_is_a_recorded_error(
    ep: InterventionEndpoint, model: FakeModel
) -> None:
    """A stream is built before its first byte: a reply that leaves out what the chunks repeat
    (id, time, usage) still streams; one with no choice to stream is a 502, not a cut stream."""
    from openai import OpenAI

    rec = ep.rollouts.open(_arm())
    bare = {"choices": [{"message": {"role": "assistant", "content": "3000 m"}}]}
    model.reply = json.dumps(bare).encode()
    client = OpenAI(base_url=ep.rollout_url(rec.key), api_key="x", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=HI["messages"], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "3000 m"
    model.reply = json.dumps({"choices": []}).encode()
    got = httpx.post(f"{ep.rollout_url(rec.key)}/chat/completions", json=HI | {"stream": True}, timeout=30)
    assert got.status_code == 502 and "stream cannot carry" in _one_line_error(got)
    assert rec.calls[0].reply == bare and rec.calls[1].reply is None and rec.calls[1].error


@pytest.fixture
def units(monkeypatch: pytest.MonkeyPatch) -> TaskFileSuite:
    monkeypatch.chdir(EXAMPLE)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    return TaskFileSuite(TaskFileSettings(file=EXAMPLE / "tasks.jsonl", score="score:score", max_steps=4))


BAD_AGENTS = """
from openai import OpenAI

GOOD = [{"role": "user", "content": "3 km in m?"}]

def _client(base_url):
    return OpenAI(base_url=base_url, api_key="x", max_retries=0)

def tools_not_objects(question, base_url):
    _client(base_url).chat.completions.create(model="m", messages=GOOD, tools=["a", 1])
    return "3000"

def a_message_not_an_object(question, base_url):
    _client(base_url).chat.completions.create(model="m", messages=["hi", {"role": "user", "content": "x"}])
    return "3000"

def a_later_message_not_an_object(question, base_url):
    _client(base_url).chat.completions.create(model="m", messages=[*GOOD, 5])
    return "3000"

def tools_not_a_list(question, base_url):
    _client(base_url).chat.completions.create(model="m", messages=GOOD, tools="convert")
    return "3000"

def ignores_the_refusal(question, base_url):
    try:
        _client(base_url).chat.completions.create(model="m", messages=GOOD, tools=["a", 1])
    except Exception:
        pass
    return "3000"

def answers_a_lone_surrogate(question, base_url):
    _client(base_url).chat.completions.create(model="m", messages=GOOD)
    return "3000 \\ud800"

def plain(question, base_url):
    _client(base_url).chat.completions.create(model="m", messages=GOOD)
    return "3000"
"""


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("tools_not_objects", "'tools' entry 0 is not an object"),
        ("a_message_not_an_object", "'messages' entry 0 is not an object"),
        ("a_later_message_not_an_object", "'messages' entry 1 is not an object"),
        ("tools_not_a_list", "'tools' must be a list"),
        ("ignores_the_refusal", "'tools' entry 0 is not an object"),
        ("answers_a_lone_surrogate", "cannot be stored"),
    ],
    ids=[
        "tools not objects",
        "a message not an object",
        "a later message not an object",
        "tools not a list",
        "an agent that ignores the refusal",
        "an answer with a lone surrogate",
    ],
)
def test_requests_the_recording_cannot_read_end_as_error_trajectories_that_say_why(
    ep: InterventionEndpoint,
    units: TaskFileSuite,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    entry: str,
    says: str,
) -> None:
    (tmp_path / "bad_requests.py").write_text(BAD_AGENTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bad_requests", raising=False)
    slot = RolloutSlot("ev", 1, units.tasks("dev", 1)[0], 0)  # type: ignore[arg-type]
    traj = run_agent_rollout(YourAgent(AgentSettings(entry=f"bad_requests:{entry}")), units, slot, ep, _arm())
    assert traj.status == "error" and says in (traj.error or ""), traj.error
    Trajectory.model_validate_json(traj.model_dump_json())  # what the store writes


def test_a_reply_the_recording_cannot_read_ends_as_an_error_trajectory(
    ep: InterventionEndpoint,
    model: FakeModel,
    units: TaskFileSuite,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model (or a proxy before it) whose usage is not numbers: the call is forwarded and
    answered, and the step built from it cannot be; the rollout says so instead of raising."""
    (tmp_path / "bad_requests.py").write_text(BAD_AGENTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bad_requests", raising=False)
    model.reply = json.dumps(COMPLETION | {"usage": {"prompt_tokens": "many"}}).encode()
    slot = RolloutSlot("ev", 1, units.tasks("dev", 1)[0], 0)  # type: ignore[arg-type]
    traj = run_agent_rollout(YourAgent(AgentSettings(entry="bad_requests:plain")), units, slot, ep, _arm())
    assert traj.status == "error" and "recorded calls cannot be read" in (traj.error or ""), traj.error
    assert "\n" not in (traj.error or "")
