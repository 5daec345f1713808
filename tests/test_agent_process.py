"""Your agent as a program of its own (`agent.kind = "command"`, `endpoint/process.py`): real
subprocesses for what the runner promises (the answer, the environment, crashes, the timeout
that kills the whole process group, output an attacker floods), then the real endpoint and
model, and the units LangGraph example in its own virtualenv loading ratchet's distilled tools
with langchain-mcp-adapters."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from ratchet.agents.rollout import RolloutSlot
from ratchet.config import AgentSettings, TaskFileSettings, load_settings
from ratchet.endpoint import process
from ratchet.endpoint.agent import AgentError, YourAgent, mcp_url, run_agent_rollout
from ratchet.endpoint.process import MAX_ANSWER, STDERR_KEPT, AgentProcessError, AgentTimedOut
from ratchet.endpoint.recording import Arm
from ratchet.endpoint.serve import InterventionEndpoint
from ratchet.errors import ConfigError
from ratchet.skills.format import Skill, ToolSource
from ratchet.skills.toolbox import Toolbox
from ratchet.suites.task_file import TaskFileSuite
from ratchet.types import ArgConstraint, ConstraintSpec, Policy

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "units"
MODEL = "smollm2-135m-instruct"
PY = sys.executable
BASE = "http://127.0.0.1:9/r/KEY/v1"


def _agent(tmp_path: Path, code: str, **settings: Any) -> YourAgent:
    script = tmp_path / "agent.py"
    script.write_text(code)
    return YourAgent(AgentSettings(kind="command", command=[PY, str(script)], **settings))


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet (a container's init may never)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 :].split()[0] == b"Z"


def _all_gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------- the contract


ECHO = """
import json, os, sys
task = json.load(sys.stdin)
print("thinking", file=sys.stderr)
seen = {k: os.environ.get(k) for k in
        ("OPENAI_BASE_URL", "OPENAI_API_BASE", "OPENAI_API_KEY", "RATCHET_MCP_URL", "RATCHET_MAX_STEPS")}
seen["ratchet_vars"] = sorted(k for k in os.environ if k.startswith("RATCHET_"))
seen["home"] = os.environ.get("HOME")
print("\\n  " + json.dumps({"task": task, "env": seen}) + "  \\n")
"""


def test_the_answer_is_stdout_the_input_is_json_on_stdin_and_the_urls_are_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RATCHET_MODEL__API_KEY", "sk-upstream-secret")  # ratchet's, never the agent's
    monkeypatch.setenv("OPENAI_API_KEY", "sk-users-real-key")
    monkeypatch.setenv("OPENAI_BASE_URL", "https://api.openai.com/v1")
    task = {"question": "3 km in m? “quoted” ü", "n": [1, 2.5, None]}
    answer = _agent(tmp_path, ECHO, mcp=True).run(task, BASE, 4)
    got = json.loads(answer)  # whitespace around it stripped
    assert got["task"] == task
    assert got["env"] == {
        "OPENAI_BASE_URL": BASE,
        "OPENAI_API_BASE": BASE,
        "OPENAI_API_KEY": "not-needed",  # the key is in the URL; a real one never reaches the agent
        "RATCHET_MCP_URL": mcp_url(BASE),
        "RATCHET_MAX_STEPS": "4",
        "ratchet_vars": ["RATCHET_MAX_STEPS", "RATCHET_MCP_URL"],
        "home": os.environ.get("HOME"),  # the rest of the environment is kept
    }
    plain = json.loads(_agent(tmp_path, ECHO).run("just text", BASE, 2))
    assert plain["task"] == "just text" and plain["env"]["RATCHET_MCP_URL"] is None  # no agent.mcp


def test_an_input_the_agent_never_reads_neither_blocks_nor_breaks_the_run(tmp_path: Path) -> None:
    big = "x" * (4 << 20)  # far past a pipe's buffer
    assert _agent(tmp_path, "print('ok')\n").run(big, BASE, 4) == "ok"
    reads = "import json, sys\nprint(len(json.load(sys.stdin)))\n"
    assert _agent(tmp_path, reads).run(big, BASE, 4) == str(len(big))


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (
            "import sys\nsys.stderr.write('junk\\n' * 40000)\nraise ValueError('boom')\n",
            "exited with status 1",
        ),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "was killed by SIGSEGV"),
        ("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe answer')\n", "is not UTF-8"),
    ],
)
def test_a_crash_is_an_error_that_keeps_the_end_of_its_stderr(tmp_path: Path, code: str, says: str) -> None:
    with pytest.raises(AgentProcessError, match=says) as err:
        _agent(tmp_path, code).run("q", BASE, 4)
    message = str(err.value)
    assert len(message) < STDERR_KEPT + 1000
    if "boom" in code:
        assert message.rstrip().endswith("ValueError: boom") and "Traceback" in message
        assert "bytes left out" in message  # 240 KB of junk before the traceback: its end is kept


def test_the_timeout_kills_the_whole_process_group_a_grandchild_too(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    code = f"""
import subprocess, sys, time, os
child = subprocess.Popen([{PY!r}, "-c", "import time; time.sleep(600)"])
open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
print("working", file=sys.stderr, flush=True)
time.sleep(600)
"""
    started = time.monotonic()
    with pytest.raises(AgentTimedOut) as err:
        _agent(tmp_path, code, timeout_s=3).run("q", BASE, 4)
    assert time.monotonic() - started < 15
    assert "did not finish in 3 s (agent.timeout_s): its process group was killed" in str(err.value)
    assert str(err.value).endswith("its stderr ended:\nworking")
    both = [int(p) for p in pids.read_text().split()]
    assert _all_gone(both), both


def test_what_the_agent_leaves_running_in_its_group_is_killed_and_cannot_hold_the_run(tmp_path: Path) -> None:
    """A background process that keeps the agent's stdout open (a late caller of the endpoint)."""
    pids = tmp_path / "pids"
    code = f"""
import subprocess
child = subprocess.Popen([{PY!r}, "-c", "import time; time.sleep(600)"])  # inherits stdout and stderr
open({str(pids)!r}, "w").write(str(child.pid))
print("42")
"""
    started = time.monotonic()
    assert _agent(tmp_path, code).run("q", BASE, 4) == "42"
    assert time.monotonic() - started < 15
    assert _all_gone([int(pids.read_text())])


