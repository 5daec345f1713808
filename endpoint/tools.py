"""Distilled tools for your agent, over MCP: `http://127.0.0.1:PORT/r/<key>/mcp`.

An agent that loads MCP tools (`agent.mcp = true`; its entry is given `mcp_url`) lists and
calls the distilled tools of the arm its rollout plays, so the gate's two arms differ by a
candidate tool exactly as they differ by a candidate skill. The tools are ratchet's own
function tools (`skills/toolbox.py`), each call run in the sandbox:

* a tool's hidden `task` argument is the rollout's task text, filled in here: the agent's
  schema does not show it, and a small model is never trusted to copy a question;
* macro tools are not offered: their plans are actions of ratchet's own suites;
* the key is checked before the MCP server reads the request (404 for a key the endpoint
  does not know or has closed, as for a model call), and a rollout sees only its arm's tools.

Served by one FastMCP server in stateless HTTP mode with JSON replies: each request stands
alone, so nothing of one rollout outlives it on the server.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import anyio
from fastmcp import FastMCP
from fastmcp.server.dependencies import get_http_request
from fastmcp.server.providers import Provider
from fastmcp.tools import Tool
from fastmcp.tools.base import ToolResult
from pydantic import PrivateAttr
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ratchet.endpoint.recording import Arm, Recording, Rollouts, ToolRun
from ratchet.skills.toolbox import ToolFailure
from ratchet.types import ToolSpec

MCP_PATH = "/r/{key}/mcp"
_KEYED = re.compile(r"^/r/([^/]+)/mcp/?$")


def offered(arm: Arm) -> list[ToolSpec]:
    """The distilled tools an agent playing `arm` may list and call: the arm's policy's tools
    that are function tools of its toolbox, in the policy's order."""
    box = arm.toolbox
    if box is None:
        return []
    return [
        spec
        for spec in arm.policy.tools
        if (skill := box.skills.get(spec.name)) is not None
        and skill.tool is not None
        and skill.tool.kind == "function"
    ]


class RolloutTool(Tool):
    """One distilled tool as one rollout's agent sees it: the skill's schema without the hidden
    `task` argument; a call runs for that rollout (`call_tool`)."""

    _rec: Recording = PrivateAttr()

    @classmethod
    def of(cls, rec: Recording, spec: ToolSpec) -> RolloutTool:
        tool = cls(name=spec.name, description=spec.description, parameters=spec.parameters)
        tool._rec = rec
        return tool

    async def run(self, arguments: dict[str, Any]) -> ToolResult:
        return await call_tool(self._rec, self.name, arguments)


async def call_tool(rec: Recording, name: str, arguments: dict[str, Any]) -> ToolResult:
    """Run `name` for the rollout `rec` and record the run; a tool the arm does not offer, bad
    arguments and the tool's own failure are the agent's error results, never the server's."""
    started = time.perf_counter()
    box = rec.arm.toolbox
    if box is None or name not in {spec.name for spec in offered(rec.arm)}:
        return ToolResult(content=f"no tool named {name!r} in this rollout", is_error=True)
    try:
        value: str | None = await anyio.to_thread.run_sync(
            lambda: str(box.call(name, arguments, rec.arm.task))
        )
        error = None
    except ToolFailure as exc:
        value, error = None, str(exc) or "the tool failed"
    rec.record_tool(ToolRun(name, dict(arguments), value, error, time.perf_counter() - started))
    if error is not None:
        return ToolResult(content=error, is_error=True)
    return ToolResult(content=value)


class ArmTools(Provider):
    """The tools of the arm whose rollout key the request's path names."""

    def __init__(self, rollouts: Rollouts) -> None:
        super().__init__()
        self.rollouts = rollouts

    def _recording(self) -> Recording | None:
        try:
            match = _KEYED.match(get_http_request().url.path)
        except RuntimeError:  # no HTTP request: nothing is offered
            return None
        return self.rollouts.get(match.group(1)) if match else None

    async def _list_tools(self) -> Sequence[Tool]:
        rec = self._recording()
        if rec is None:
            return []
        return [RolloutTool.of(rec, spec) for spec in offered(rec.arm)]


def mcp_app(rollouts: Rollouts) -> Any:
    """The MCP server of every rollout, as an ASGI app with its route at `MCP_PATH` (mount it
    at the root; its lifespan must run with the endpoint's)."""
    server = FastMCP("ratchet-rollout-tools", providers=[ArmTools(rollouts)])
    # strict Host and Origin checks: a web page that reached the port by DNS rebinding is refused
    # (421/403) even if it had a key
    return server.http_app(
        path=MCP_PATH, stateless_http=True, json_response=True, host_origin_protection=True
    )


class KnownKeys:
    """ASGI wrapper: a request to `/r/<key>/mcp` with a key the endpoint does not know (or has
    closed) is refused with 404 before the MCP server reads it, and so is any other path."""

    def __init__(self, app: ASGIApp, rollouts: Rollouts) -> None:
        self.app, self.rollouts = app, rollouts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            match = _KEYED.match(scope.get("path", ""))
            if match is None:
                return await _not_found(scope, receive, send, "no such path")
            if self.rollouts.get(match.group(1)) is None:
                self.rollouts.refused += 1
                return await _not_found(
                    scope, receive, send, "unknown or closed rollout key: the task has ended"
                )
        await self.app(scope, receive, send)


async def _not_found(scope: Scope, receive: Receive, send: Send, message: str) -> None:
    body = {"error": {"message": message, "type": "not_found_error"}}
    await JSONResponse(body, status_code=404, headers={"connection": "close"})(scope, receive, send)
