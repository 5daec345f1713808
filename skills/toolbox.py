"""The MCP toolbox: distilled tools served by FastMCP, every call run in the sandbox.

One `Toolbox` wraps a FastMCP server holding the given tool skills. Rollouts call it
in-process (FastMCP's in-memory client, no sockets); `ratchet tools serve` runs the same
server over stdio or HTTP for any MCP client.

Two kinds of tool (skills/format.py `ToolSource`):

* `macro`: returns a plan, a list of environment actions `{"tool", "args"}`; the actor
  plays them in order as one step (ALITA-G's parameterized macros);
* `function`: returns a value that becomes the observation. Function tools also receive
  the current task's text as `task` (hidden from the policy's schema, shown to MCP
  clients): a small policy cannot be trusted to copy a question into an argument.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from typing import Any

import anyio
from fastmcp import Client, FastMCP
from fastmcp.tools import Tool
from fastmcp.tools.base import ToolResult

from ratchet.errors import RatchetError
from ratchet.skills.format import Skill
from ratchet.skills.sandbox import run_tool
from ratchet.suites.base import ActionError
from ratchet.types import ToolCall, ToolSpec

TASK_ARG = "task"


class ToolFailure(ActionError):
    """A distilled tool failed (bad arguments, timeout, a refused action, a bad plan)."""


class SandboxTool(Tool):
    """An MCP tool whose body is a distilled skill's code, run by `skills.sandbox.run_tool`."""

    code: str
    entry: str = "run"
    kind: str = "function"
    timeout_s: float = 5.0
    memory_mb: int = 256

    @classmethod
    def from_skill(cls, skill: Skill, timeout_s: float = 5.0, memory_mb: int = 256) -> SandboxTool:
        assert skill.tool is not None
        params = json.loads(json.dumps(skill.tool.parameters))
        if skill.tool.kind == "function":  # MCP clients pass the task text themselves
            params.setdefault("properties", {})[TASK_ARG] = {"type": "string", "description": "the task text"}
            params["required"] = [*params.get("required", []), TASK_ARG]
        return cls(
            name=skill.name,
            description=skill.description,
            parameters=params,
            code=skill.tool.code,
            entry=skill.tool.entry,
            kind=skill.tool.kind,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
        )

    async def run(self, arguments: dict[str, Any]) -> ToolResult:
        try:
            result = await anyio.to_thread.run_sync(
                lambda: run_tool(
                    self.code, arguments, entry=self.entry, timeout_s=self.timeout_s, memory_mb=self.memory_mb
                )
            )
        except RatchetError as exc:  # refused code, or no sandbox on this machine: the call fails
            return ToolResult(content=str(exc), is_error=True)
        if not result.ok:
            return ToolResult(content=result.error, is_error=True)
        return ToolResult(content=json.dumps(result.value), structured_content={"result": result.value})


class Toolbox:
    """Distilled tools for rollouts (the actor's ToolRunner) and for MCP clients.

    Rollouts run on many threads, each call in an event loop of its own (`asyncio.run`), and
    each thread calls through a FastMCP server of its own (`_server`). FastMCP keeps asyncio
    locks (its lifespan's) that belong to one event loop: with one server shared by every
    thread, a thread that waited on that lock was woken from another thread's loop, which
    does not wake it, and slept forever (a verify stage hung in a macro's call)."""

    def __init__(self, skills: Sequence[Skill], timeout_s: float = 5.0, memory_mb: int = 256) -> None:
        self.skills = {s.name: s for s in skills if s.tool is not None}
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.mcp = self._build()  # for `ratchet tools serve` and other MCP clients: one event loop
        self._local = threading.local()

    def _build(self) -> FastMCP:
        server = FastMCP("ratchet-tools")
        for skill in self.skills.values():
            server.add_tool(SandboxTool.from_skill(skill, self.timeout_s, self.memory_mb))
        return server

    def _server(self) -> FastMCP:
        """This thread's own server over the same tools (see the class's docstring)."""
        server = getattr(self._local, "server", None)
        if server is None:
            server = self._local.server = self._build()
        return server

    def specs(self) -> list[ToolSpec]:
        """What the policy binds: each tool's schema without the hidden `task` argument."""
        return [s.tool_spec() for s in self.skills.values()]

    def call(self, name: str, args: dict[str, Any], task: str) -> str | list[ToolCall]:
        """Run one tool through the in-process MCP server: text (function) or a plan (macro)."""
        skill = self.skills.get(name)
        if skill is None or skill.tool is None:
            raise ToolFailure(f"no tool named {name!r}")
        arguments = dict(args)
        if skill.tool.kind == "function":
            arguments[TASK_ARG] = task
        value = asyncio.run(self._call(name, arguments))
        if skill.tool.kind == "function":
            return value if isinstance(value, str) else json.dumps(value)
        return parse_plan(value)

    async def _call(self, name: str, arguments: dict[str, Any]) -> Any:
        async with Client(self._server()) as client:
            result = await client.call_tool(name, arguments, raise_on_error=False)
        if result.is_error:
            text = " ".join(getattr(c, "text", "") for c in result.content).strip()
            raise ToolFailure(text or "the tool failed")
        if result.structured_content is not None and "result" in result.structured_content:
            return result.structured_content["result"]
        return result.data


def parse_plan(value: Any) -> list[ToolCall]:
    """A macro's return value as actions; anything else is the tool's failure."""
    if not isinstance(value, list) or not value:
        raise ToolFailure("a macro must return a non-empty list of actions")
    plan = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("tool"), str):
            raise ToolFailure("each macro action must be {'tool': name, 'args': {...}}")
        args = item.get("args", {})
        if not isinstance(args, dict):
            raise ToolFailure("macro action args must be an object")
        plan.append(ToolCall(name=item["tool"], args=args))
    return plan