def test_a_process_that_leaves_the_group_is_read_for_the_drain_only(tmp_path: Path) -> None:
    """Not covered by a process group (the module says so): a new session escapes the kill,
    and its open pipes hold the run no longer than `DRAIN_S`."""
    pids = tmp_path / "pids"
    code = f"""
import subprocess
child = subprocess.Popen([{PY!r}, "-c", "import time; time.sleep(600)"], start_new_session=True)
open({str(pids)!r}, "w").write(str(child.pid))
print("42")
"""
    started = time.monotonic()
    try:
        assert _agent(tmp_path, code).run("q", BASE, 4) == "42"
        assert time.monotonic() - started < process.DRAIN_S + 10
    finally:
        _kill([int(pids.read_text())])


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (  # an answer that never ends: killed at the bound, not at the timeout
            "import sys\nwhile True:\n    sys.stdout.buffer.write(b'x' * 65536)\n",
            f"more than {MAX_ANSWER} bytes to stdout",
        ),
        (  # 64 MiB on stderr, then a crash
            "import sys\nfor _ in range(1024):\n    sys.stderr.buffer.write(b'e' * 65536)\nsys.exit(3)\n",
            "exited with status 3",
        ),
    ],
)
def test_an_agent_flooding_stdout_or_stderr_never_takes_ratchets_memory(
    tmp_path: Path, code: str, says: str
) -> None:
    agent = _agent(tmp_path, code, timeout_s=120)
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(AgentProcessError, match=says) as err:
            agent.run("q", BASE, 4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # the bounds and a read's chunk, not what was written
    assert time.monotonic() - started < 60
    assert len(str(err.value)) < STDERR_KEPT + 1000


def test_a_stopping_run_kills_its_agents_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "stopping", lambda: True)
    started = time.monotonic()
    with pytest.raises(AgentProcessError, match="the run is stopping"):
        _agent(tmp_path, "import time\ntime.sleep(600)\n").run("q", BASE, 4)
    assert time.monotonic() - started < 10


