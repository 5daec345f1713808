"""How much of the loop's process one HTTP client of the intervention endpoint may hold.

The endpoint runs inside the loop's process, so a client that holds its sockets, memory or log
holds the loop. uvicorn bounds none of these by itself: a connection that never finishes its
headers is kept forever (slowloris: ~1,000 of them and the process has no files left), a client
that reads no answer parks its write forever, and each request it cannot parse is a log line.

* `Limits`: every number, in one place;
* `GuardedH11`: uvicorn's h11 protocol (16 KiB of headers at most, where httptools, uvicorn's
  default, keeps all it is sent), plus a deadline on each request's headers (from the
  connection's start, or from the last answer on a kept-alive one), a deadline on a stalled
  write, at most `max_waiting` connections with no request in progress (the longest-waiting
  dropped first, once it has sent half a request or nothing for `grace_s`) and
  `max_connections` in all;
* `RateLimitedLog`: what all of it (and the endpoint's own refusals) may write to the log;
* `declared_refusal`, `read_body`, `replayed`: a request's body, refused from its declared
  length or read whole within `max_body` and `body_timeout_s`, then replayed to the app;
* `listening_socket`, `server_config`: the socket and the uvicorn config a server held to all
  of it runs on.

Shared by every standing server ratchet runs in front of a model (the intervention endpoint,
the gateway).

uvicorn's `limit_concurrency` is not used: it counts idle connections too, so a slowloris
attack would turn every real request into a 503.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import uvicorn
from starlette.types import ASGIApp, Message, Receive
from uvicorn.protocols.http.h11_impl import H11Protocol

KEEP_ALIVE_S = 5  # an idle kept-alive connection is closed after this (uvicorn's default, said here)
Refusal = tuple[int, str]


@dataclass(frozen=True)
class Limits:
    """What one client may hold. The defaults leave a real agent far from every bound."""

    max_body: int = 16 * 1024 * 1024  # bytes of a request body; past it 413, not read further
    body_timeout_s: float = 30.0  # for a whole body to arrive, from its first read: 408
    header_timeout_s: float = 10.0  # for a request's headers, from the connection or the last answer
    write_timeout_s: float = 30.0  # for a stalled answer to drain (a client that reads nothing)
    max_waiting: int = 128  # connections with no request in progress; past it the oldest go
    grace_s: float = 0.5  # a connection this young that has sent nothing is not dropped for room
    max_connections: int = 512  # in all (at most a quarter of the file limit); past it a new one goes
    backlog: int = 128  # the listen queue, and so the most connections accepted in one go
    max_header_bytes: int = 16 * 1024  # a request line and its headers (h11's own limit)
    log_lines_per_minute: int = 20


class RateLimitedLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger that writes at most `per_minute` lines a minute, so a client cannot flood the
    loop's log; the next line written says how many were left out."""

    def __init__(self, logger: logging.Logger, per_minute: int) -> None:
        super().__init__(logger, {})
        self.per_minute = per_minute
        self._since = -60.0
        self._written = 0
        self._left_out = 0
        self._lock = threading.Lock()

    @property
    def level(self) -> int:
        """uvicorn reads it to decide whether to build TRACE lines."""
        return self.logger.getEffectiveLevel()

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        with self._lock:
            now = time.monotonic()
            if now - self._since >= 60.0:
                self._since, self._written = now, 0
            if self._written >= self.per_minute:
                self._left_out += 1
                return
            self._written += 1
            left_out, self._left_out = self._left_out, 0
        if left_out:
            msg = f"{msg} ({left_out} more lines left out: at most {self.per_minute} a minute)"
        self.logger.log(level, msg, *args, **kwargs)


