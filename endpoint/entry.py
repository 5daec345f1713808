"""Your agent's entry point (`agent.entry`), loaded and called, or its command
(`agent.command`), run in a process of its own (`endpoint/process.py`): kept apart from the
rollout runner (`endpoint/agent.py`) so that a pre-flight can check it without importing the
actor, LangChain's OpenAI client or the MCP client (seconds, on a small machine)."""

from __future__ import annotations

import inspect
import json
import shutil
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ratchet.config import AgentSettings
from ratchet.endpoint.process import run_command
from ratchet.errors import RatchetError
from ratchet.suites.task_file import load_entry
from ratchet.types import Task


class AgentError(RatchetError):
    """The configured agent cannot be loaded."""


@dataclass(frozen=True)
class YourAgent:
    """The agent `agent.entry` names, loaded once per process, or the one `agent.command` runs."""

    settings: AgentSettings

    @cached_property
    def entry(self) -> Any:
        return load_entry(self.settings.entry, "agent")

    def check(self) -> None:
        """Loaded now, so a wrong name is one line before anything runs; an agent that loads MCP
        tools (`agent.mcp`) must take them as `mcp_url`. A command's program must still be there
        (a virtualenv removed since the settings were read)."""
        if self.settings.kind == "command":
            program = self.settings.command[0]
            if shutil.which(program) is None:
                raise AgentError(
                    f"agent.command's program {program!r} is not an executable file",
                    "create your agent's virtualenv, or name its interpreter by its path",
                )
            return
        entry = self.entry
        if self.settings.mcp and "mcp_url" not in _parameters(entry):
            raise AgentError(
                f"agent.mcp is set, and {self.settings.entry} takes no 'mcp_url' argument",
                "give it a keyword argument mcp_url (the rollout's MCP server), or unset agent.mcp",
            )

    def run(self, task_input: Any, base_url: str, max_steps: int) -> Any:
        """The agent's answer to one task (raises what the agent raised; a command raises
        `AgentProcessError`, killed at `agent.timeout_s` itself)."""
        extra = {"mcp_url": mcp_url(base_url)} if self.settings.mcp else {}
        if self.settings.kind == "command":
            s = self.settings
            return run_command(s.command, task_input, base_url, max_steps, extra.get("mcp_url"), s.timeout_s)
        if self.settings.kind == "function":
            return self.entry(task_input, base_url, **extra)
        graph = self.entry(base_url, **extra)
        text = task_input if isinstance(task_input, str) else json.dumps(task_input, ensure_ascii=False)
        state = graph.invoke(
            {"messages": [{"role": "user", "content": text}]},
            config={"recursion_limit": 2 * max_steps + 5},
        )
        messages = state.get("messages") if isinstance(state, dict) else None
        if not messages:
            raise AgentError(
                "the graph's final state has no messages", "return a graph with a messages state"
            )
        last = messages[-1]
        from ratchet.endpoint.apply import text_of  # noqa: PLC0415 - heavy; a run has it loaded

        return text_of(getattr(last, "content", None) if not isinstance(last, dict) else last.get("content"))


def mcp_url(base_url: str) -> str:
    """The rollout's MCP server of distilled tools, beside its model API: `…/r/<key>/mcp`."""
    return base_url.removesuffix("/").removesuffix("/v1") + "/mcp"


def _parameters(fn: Any) -> set[str]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature: nothing can be said
        return {"mcp_url"}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {*params, "mcp_url"}
    return set(params)


def task_input(task: Task) -> Any:
    """What the agent is given: the task file's `input` as written, else the instruction."""
    return task.spec["input"] if "input" in task.spec else task.instruction
