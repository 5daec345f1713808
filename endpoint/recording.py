"""The rollouts the intervention endpoint serves: what each applies, and the calls it recorded.

A rollout is opened by the runner (`endpoint/agent.py`) before the agent starts and closed
when it returns. Its key is a random token, not the trajectory id (which anyone can derive),
so one rollout's calls can neither be read nor written by a request that was not given its
base URL. A key the endpoint does not know, or knows as closed, is refused.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from ratchet.skills.toolbox import Toolbox
from ratchet.types import Policy, SkillText

MAX_REFUSALS = 5


@dataclass(frozen=True)
class Arm:
    """What the endpoint applies to one rollout's requests: the policy of the arm it plays,
    the skills and exemplars chosen for its task, and the stage's sampling."""

    policy: Policy
    skills: tuple[SkillText, ...] | None = None  # None: all of the policy's
    exemplars: tuple[SkillText, ...] | None = None
    temperature: float = 0.0
    seed: int = 0
    max_steps: int = 20  # model calls the rollout may make
    max_tokens: int | None = None  # the output budget where the agent sets none
    toolbox: Toolbox | None = None  # runs the distilled tools the policy offers (`endpoint/tools.py`)
    task: str = ""  # the task's text: what a distilled function tool is given as `task`


@dataclass(eq=False)  # compared by identity: an agent may send the same request twice
class Call:
    """One model call of a rollout: as the agent sent it, as it was forwarded after the
    policy, and the model's completion (None: it failed, `error` says why)."""

    request: dict[str, Any]
    sent: dict[str, Any]
    fired: list[str]
    menu: list[str] | None
    reply: dict[str, Any] | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class ToolRun:
    """One call of a distilled tool over MCP: its arguments and its result (or why none)."""

    name: str
    arguments: dict[str, Any]
    result: str | None
    error: str | None
    seconds: float


@dataclass
class Recording:
    """One open rollout: its key, its arm, and every call in order."""

    key: str
    arm: Arm
    calls: list[Call] = field(default_factory=list)
    tool_runs: list[ToolRun] = field(default_factory=list)
    closed: bool = False
    budget_spent: bool = False  # a call past `arm.max_steps` was refused
    upstream_error: str | None = None  # the model behind the endpoint failed (transient)
    refusals: list[str] = field(default_factory=list)  # why calls were refused unrecorded (the last few)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin(self, request: dict[str, Any]) -> Call | None:
        """A new call, appended in arrival order (the endpoint fills in the rest); None when the
        rollout is closed or has made its `arm.max_steps` calls."""
        with self.lock:
            if self.closed:
                return None
            if len(self.calls) >= self.arm.max_steps:
                self.budget_spent = True
                return None
            call = Call(request=request, sent={}, fired=[], menu=None)
            self.calls.append(call)
            return call

    def refuse(self, reason: str) -> None:
        """A call refused before it was recorded: its reason kept, so a rollout that ends with
        none recorded can say why."""
        with self.lock:
            self.refusals = [*self.refusals[-(MAX_REFUSALS - 1) :], reason]

    def record_tool(self, run: ToolRun) -> None:
        with self.lock:
            self.tool_runs.append(run)

    @property
    def index(self) -> int:
        """How many calls the rollout has begun."""
        with self.lock:
            return len(self.calls)


class Rollouts:
    """The endpoint's open rollouts by key (thread-safe: the runner opens and closes them
    from rollout threads, the endpoint reads them on its event loop)."""

    def __init__(self) -> None:
        self._open: dict[str, Recording] = {}
        self._lock = threading.Lock()
        self.unattributed = 0  # model calls without a key, refused (401): never forwarded
        self.refused = 0  # requests with a key the endpoint does not know or has closed

    def open(self, arm: Arm) -> Recording:
        rec = Recording(key=secrets.token_urlsafe(18), arm=arm)
        with self._lock:
            self._open[rec.key] = rec
        return rec

    def get(self, key: str) -> Recording | None:
        with self._lock:
            return self._open.get(key)

    def close(self, rec: Recording) -> None:
        """No call is recorded after this (a late call is refused): the trajectory is built
        from what the rollout made while its agent ran."""
        with rec.lock:
            rec.closed = True
        with self._lock:
            self._open.pop(rec.key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)
