"""Distilled tools served to your agent over MCP (`endpoint/tools.py`): each rollout sees its
arm's function tools, run in the real sandbox with the rollout's own task text; keys, arms and
hidden arguments hold against a client that tries to reach past them."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastmcp import Client

from ratchet.agents.toolsmith import FunctionJob, _test
from ratchet.config import AgentSettings, TaskFileSettings
from ratchet.endpoint.agent import AgentError, YourAgent, mcp_url, run_agent_rollout
from ratchet.endpoint.recording import Arm
from ratchet.endpoint.serve import InterventionEndpoint
from ratchet.flows.distill import answer_job, offers_tools
from ratchet.skills.format import Skill, ToolSource
from ratchet.skills.toolbox import Toolbox
from ratchet.suites.task_file import TaskFileSuite
from ratchet.types import Policy, Trajectory

pytestmark = pytest.mark.integration  # the sandbox (bubblewrap) runs every tool call

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "units"
MODEL = "smollm2-135m-instruct"

# reads the first number of the task text it is given (never one the caller passes) and scales it
SCALE = """
import re

def run(factor: float, task: str) -> str:
    return str(float(re.findall(r"-?[0-9.]+", task)[0]) * factor)
"""
FAILS = "def run(task: str) -> str:\n    raise ValueError('no')\n"
MACRO = "def run() -> list:\n    return [{'tool': 'act', 'args': {'action': 'look'}}]\n"


def _tool(name: str, code: str, kind: str = "function", params: dict[str, Any] | None = None) -> Skill:
    schema = params or {"type": "object", "properties": {}, "required": []}
    return Skill(
        name=name,
        description=f"The {name} tool.",
        body="",
        kind="tool",
        family="tasks:units",
        evolution="e",
        generation=0,
        provenance=["t1"],
        tool=ToolSource(kind=kind, parameters=schema, code=code),  # type: ignore[arg-type]
    )


SCALE_PARAMS = {"type": "object", "properties": {"factor": {"type": "number"}}, "required": ["factor"]}
SKILLS = [
    _tool("units-scale", SCALE, params=SCALE_PARAMS),
    _tool("units-fails", FAILS),
    _tool("coin-go", MACRO, "macro"),
]
BOX = Toolbox(SKILLS)


def _arm(tools: list[str], task: str = "What is 12 hours in minutes?") -> Arm:
    specs = tuple(s.tool_spec() for s in SKILLS if s.name in tools)
    return Arm(Policy(model=MODEL, tools=specs), max_steps=4, toolbox=BOX, task=task)


@pytest.fixture
def offline() -> Any:
    """An endpoint whose model is unreachable: the tools need no model."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with InterventionEndpoint(dead, timeout_s=5) as ep:
        yield ep


