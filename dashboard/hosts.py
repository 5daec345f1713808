"""Only this machine's browser tabs of this very server may talk to the API.

The Host/Origin/Content-Type rules (DNS rebinding: 421; a cross-site or preflight-free
change: 403/415) are `ratchet.http_guard`'s, moved down to the core so that the model server
and the MCP transport use the same ones; they are re-exported here for the dashboard's callers.

A change also needs the dashboard's token (`dashboard.auth`), and no body may pass
`MAX_BODY` (`BodyLimit`).

Not covered here: a process on this machine (the token stops one that cannot read the data
dir), and a browser extension with access to localhost.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# the rules themselves live in the core, shared with the model server and the MCP transport
from ratchet.http_guard import (  # noqa: F401 - re-exported: callers import them from here
    BODYLESS,
    LOOPBACK,
    SAFE_METHODS,
    LoopbackOnly,
    headers_of,
    refusal,
    refuse,
)

MAX_BODY = 64 * 1024  # a decision is a few hundred bytes; hard-coded, not a setting


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
