"""The toolbox called from many rollout threads at once, each with its own event loop.

FastMCP guards its lifespan with an asyncio lock that belongs to one event loop. A server
shared by threads deadlocked a real verify stage: a thread that found the lock taken waited
on it in its own loop, was woken from the holder's thread, which does not wake that loop,
and slept in `select` forever. Here the lock is held a few milliseconds (a blocking sleep
that lets other threads run), so a shared server meets that contention on nearly every call;
every thread must still get each of its plans back."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fastmcp import FastMCP

from ratchet.skills import toolbox
from ratchet.skills.format import Skill, ToolSource
from ratchet.skills.toolbox import Toolbox

pytestmark = pytest.mark.integration  # the sandbox (bubblewrap) runs every tool call

MACRO = "def run(a: str) -> list:\n    return [{'tool': 'act', 'args': {'action': 'move ' + a}}]\n"
PARAMS = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


class _SlowLock(asyncio.Lock):
    async def acquire(self) -> bool:
        await super().acquire()
        time.sleep(0.005)  # held across a thread switch, as a busy machine may hold it
        return True


class _SlowServer(FastMCP):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lifespan_lock = _SlowLock()


def test_threads_calling_one_toolbox_each_get_their_plans_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(toolbox, "FastMCP", _SlowServer)
    skill = Skill(
        name="coin-go",
        description="Move.",
        body="",
        kind="tool",
        family="textworld-express:coin",
        evolution="e",
        generation=0,
        provenance=["t1"],
        tool=ToolSource(kind="macro", parameters=PARAMS, code=MACRO),
    )
    box = Toolbox([skill])
    got: dict[tuple[int, int], str] = {}
    errors: list[str] = []

    def rollout(i: int) -> None:
        for j in range(8):
            try:
                got[i, j] = box.call("coin-go", {"a": f"{i}-{j}"}, task="Find the coin.")[0].args["action"]
            except Exception as exc:  # noqa: BLE001 - a shared server may raise instead of hanging
                errors.append(repr(exc))

    threads = [threading.Thread(target=rollout, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120  # a hung thread never returns: give up on it, then fail
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert errors == []
    assert [t.is_alive() for t in threads] == [False] * 6, "a tool call hung"
    assert got == {(i, j): f"move {i}-{j}" for i in range(6) for j in range(8)}
    assert box._server() is box._server()  # one server per thread, built once
