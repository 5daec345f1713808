"""The champion's function tools over MCP, at `/mcp` beside the model routes.

The tools are the promoted function tools of the snapshot the request took (`Snapshot.tools`),
each call run in the sandbox (`skills/toolbox.py:SandboxTool`), exactly what `ratchet tools
serve` offers: a function tool takes the task's text as its `task` argument, which the caller
passes (outside a rollout there is no task to fill it in from). Macro tools are not offered:
their plans are moves in ratchet's own suites. One FastMCP server in stateless HTTP mode with
JSON replies; every request takes the live snapshot once, lists and calls that snapshot's tools
only, and names its version in `X-Ratchet-Policy`, as a model answer does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastmcp import FastMCP
from fastmcp.server.dependencies import get_http_request
from fastmcp.server.providers import Provider
from fastmcp.tools import Tool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ratchet.gateway.guard import MCP_PATH
from ratchet.gateway.snapshot import Live, Snapshot

_KEY = "ratchet_snapshot"


class LiveTools(Provider):
    """The function tools of the request's snapshot (the live one outside a request)."""

    def __init__(self, live: Live) -> None:
        super().__init__()
        self.live = live

    def _snapshot(self) -> Snapshot:
        try:
            snap = getattr(get_http_request().state, _KEY, None)
        except RuntimeError:  # no HTTP request
            snap = None
        return snap if isinstance(snap, Snapshot) else self.live.current

    async def _list_tools(self) -> Sequence[Tool]:
        return self._snapshot().tools


def mcp_app(live: Live, loopback: bool) -> Any:
    """The MCP server as an ASGI app with its route at `/mcp` (mount it at the root; its lifespan
    must run with the gateway's). FastMCP's own Host and Origin checks on loopback too; beyond
    it `Guard` has checked the token and the Origin already."""
    server = FastMCP("ratchet-gateway-tools", providers=[LiveTools(live)])
    return server.http_app(
        path=MCP_PATH, stateless_http=True, json_response=True, host_origin_protection=loopback
    )


class Versioned:
    """ASGI wrapper: each request takes the live snapshot once; the tools listed and called are
    its tools, and its answer names its version."""

    def __init__(self, app: ASGIApp, live: Live) -> None:
        self.app, self.live = app, live

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        snap = self.live.current
        scope.setdefault("state", {})[_KEY] = snap
        extra = [(k.lower().encode(), v.encode()) for k, v in snap.headers().items()]

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, named)