def connection_cap(limits: Limits) -> int:
    """`max_connections`, and never more than a quarter of the process's open-file limit: the
    loop's own files (its stores, its model calls) need the rest."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (
        limits.max_connections if soft == resource.RLIM_INFINITY else min(limits.max_connections, soft // 4)
    )


class Guard:
    """One server's connections: which are waiting for a request, and how many are open."""

    def __init__(self, limits: Limits, log: RateLimitedLog) -> None:
        self.limits, self.log = limits, log
        self.max_connections = connection_cap(limits)
        self.open: set[GuardedH11] = set()
        self.waiting: dict[GuardedH11, float] = {}  # since when, oldest first
        self._sweep: asyncio.TimerHandle | None = None

    def admit(self, conn: GuardedH11) -> None:
        """A new connection: past `max_connections` it takes the place of a waiting one that
        may go (`droppable`), or is closed at once; past `max_waiting`, room is made."""
        if len(self.open) > self.max_connections:
            now = conn.loop.time()
            victim = next((c for c, since in self.waiting.items() if c.droppable(since, now)), conn)
            if victim is conn:
                self.log.warning("%d connections open, a new one closed", len(self.open))
            victim.drop()
        if len(self.waiting) > self.limits.max_waiting:
            self.make_room(conn.loop)

    def make_room(self, loop: asyncio.AbstractEventLoop) -> None:
        """Drop the longest-waiting connections that may go until `max_waiting` are left; if
        young silent ones keep it over, look again when the oldest one's grace ends."""
        now = loop.time()
        excess = len(self.waiting) - self.limits.max_waiting
        young: list[float] = []
        for conn, since in list(self.waiting.items()):
            if excess <= 0:
                return
            if conn.droppable(since, now):
                conn.drop()
                excess -= 1
            else:
                young.append(since)
        if excess > 0 and young and self._sweep is None:
            self._sweep = loop.call_at(young[0] + self.limits.grace_s, self._swept, loop)

    def _swept(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sweep = None
        self.make_room(loop)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol held to `guard.limits` (see the module's docstring)."""

    guard: ClassVar[Guard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = self.guard.log  # type: ignore[assignment]  # the request cycles log through it too
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._waiting_for: object = None  # the request cycle current when the wait began
        self._partial = False  # bytes came in while waiting, and no request yet: slowloris's way

    def droppable(self, since: float, now: float) -> bool:
        """A waiting connection may be dropped to make room once it has sent part of a request
        without finishing it, or has sent nothing for `grace_s`: a real client sends its whole
        request at once, so neither is one that is just arriving."""
        return self._partial or now - since >= self.guard.limits.grace_s

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.guard.open.add(self)
        self._wait()
        self.guard.admit(self)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._deadline is None:
            return
        if self.cycle is not self._waiting_for:
            self._served()  # a request began: its body and answer have deadlines of their own
        else:
            self._partial = True

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is cycle:  # no pipelined request began
            self._wait()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._served()
        self._unstall()
        self.guard.open.discard(self)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.guard.limits.write_timeout_s, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    def _wait(self) -> None:
        """From now on the connection has `header_timeout_s` to send a request's headers."""
        self._served()
        self._waiting_for, self._partial = self.cycle, False
        self._deadline = self.loop.call_later(self.guard.limits.header_timeout_s, self.drop)
        self.guard.waiting[self] = self.loop.time()

    def _served(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.guard.waiting.pop(self, None)

    def _unstall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def drop(self) -> None:
        """Close the connection (at once if an answer is stuck in its buffer)."""
        self._served()
        self.guard.open.discard(self)
        if self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()


def guarded_h11(limits: Limits, log: RateLimitedLog) -> type[GuardedH11]:
    """The protocol class one server runs (uvicorn's `http=`): its own table of connections."""
    return type("GuardedH11", (GuardedH11,), {"guard": Guard(limits, log)})


# ------------------------------------------------------------------ the body of one request


def declared_refusal(headers: dict[str, str], limits: Limits) -> Refusal | None:
    """A body refused from its declared length alone (413 over `max_body`, 400 not a number)."""
    declared = headers.get("content-length")
    if declared is None:
        return None
    if not declared.strip().isdigit():
        return 400, "Content-Length is not a number"
    if int(declared) > limits.max_body:
        return 413, f"request body over {limits.max_body} bytes"
    return None


async def read_body(receive: Receive, limits: Limits) -> list[Message] | Refusal:
    """The body's messages as they came, read to its end: at most `max_body` bytes, within
    `body_timeout_s` of the first read (408), or why not."""
    messages: list[Message] = []
    size = 0
    deadline = time.monotonic() + limits.body_timeout_s
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return 408, f"the request body did not arrive within {limits.body_timeout_s:g} s"
        messages.append(message)
        if message["type"] != "http.request":  # the client left: the app sees it leave
            return messages
        size += len(message.get("body", b""))
        if size > limits.max_body:
            return 413, f"request body over {limits.max_body} bytes"
        if not message.get("more_body", False):
            return messages


def replayed(messages: list[Message], receive: Receive) -> Receive:
    """The messages already read, in order, then the client's own (its disconnect)."""
    queue = list(messages)

    async def replay() -> Message:
        return queue.pop(0) if queue else await receive()

    return replay


# ------------------------------------------------------------------ the server


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound socket for a server (port 0: any free one). Accepted connections inherit
    TCP_NODELAY: without it a reply written as headers, then body, waits for the client's
    delayed ACK, 40 ms a call (bench/results/endpoint_overhead.json)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def server_config(app: ASGIApp, limits: Limits, log: RateLimitedLog) -> uvicorn.Config:
    """uvicorn serving `app` on the guarded h11 protocol (`GuardedH11`), its own access log off."""
    return uvicorn.Config(
        app,
        http=guarded_h11(limits, log),
        h11_max_incomplete_event_size=limits.max_header_bytes,
        timeout_keep_alive=KEEP_ALIVE_S,
        backlog=limits.backlog,
        log_level="warning",
        access_log=False,
        lifespan="on",
    )