def _mcp(url: str, *calls: tuple[str, dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    async def go() -> tuple[list[Any], list[Any]]:
        async with Client(url) as c:
            listed = await c.list_tools()
            results = [await c.call_tool(n, a, raise_on_error=False) for n, a in calls]
        return listed, results

    return asyncio.run(go())


def _text(result: Any) -> str:
    return " ".join(getattr(c, "text", "") for c in result.content)


def test_an_arm_lists_its_function_tools_without_the_hidden_task_and_runs_them_on_its_own_task(
    offline: InterventionEndpoint,
) -> None:
    rec = offline.rollouts.open(_arm(["units-scale", "units-fails", "coin-go"]))
    url = mcp_url(offline.rollout_url(rec.key))
    assert url == f"{offline.url}/r/{rec.key}/mcp"
    listed, (scaled, failed) = _mcp(url, ("units-scale", {"factor": 60}), ("units-fails", {}))
    # the macro's plan is actions of ratchet's own suites: never offered to your agent
    assert [t.name for t in listed] == ["units-scale", "units-fails"]
    assert "task" not in listed[0].input_schema["properties"]  # filled in by the endpoint
    assert not scaled.is_error and _text(scaled) == "720.0"  # 12 (from the rollout's task) x 60
    assert failed.is_error and "ValueError" in _text(failed)  # the tool's failure is the agent's result
    assert [(r.name, r.result, r.error is not None) for r in rec.tool_runs] == [
        ("units-scale", "720.0", False),
        ("units-fails", None, True),
    ]


def test_the_champion_arm_sees_no_candidate_tool_and_cannot_call_one_by_name(
    offline: InterventionEndpoint,
) -> None:
    candidate = offline.rollouts.open(_arm(["units-scale"]))
    champion = offline.rollouts.open(_arm([]))
    listed, (called,) = _mcp(mcp_url(offline.rollout_url(champion.key)), ("units-scale", {"factor": 2}))
    assert listed == [] and called.is_error  # in the toolbox (the gate's candidate), not in this arm
    assert champion.tool_runs == [] and candidate.tool_runs == []


def test_an_agent_cannot_pass_its_own_task_text_or_reach_another_rollouts(
    offline: InterventionEndpoint,
) -> None:
    mine = offline.rollouts.open(_arm(["units-scale"], task="What is 3 km in m?"))
    other = offline.rollouts.open(_arm(["units-scale"], task="What is 500 g in kg?"))
    _, (got,) = _mcp(
        mcp_url(offline.rollout_url(mine.key)), ("units-scale", {"factor": 1, "task": "999 other"})
    )
    assert _text(got) == "3.0"  # its own task, whatever it sent as `task`
    assert [r.name for r in mine.tool_runs] == ["units-scale"] and other.tool_runs == []


@pytest.mark.parametrize(
    "path",
    [
        "/r/{wrong}/mcp",
        "/r/{prefix}/mcp",
        "/r/{key}x/mcp",
        "/r//mcp",
        "/r/{key}/mcp/../../r/{other}/mcp",
        "/mcp",
        "/r/{key}/v1/mcp",
        "/r/{other}%2F..%2F{key}/mcp",
    ],
)
def test_a_guessed_or_mangled_key_reaches_no_tool(offline: InterventionEndpoint, path: str) -> None:
    rec = offline.rollouts.open(_arm(["units-scale"]))
    other = offline.rollouts.open(_arm(["units-scale"]))
    url = offline.url + path.format(
        wrong="x" * len(rec.key), prefix=rec.key[:-1], key=rec.key, other=other.key
    )
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "units-scale", "arguments": {"factor": 1}},
    }
    headers = {"accept": "application/json, text/event-stream"}
    got = httpx.post(url, json=call, headers=headers)
    assert rec.tool_runs == []
    if got.status_code == 200:  # a dot-segment the client resolved: at most the other key, as given
        assert "/r/" + other.key in str(got.request.url) and len(other.tool_runs) == 1
    else:
        assert got.status_code == 404 and other.tool_runs == []


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Host": "evil.example"}, 421),
        ({"Origin": "http://evil.example"}, 403),
        ({"Origin": "null"}, 403),
        ({"content-type": "text/plain"}, 415),  # a form post needs no CORS preflight (`endpoint/gate.py`)
    ],
)
def test_a_web_page_that_rebinds_to_the_port_runs_no_tool_even_with_the_key(
    offline: InterventionEndpoint, headers: dict[str, str], status: int
) -> None:
    rec = offline.rollouts.open(_arm(["units-scale"]))
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "units-scale", "arguments": {}},
    }
    got = httpx.post(
        mcp_url(offline.rollout_url(rec.key)),
        json=call,
        headers={"accept": "application/json, text/event-stream", **headers},
    )
    assert got.status_code == status and rec.tool_runs == []


def test_a_closed_rollout_refuses_its_tools(offline: InterventionEndpoint) -> None:
    rec = offline.rollouts.open(_arm(["units-scale"]))
    url = mcp_url(offline.rollout_url(rec.key))
    offline.rollouts.close(rec)
    before = offline.rollouts.refused
    with pytest.raises(Exception, match="Not Found"):
        _mcp(url)
    assert offline.rollouts.refused > before and rec.tool_runs == []


def test_an_agent_that_loads_mcp_must_take_its_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mcp_agents.py").write_text(
        "def plain(question, base_url):\n    return ''\n"
        "def loads(question, base_url, mcp_url=None):\n    return mcp_url\n"
        "def anything(question, base_url, **kw):\n    return kw['mcp_url']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AgentError, match="takes no 'mcp_url'"):
        YourAgent(AgentSettings(entry="mcp_agents:plain", mcp=True)).check()
    YourAgent(AgentSettings(entry="mcp_agents:plain")).check()  # without agent.mcp it is not given one
    for entry in ("mcp_agents:loads", "mcp_agents:anything"):
        agent = YourAgent(AgentSettings(entry=entry, mcp=True))
        agent.check()
        assert agent.run("q", "http://127.0.0.1:1/r/k/v1", 4) == "http://127.0.0.1:1/r/k/mcp"


