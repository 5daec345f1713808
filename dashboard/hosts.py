"""Only this machine's browser tabs of this very server may talk to the API.

The API and dashboard bind to 127.0.0.1, but a web page from anywhere can still reach
them through the user's browser:

* **DNS rebinding**: `attacker.example` resolves to 127.0.0.1 after the page loaded, so
  the page's requests land here with `Host: attacker.example`. Every request whose Host
  is not a loopback name (127.0.0.1, localhost, [::1]) gets 421, whatever its method.
* **Cross-site requests**: a page on another origin (including another port of
  localhost) posts to us. A state-changing request (anything but GET/HEAD/OPTIONS) must
  carry JSON if it can carry a body at all (a form or `text/plain` post is refused with
  415: those need no CORS preflight; a DELETE, which a form cannot send, needs no body)
  and, when the client names an origin (browsers always do on a cross-origin
  POST), that origin must be exactly the one the request was sent to (scheme, host and
  port of its Host); `Sec-Fetch-Site: cross-site` is refused too. Non-browser clients
  (curl, scripts) send no Origin and pass.

The same rules guard `ratchet tools serve --transport http` (`every_method=True`): there
the Origin and `Sec-Fetch-Site` checks apply to reads too (an MCP event stream is a GET),
as the MCP transport spec asks of servers.

A change also needs the dashboard's token (`dashboard.auth`), and no body may pass
`MAX_BODY` (`BodyLimit`).

Not covered here: a process on this machine (the token stops one that cannot read the data
dir), and a browser extension with access to localhost.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
BODYLESS = SAFE_METHODS | {"DELETE"}  # a form cannot send these: no Content-Type rule
MAX_BODY = 64 * 1024  # a decision is a few hundred bytes; hard-coded, not a setting


def _host_name(netloc: str) -> str:
    """'127.0.0.1:8780' -> '127.0.0.1'; '[::1]:80' -> '::1'; case folded."""
    return (urlsplit(f"//{netloc}").hostname or "").lower()


def refusal(method: str, headers: dict[str, str], every_method: bool = False) -> tuple[int, str] | None:
    """Why a request must be refused (status and one line), or None when it may pass.
    `every_method`: check Origin and Sec-Fetch-Site on reads too (the MCP transport)."""
    host = headers.get("host", "")
    if _host_name(host) not in LOOPBACK:
        return 421, f"refused: Host {host!r} is not this machine's loopback address"
    if method in SAFE_METHODS and not every_method:
        return None
    media = headers.get("content-type", "").split(";")[0].strip().lower()
    if method not in BODYLESS and media != "application/json":
        return 415, "refused: a change must be sent as application/json"
    if headers.get("sec-fetch-site", "") == "cross-site":
        return 403, "refused: cross-site request"
    origin = headers.get("origin")
    if origin is not None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or parts.netloc.lower() != host.lower():
            return 403, f"refused: origin {origin!r} is not this server's ({host})"
    return None


def headers_of(scope: Scope) -> dict[str, str]:
    """The request's headers, names folded to lower case (a repeated header: its last value)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def refuse(scope: Scope, receive: Receive, send: Send, code: int, detail: str, **headers: str) -> None:
    """Answer `code` with `{"detail": one line}`, and close the connection: a refused body
    is never read, so the connection cannot be reused."""
    from starlette.responses import JSONResponse

    head = {"connection": "close", **{k.replace("_", "-"): v for k, v in headers.items()}}
    await JSONResponse({"detail": detail}, status_code=code, headers=head)(scope, receive, send)


class LoopbackOnly:
    """ASGI middleware applying `refusal` to every HTTP request."""

    def __init__(self, app: ASGIApp, every_method: bool = False) -> None:
        self.app = app
        self.every_method = every_method

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = refusal(scope["method"], headers_of(scope), self.every_method)
            if refused is not None:
                await refuse(scope, receive, send, *refused)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes gets 413 and is not read past the limit.

    A declared Content-Length over the limit is refused from the headers; a chunked body
    is read (at most `limit` bytes, buffered) before the app runs, then replayed to it, so
    the app never sees a body it would have to cut short. Messages after the body (a
    client's disconnect) still reach the app.
    """

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = f"refused: the body is over {self.limit // 1024} KiB"
        declared = headers_of(scope).get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await refuse(scope, receive, send, 400, "refused: Content-Length is not a number")
                return
            if int(declared) > self.limit:
                await refuse(scope, receive, send, 413, too_big)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await refuse(scope, receive, send, 413, too_big)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)