def test_a_running_agent_is_listed_with_the_runs_services(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hard exit of ratchet (or the next start after a SIGKILL) stops what is listed."""
    from ratchet import services

    listed: list[tuple[str, int]] = []
    monkeypatch.setattr(services, "register", lambda name, pid: listed.append((name, pid)))
    unlisted: list[int] = []
    monkeypatch.setattr(services, "unregister", unlisted.append)
    assert _agent(tmp_path, "print('a')\n").run("q", BASE, 4) == "a"
    assert listed == [(f"your agent ({os.path.basename(PY)})", listed[0][1])]
    assert unlisted == [listed[0][1]]


# ---------------------------------------------------------------- settings and pre-flight


@pytest.mark.parametrize(
    ("agent", "says"),
    [
        ({"agent.kind": "command"}, "kind 'command' needs agent.command"),
        ({"agent.command": [PY, "a.py"]}, "agent.command is for kind = 'command'"),
        (
            {"agent.kind": "command", "agent.command": [PY, "a.py"], "agent.entry": "a:run"},
            "agent.entry is set too",
        ),
        ({"agent.kind": "command", "agent.command": ["no-such-venv/bin/python"]}, "not an executable file"),
        ({"agent.kind": "command", "agent.command": [__file__]}, "not an executable file"),  # not +x
        ({"agent.kind": "command", "agent.command": [PY, "a\0b"]}, "NUL byte"),
    ],
)
def test_a_wrong_command_is_one_line_before_anything_runs(agent: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says) as err:
        load_settings(agent)
    assert "\n" not in str(err.value) and str(err.value).startswith("invalid setting agent")


def test_the_settings_name_the_agent_by_its_command_and_the_preflight_checks_it_again(
    tmp_path: Path,
) -> None:
    script = tmp_path / "run agent.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    settings = load_settings({"agent.kind": "command", "agent.command": [str(script), "--fast"]})
    assert settings.agent.name == f"'{script}' --fast"  # records show it as a shell would run it
    assert load_settings({}).agent.name == ""  # ratchet's own actor
    agent = YourAgent(settings.agent)
    agent.check()
    assert agent.run("q", BASE, 4) == "hi"
    script.chmod(0o644)  # the venv went away after the settings were read
    with pytest.raises(AgentError, match="not an executable file"):
        agent.check()
    with pytest.raises(AgentProcessError, match="cannot run the agent's command"):
        agent.run("q", BASE, 4)


# ---------------------------------------------------------------- as a rollout


@pytest.fixture
def units(monkeypatch: pytest.MonkeyPatch) -> TaskFileSuite:
    monkeypatch.chdir(EXAMPLE)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    return TaskFileSuite(TaskFileSettings(file=EXAMPLE / "tasks.jsonl", score="score:score", max_steps=4))


@pytest.fixture
def offline() -> Any:
    """An endpoint whose model is unreachable: for agents that never reach it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with InterventionEndpoint(dead, timeout_s=5) as ep:
        yield ep


def _slot(suite: TaskFileSuite, i: int = 0) -> RolloutSlot:
    return RolloutSlot("ev", 1, suite.tasks("dev", i + 1)[i], 0)


def _arm(**policy: Any) -> Arm:
    return Arm(Policy(model=MODEL, **policy), temperature=0.0, seed=11, max_steps=4)


def test_an_agent_that_never_calls_the_endpoint_is_the_same_error_as_in_process(
    offline: InterventionEndpoint, units: TaskFileSuite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cached_agent.py").write_text("def run(question, base_url):\n    return '8368.6'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    slot = _slot(units, 1)
    in_process = run_agent_rollout(
        YourAgent(AgentSettings(entry="cached_agent:run")), units, slot, offline, _arm()
    )
    command = _agent(tmp_path, "import sys\nsys.stdin.read()\nprint('8368.6')\n")
    own = run_agent_rollout(command, units, slot, offline, _arm())
    assert own.status == in_process.status == "error"
    assert own.error == in_process.error and "made no model call" in (own.error or "")
    assert own.answer == "8368.6"


def test_a_crash_or_a_timeout_is_an_error_trajectory_never_a_stuck_run(
    offline: InterventionEndpoint, units: TaskFileSuite, tmp_path: Path
) -> None:
    crash = _agent(tmp_path, "raise SystemExit('no model for me')\n")
    traj = run_agent_rollout(crash, units, _slot(units), offline, _arm())
    assert traj.status == "error" and traj.error is not None
    assert "exited with status 1" in traj.error and traj.error.endswith("no model for me")
    hang = _agent(tmp_path, "import time\ntime.sleep(600)\n", timeout_s=2)
    started = time.monotonic()
    traj = run_agent_rollout(hang, units, _slot(units), offline, _arm())
    assert time.monotonic() - started < 15
    assert traj.status == "error" and "its process group was killed" in (traj.error or "")
    assert len(offline.rollouts) == 0  # closed: a late call lands nowhere


# ---------------------------------------------------------------- against the real model


UNITS_CONSTRAINT = ConstraintSpec(
    name="tasks-args",
    tools={
        "convert": {
            "from_unit": ArgConstraint(from_context=True),
            "to_unit": ArgConstraint(from_context=True),
        }
    },
)
GREEDY = """
import json, os, sys
from openai import OpenAI
question = json.load(sys.stdin)
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
while True:
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": question}], max_tokens=2)
"""
CALLS_THEN_CRASHES = """
import json, sys
from openai import OpenAI
question = json.load(sys.stdin)
OpenAI().chat.completions.create(model="m", messages=[{"role": "user", "content": question}], max_tokens=4)
raise RuntimeError("tool blew up")
"""


@pytest.fixture(scope="module")
def endpoint(embedded_server: str) -> Any:
    with InterventionEndpoint(embedded_server) as ep:
        yield ep


@pytest.mark.integration
def test_the_units_langgraph_agent_as_a_command_plays_through_the_real_endpoint_and_model(
    endpoint: InterventionEndpoint, units: TaskFileSuite, tmp_path: Path
) -> None:
    """`langgraph_process.py`, run by ratchet's own interpreter here (without agent.mcp it
    needs nothing ratchet's virtualenv lacks); the slow test below runs it in its own."""
    agent = YourAgent(AgentSettings(kind="command", command=[PY, str(EXAMPLE / "langgraph_process.py")]))
    slot = _slot(units, 1)
    traj = run_agent_rollout(agent, units, slot, endpoint, _arm(constraints=(UNITS_CONSTRAINT,)))
    assert traj.status == "finished", traj.error
    assert traj.steps and traj.steps[0].observation == slot.task.instruction
    assert traj.steps[0].rules == ["tasks-args"] and traj.steps[0].prompt_tokens > 0
    assert traj.prompt is not None and "unit conversion" in traj.prompt.system
    first = traj.steps[0].tool_call
    assert first is not None and first.name in ("convert", "list_units")  # tool_choice="required"
    assert traj.answer is not None and traj.answer.strip()
    # the step budget, spent by a process as by a thread: a failure, not an error
    spent = run_agent_rollout(_agent(tmp_path, GREEDY), units, slot, endpoint, _arm())
    assert spent.status == "finished" and not spent.success and len(spent.steps) == 4
    crashed = run_agent_rollout(_agent(tmp_path, CALLS_THEN_CRASHES), units, slot, endpoint, _arm())
    assert crashed.status == "error" and (crashed.error or "").endswith("RuntimeError: tool blew up")
    assert len(crashed.steps) == 1  # the call it made is kept


# ---------------------------------------------------------------- the example in its own venv


# a distilled function tool: reads the first number of its rollout's task text and scales it
SCALE_TOOL = Skill(
    name="units-scale",
    description="Scale the number in the question.",
    body="",
    kind="tool",
    family="tasks:units",
    evolution="e",
    generation=0,
    provenance=["t1"],
    tool=ToolSource(
        kind="function",
        parameters={"type": "object", "properties": {"factor": {"type": "number"}}, "required": ["factor"]},
        code="import re\n\ndef run(factor: float, task: str) -> str:\n"
        "    return str(float(re.findall(r'-?[0-9.]+', task)[0]) * factor)\n",
    ),
)
AGENT_VENV = Path(os.environ.get("RATCHET_TEST_AGENT_VENV", ROOT / ".ratchet" / "test-agent-venv"))
LISTS_AND_CALLS = """
import asyncio, json, os
from langchain_mcp_adapters.client import MultiServerMCPClient

async def main():
    url = os.environ["RATCHET_MCP_URL"]
    client = MultiServerMCPClient({"r": {"url": url, "transport": "streamable_http"}})
    tools = {t.name: t for t in await client.get_tools()}
    result = await tools["units-scale"].ainvoke({"factor": 60})
    text = result if isinstance(result, str) else " ".join(p.get("text", "") for p in result)
    print(json.dumps({"tools": sorted(tools), "result": text}))

asyncio.run(main())
"""


@pytest.fixture(scope="session")
def agent_venv() -> Path:
    """The example's own virtualenv, made by its own script (pip, from the registry: an
    install step, so only in this slow test) and kept for later sessions."""
    python = AGENT_VENV / "bin" / "python"
    if not python.exists() or subprocess.run([str(python), "-c", "import langchain_mcp_adapters"]).returncode:
        subprocess.run([str(EXAMPLE / "make_agent_venv.sh"), str(AGENT_VENV)], check=True, timeout=1200)
    return python


@pytest.mark.slow
@pytest.mark.integration
def test_the_langgraph_example_in_its_own_venv_loads_ratchets_distilled_tools_with_the_mcp_adapters(
    agent_venv: Path, embedded_server: str, units: TaskFileSuite, tmp_path: Path
) -> None:
    mcp_of = {
        python: subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('mcp'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for python in (str(agent_venv), PY)
    }
    # why it has its own: langchain-mcp-adapters needs mcp 1.x, ratchet's FastMCP 2.x
    assert mcp_of[str(agent_venv)].startswith("1.") and mcp_of[PY].startswith("2.")
    task = _slot(units, 2).task
    arm = Arm(
        Policy(model=MODEL, tools=(SCALE_TOOL.tool_spec(),)),
        max_steps=4,
        toolbox=Toolbox([SCALE_TOOL]),
        task=task.instruction,
    )
    command = [str(agent_venv), str(EXAMPLE / "langgraph_process.py")]
    with InterventionEndpoint(embedded_server) as ep:
        traj = run_agent_rollout(
            YourAgent(AgentSettings(kind="command", command=command, mcp=True)),
            units,
            RolloutSlot("ev", 1, task, 0),
            ep,
            arm,
        )
        # the same adapters, a call of the distilled tool: run in the sandbox on this rollout's task
        rec = ep.rollouts.open(arm)
        env = process.agent_environment(ep.rollout_url(rec.key), 4, mcp_url(ep.rollout_url(rec.key)))
        script = tmp_path / "lists_and_calls.py"
        script.write_text(LISTS_AND_CALLS)
        called = subprocess.run(
            [str(agent_venv), str(script)], env=env, capture_output=True, text=True, timeout=120
        )
        ep.rollouts.close(rec)
    assert traj.status == "finished", traj.error
    assert traj.prompt is not None
    offered = [t["function"]["name"] for t in traj.prompt.tools]
    assert offered == ["convert", "list_units", "units-scale"]  # listed over MCP, offered to the model
    assert called.returncode == 0, called.stderr[-3000:]
    got = json.loads(called.stdout)
    first = float(re.findall(r"-?[0-9.]+", task.instruction)[0])  # what the tool reads of its task
    assert got["tools"] == ["units-scale"] and float(got["result"]) == pytest.approx(first * 60)
    assert [r.name for r in rec.tool_runs] == ["units-scale"]


def test_the_examples_config_runs_the_example_in_its_venv_or_says_how_to_make_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(EXAMPLE)
    config = EXAMPLE / "langgraph-process.toml"
    if not (EXAMPLE / "agent-venv" / "bin" / "python").exists():  # ./make_agent_venv.sh not run here
        with pytest.raises(ConfigError, match="'agent-venv/bin/python' is not an executable file"):
            load_settings(config_file=config)
        return
    settings = load_settings(config_file=config)
    assert settings.agent.kind == "command" and settings.agent.mcp
    assert settings.agent.command == ["agent-venv/bin/python", "langgraph_process.py"]
    YourAgent(settings.agent).check()


@pytest.mark.slow
@pytest.mark.integration
def test_a_generation_evolves_a_command_agent(
    embedded_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole loop with your agent as a command (ratchet's flows know it by
    `settings.agent.name`): every stage plays it, MLflow's agent version names its command."""
    from mlflow.tracking import MlflowClient

    from ratchet.flows.evolve import evolve_flow
    from ratchet.memory.trajectory_store import open_store

    monkeypatch.chdir(EXAMPLE)
    settings = load_settings(
        {
            "data_dir": tmp_path,
            "tasks.file": str(EXAMPLE / "tasks.jsonl"),
            "tasks.score": "score:score",
            "tasks.max_steps": 4,
            "agent.kind": "command",
            "agent.command": [PY, "langgraph_process.py"],
            "splits.train": 4,
            "splits.dev": 6,
            "splits.test": 3,
            "explore.temperature": 0.3,
            "verify.max_candidates": 1,
            "diagnose.judge": False,
            "distill.teacher": False,
            "finetune.mode": "off",
            "trace_sample_rate": 0.0,
        }
    )
    journal = evolve_flow(settings=settings, generations=1, base_url=embedded_server)
    assert [r.generation for r in journal.rows()] == [0, 1]
    store = open_store(settings.trajectories_db)
    try:
        trajs = store.query(evolution="default")
    finally:
        store.close()
    assert {t.split for t in trajs} >= {"train", "test"}
    assert all(t.status == "finished" and t.steps for t in trajs), [t.error for t in trajs]
    client = MlflowClient(settings.mlflow_uri)
    exp = client.get_experiment_by_name("ratchet-default")
    assert exp is not None
    models = client.search_logged_models([exp.experiment_id])
    assert models and all(m.params.get("agent_entry") == f"{PY} langgraph_process.py" for m in models)
    assert all(m.params.get("agent_kind") == "command" for m in models)