def test_only_function_tools_are_drafted_for_an_agent_and_only_one_that_loads_mcp() -> None:
    from ratchet.config import Settings

    actor = Settings()
    agent = Settings(agent=AgentSettings(entry="a:b"))
    mcp = Settings(agent=AgentSettings(entry="a:b", mcp=True))
    assert offers_tools(actor, "macro") and offers_tools(actor, "function")
    assert not offers_tools(agent, "function") and not offers_tools(agent, "macro")
    assert offers_tools(mcp, "function") and not offers_tools(mcp, "macro")


def _units(monkeypatch: pytest.MonkeyPatch) -> TaskFileSuite:
    monkeypatch.chdir(EXAMPLE)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    return TaskFileSuite(TaskFileSettings(file=EXAMPLE / "tasks.jsonl", score="score:score", max_steps=4))


def test_a_function_tool_for_an_agent_is_judged_by_the_task_files_scorer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent's answers were sentences ("... is 720 minutes"); a tool that returns the bare
    number is right by the scorer, and one that is off by a factor is not."""
    suite = _units(monkeypatch)
    tasks = suite.tasks("train", 3)
    wins = [
        Trajectory(
            id=f"t{i}",
            evolution="e",
            generation=0,
            task_id=t.id,
            suite=t.suite,
            subset=t.subset,
            split="train",
            rollout=0,
            seed=0,
            policy_version="p",
            instruction=t.instruction,
            success=True,
            answer=f"The answer is {suite.items[str(t.seed)]['answer']} exactly.",
        )
        for i, t in enumerate(tasks)
    ]
    job = answer_job("tasks:units", wins, suite)
    assert isinstance(job, FunctionJob) and job.accepts is not None and len(job.examples) == 3
    answers = {t.instruction: suite.items[str(t.seed)]["answer"] for t in tasks}
    right = f"ANSWERS = {answers!r}\n\ndef run(task: str) -> str:\n    return str(ANSWERS[task])\n"
    wrong = f"ANSWERS = {answers!r}\n\ndef run(task: str) -> str:\n    return str(ANSWERS[task] * 2)\n"
    assert _test(job, ToolSource(kind="function", parameters={}, code=right)) == []
    assert len(_test(job, ToolSource(kind="function", parameters={}, code=wrong))) == 3
    assert answer_job("tasks:units", wins[:1], suite) is None  # one example: nothing to generalize


def test_your_agent_calls_a_distilled_tool_through_the_real_endpoint_and_model(
    embedded_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The units example (`openai_agent.py`, agent.mcp) against the real embedded server: the
    candidate arm's model is offered the distilled tool beside the agent's own, the champion
    arm's is not; a call of it is run for that rollout's task."""
    suite = _units(monkeypatch)
    from ratchet.agents.rollout import RolloutSlot

    agent = YourAgent(AgentSettings(entry="openai_agent:run", mcp=True))
    agent.check()
    task = suite.tasks("dev", 1)[0]
    with InterventionEndpoint(embedded_server) as ep:
        runs = {}
        for arm_tools in (["units-scale"], []):
            arm = Arm(
                Policy(model=MODEL, tools=tuple(s.tool_spec() for s in SKILLS if s.name in arm_tools)),
                max_steps=4,
                toolbox=BOX,
                task=task.instruction,
            )
            runs[bool(arm_tools)] = run_agent_rollout(agent, suite, RolloutSlot("e", 1, task, 0), ep, arm)
    for with_tool, traj in runs.items():
        assert traj.status == "finished", traj.error
        assert traj.prompt is not None
        offered = [t["function"]["name"] for t in traj.prompt.tools]
        assert offered == (["convert", "units-scale"] if with_tool else ["convert"])
        called = [s.tool_call.name for s in traj.steps if s.tool_call is not None]
        if "units-scale" in called:  # what the tool answered is what the model read next
            assert with_tool and any(s.tool_result and "error" not in s.tool_result for s in traj.steps)


def test_the_endpoint_starts_and_serves_tools_while_every_core_is_busy() -> None:
    """Its start (uvicorn on a thread, the MCP server's lifespan) has no time limit of its own
    but `START_TIMEOUT_S`; four spinning processes on the cores must not reach it."""
    from tests.test_first_run import busy_cores

    with busy_cores(), socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
        with InterventionEndpoint(dead, timeout_s=5) as ep:
            rec = ep.rollouts.open(_arm(["units-scale"]))
            listed, (scaled,) = _mcp(mcp_url(ep.rollout_url(rec.key)), ("units-scale", {"factor": 2}))
            health = httpx.get(f"{ep.url}/health", timeout=60).json()
    assert [t.name for t in listed] == ["units-scale"] and _text(scaled) == "24.0"
    assert health["status"] == "ok" and health["open_rollouts"] == 1
