"""The intervention endpoint: what it changes in a request, what it records, whose calls go
where, and your agent as the rollout (against the real embedded server and LangGraph)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from ratchet.agents.rollout import RolloutSlot
from ratchet.config import AgentSettings, TaskFileSettings
from ratchet.endpoint.agent import YourAgent, run_agent_rollout, steps_of
from ratchet.endpoint.apply import arm_request
from ratchet.endpoint.recording import Arm, Call, Rollouts
from ratchet.endpoint.serve import InterventionEndpoint
from ratchet.suites.task_file import TaskFileSuite
from ratchet.types import ArgConstraint, ConstraintSpec, Policy, RuleSpec, SkillText, ToolCall

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "units"
MODEL = "smollm2-135m-instruct"

CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "description": "Convert a quantity.",
        "parameters": {
            "type": "object",
            "properties": {
                "value": {"type": "number"},
                "from_unit": {"type": "string"},
                "to_unit": {"type": "string"},
            },
            "required": ["value", "from_unit", "to_unit"],
        },
    },
}
UNITS_CONSTRAINT = ConstraintSpec(
    name="tasks-args",
    tools={
        "convert": {
            "from_unit": ArgConstraint(from_context=True),
            "to_unit": ArgConstraint(from_context=True),
        }
    },
)


def _arm(**policy: Any) -> Arm:
    return Arm(Policy(model=MODEL, **policy), temperature=0.0, seed=11, max_steps=4)


# ---------------------------------------------------------------- what a request becomes


def test_the_policy_enters_the_system_message_the_model_name_and_the_sampling() -> None:
    skill = SkillText(name="units-copy", description="copy units", body="Copy the units as written.")
    body = {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "You convert."},
            {"role": "user", "content": "3 km in m?"},
        ],
        "temperature": 1.3,
        "stream": True,
        "max_tokens": 50,
    }
    sent, fired, menu = arm_request(body, _arm(skills=(skill,), adapter="champion-1"), 2, [])
    assert sent["messages"][0]["content"].startswith("You convert.\n\n")
    assert "Copy the units as written." in sent["messages"][0]["content"]
    assert sent["messages"][1] == body["messages"][1]
    assert (sent["model"], sent["temperature"], sent["seed"], sent["stream"]) == (
        "champion-1",
        0.0,
        13,
        False,
    )
    assert sent["max_tokens"] == 50  # the agent's own budget is kept
    assert body["messages"][0]["content"] == "You convert."  # the agent's request is not mutated
    assert fired == [] and menu is None


def test_an_agent_without_a_system_message_gets_one_only_when_the_policy_has_text() -> None:
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    assert arm_request(body, _arm(), 0, [])[0]["messages"] == body["messages"]
    demo = SkillText(name="demo", description="3 km in m", body="convert 3 km m")
    sent = arm_request(body, _arm(exemplars=(demo,)), 0, [])[0]
    assert sent["messages"][0]["role"] == "system" and "3 km in m" in sent["messages"][0]["content"]


def test_argument_constraints_bind_the_units_to_what_the_agent_has_read() -> None:
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": "How many meters are in 5 miles?"}],
        "tools": [CONVERT | {"strict": False}],
    }
    sent, fired, menu = arm_request(body, _arm(constraints=(UNITS_CONSTRAINT,)), 0, [])
    props = sent["tools"][0]["function"]["parameters"]["properties"]
    assert "miles" in props["from_unit"]["enum"] and "meters" in props["to_unit"]["enum"]
    assert "value" not in props["value"].get("enum", [])  # an unconstrained argument stays free
    assert sent["tools"][0]["strict"] is False  # what else the agent set on a tool is kept
    assert fired == ["tasks-args"] and menu == ["convert: *"]
    assert "enum" not in CONVERT["function"]["parameters"]["properties"]["from_unit"]


def test_a_rule_narrows_an_enumerated_tool_the_agent_offers() -> None:
    move = {
        "type": "function",
        "function": {
            "name": "move",
            "description": "go",
            "parameters": {
                "type": "object",
                "properties": {"to": {"type": "string", "enum": ["north", "south"]}},
            },
        },
    }
    body = {"model": "x", "messages": [{"role": "user", "content": "a dark room"}], "tools": [move]}
    rule = RuleSpec(name="go-north", prefer=("move: north",))
    sent, fired, menu = arm_request(body, _arm(rules=(rule,)), 0, [])
    assert sent["tools"][0]["function"]["parameters"]["properties"]["to"]["enum"] == ["north"]
    assert fired == ["go-north"] and menu == ["move: north", "move: south"]
    no_repeat = RuleSpec(name="no-repeat", no_repeat=True)
    sent, fired, _ = arm_request(
        body, _arm(rules=(no_repeat,)), 1, [("a dark room", ToolCall(name="move", args={"to": "north"}))]
    )
    assert sent["tools"][0]["function"]["parameters"]["properties"]["to"]["enum"] == ["south"]


# ---------------------------------------------------------------- what is recorded


def _reply(content: str | None = None, call: tuple[str, dict[str, Any], str] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if call is not None:
        name, args, cid = call
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        ]
    return {"choices": [{"message": message}], "usage": {"prompt_tokens": 30, "completion_tokens": 5}}


def test_recorded_calls_become_steps_with_each_call_result_from_the_next_request() -> None:
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "3 km in m?"}]
    assistant = {
        "role": "assistant",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "convert", "arguments": "{}"}}],
    }
    second = [*first, assistant, {"role": "tool", "tool_call_id": "c1", "content": "3 km = 3000 m"}]
    args = {"value": 3, "from_unit": "km", "to_unit": "m"}
    calls = [
        Call(
            request={"messages": first},
            sent={},
            fired=["tasks-args"],
            menu=["convert: *"],
            reply=_reply(call=("convert", args, "c1")),
        ),
        Call(request={"messages": second}, sent={}, fired=[], menu=None, reply=_reply("3000 meters")),
    ]
    steps = steps_of(calls)
    assert [s.observation for s in steps] == ["3 km in m?", "3 km = 3000 m"]
    assert (
        steps[0].tool_call == ToolCall(name="convert", args=args) and steps[0].tool_result == "3 km = 3000 m"
    )
    assert steps[0].rules == ["tasks-args"] and steps[0].prompt_tokens == 30
    assert steps[1].tool_call is None and steps[1].message == "3000 meters"


def test_a_rollout_refuses_calls_past_its_budget_and_after_it_closed() -> None:
    rollouts = Rollouts()
    rec = rollouts.open(_arm())
    other = rollouts.open(_arm())
    assert rec.key != other.key and len(rec.key) >= 24  # a random token, not a derivable id
    assert all(rec.begin({"messages": []}) is not None for _ in range(4))
    assert rec.begin({"messages": []}) is None and rec.budget_spent
    rollouts.close(other)
    assert other.begin({"messages": []}) is None and rollouts.get(other.key) is None


# ---------------------------------------------------------------- the task file


def _tasks(tmp_path: Path, lines: list[str], score: str = "score:score") -> TaskFileSuite:
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return TaskFileSuite(TaskFileSettings(file=path, score=score))


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "line 1 is not JSON"),
        ('{"id": "a"}', "line 1 has no 'input'"),
        ('{"id": " a", "input": 1}', "'id' must be"),
        ('{"id": true, "input": 1}', "'id' must be"),
    ],
)
def test_a_malformed_task_file_is_one_line_naming_the_line(tmp_path: Path, line: str, says: str) -> None:
    from ratchet.suites.task_file import TaskFileError

    with pytest.raises(TaskFileError, match=says) as err:
        _ = _tasks(tmp_path, [line]).items
    assert "\n" not in str(err.value)


def test_a_repeated_id_is_refused(tmp_path: Path) -> None:
    from ratchet.suites.task_file import TaskFileError

    with pytest.raises(TaskFileError, match="repeats id 'a'"):
        _ = _tasks(tmp_path, ['{"id": "a", "input": 1}', '{"id": "a", "input": 2}']).items


def test_task_file_splits_are_fixed_by_id_and_survive_new_lines(tmp_path: Path) -> None:
    lines = [json.dumps({"id": f"t{i}", "input": f"q{i}"}) for i in range(200)]
    suite = _tasks(tmp_path, lines)
    sizes = suite.split_sizes(suite.subsets[0])
    assert sum(sizes.values()) == 200 and all(40 <= n <= 100 for n in sizes.values())
    before = {k: suite.by_split[k] for k in ("train", "dev", "test")}
    grown = _tasks(tmp_path, [*lines, *(json.dumps({"id": f"new{i}", "input": i}) for i in range(50))])
    for split, ids in before.items():
        assert grown.by_split[split][: len(ids)] == ids
    assert not set(before["train"]) & (set(before["dev"]) | set(before["test"]))
    with pytest.raises(ValueError, match="set splits.dev to at most"):
        suite.split_seeds(suite.subsets[0], "dev", 10_000)
    task = suite.tasks("test", 1)[0]
    assert suite.load(task.id) == task  # a task is rebuilt from its id alone


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("return 'yes'", "returned str 'yes' on task tasks:mine:"),
        ("return 1", "returned int 1 on task"),
        ("return (True, float('nan'))", "returned tuple"),
        ("raise KeyError('answer')", "raised KeyError on task tasks:mine:"),
    ],
)
def test_a_scoring_function_that_raises_or_returns_no_verdict_is_one_line_naming_the_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, says: str
) -> None:
    from ratchet.suites.task_file import ScoreError

    (tmp_path / "bad_score.py").write_text(f"def score(item, answer):\n    {body}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "bad_score", raising=False)
    suite = _tasks(tmp_path, [json.dumps({"id": f"t{i}", "input": i}) for i in range(20)], "bad_score:score")
    task = suite.tasks("train", 1)[0]
    with pytest.raises(ScoreError, match=says) as err:
        suite.score(task, "42")
    assert "\n" not in str(err.value) and "bad_score:score" in str(err.value)


def test_the_settings_refuse_a_task_file_without_a_scorer_or_beside_another_suite(tmp_path: Path) -> None:
    from ratchet.config import load_settings
    from ratchet.errors import ConfigError

    with pytest.raises(ConfigError, match="tasks.file needs tasks.score"):
        load_settings({"tasks.file": str(tmp_path / "a.jsonl")})
    with pytest.raises(ConfigError, match="set either suite"):
        load_settings(
            {"tasks.file": str(tmp_path / "a.jsonl"), "tasks.score": "m:f", "suite": "reasoning-gym"}
        )
    with pytest.raises(ConfigError, match="agent.entry"):
        load_settings({"agent.entry": "not a module"})
    s = load_settings({"tasks.file": str(tmp_path / "my tasks!.jsonl"), "tasks.score": "m:f"})
    assert s.suite == "tasks:my-tasks"


# ---------------------------------------------------------------- against the real model


@pytest.fixture(scope="module")
def endpoint(embedded_server: str) -> Any:
    with InterventionEndpoint(embedded_server) as ep:
        yield ep


@pytest.fixture
def units(monkeypatch: pytest.MonkeyPatch) -> TaskFileSuite:
    monkeypatch.chdir(EXAMPLE)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    return TaskFileSuite(TaskFileSettings(file=EXAMPLE / "tasks.jsonl", score="score:score", max_steps=4))


def _slot(suite: TaskFileSuite, i: int = 0, split: str = "dev") -> RolloutSlot:
    return RolloutSlot("ev", 1, suite.tasks(split, i + 1)[i], 0)  # type: ignore[arg-type]


@pytest.mark.integration
def test_two_parallel_rollouts_never_mix_their_calls(
    endpoint: InterventionEndpoint, units: TaskFileSuite
) -> None:
    agent = YourAgent(AgentSettings(entry="openai_agent:run"))
    slots = [_slot(units, i) for i in range(4)]
    out: dict[int, Any] = {}

    def play(i: int) -> None:
        out[i] = run_agent_rollout(agent, units, slots[i], endpoint, _arm(constraints=(UNITS_CONSTRAINT,)))

    threads = [threading.Thread(target=play, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, slot in enumerate(slots):
        traj = out[i]
        assert traj.status == "finished", traj.error
        assert traj.steps and traj.steps[0].observation == slot.task.instruction
        assert traj.prompt is not None and traj.prompt.task == slot.task.instruction
        others = {s.task.instruction for s in slots} - {slot.task.instruction}
        assert not any(s.observation in others for s in traj.steps)
        first = traj.steps[0]
        assert first.tool_call is not None and first.tool_call.name == "convert"  # tool_choice required
        assert first.rules == ["tasks-args"] and first.prompt_tokens > 0
        assert first.tool_call.args["from_unit"] in slot.task.instruction  # bound to what it read


@pytest.mark.integration
def test_the_endpoint_streams_refuses_unkeyed_calls_and_refuses_a_closed_key(
    endpoint: InterventionEndpoint,
) -> None:
    from openai import AuthenticationError

    before = endpoint.rollouts.unattributed
    plain = OpenAI(base_url=f"{endpoint.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(AuthenticationError, match="no rollout key"):  # never forwarded with the user's key
        plain.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert endpoint.rollouts.unattributed == before + 1
    rec = endpoint.rollouts.open(_arm())
    keyed = OpenAI(base_url=endpoint.rollout_url(rec.key), api_key="x")
    stream = keyed.chat.completions.create(
        model="anything", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text and len(rec.calls) == 1 and rec.calls[0].sent["model"] == MODEL
    endpoint.rollouts.close(rec)
    late = httpx.post(
        f"{endpoint.rollout_url(rec.key)}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert late.status_code == 404 and len(rec.calls) == 1
    forged = httpx.post(
        f"{endpoint.url}/v1/chat/completions",
        headers={"X-Ratchet-Rollout": "guessed-" + rec.key[:8]},
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert forged.status_code == 404


@pytest.mark.integration
def test_an_agent_that_crashes_or_skips_the_model_is_an_error_trajectory(
    endpoint: InterventionEndpoint, units: TaskFileSuite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bad_agents.py").write_text(
        "from openai import OpenAI\n"
        "def crash(question, base_url):\n"
        "    OpenAI(base_url=base_url, api_key='x').chat.completions.create(\n"
        "        model='m', messages=[{'role': 'user', 'content': question}], max_tokens=4)\n"
        "    raise RuntimeError('tool blew up')\n"
        "def cached(question, base_url):\n"
        "    return '42'\n"
        "def greedy(question, base_url):\n"
        "    client = OpenAI(base_url=base_url, api_key='x', max_retries=0)\n"
        "    while True:\n"
        "        client.chat.completions.create(\n"
        "            model='m', messages=[{'role': 'user', 'content': question}], max_tokens=2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    slot = _slot(units)
    crashed = run_agent_rollout(
        YourAgent(AgentSettings(entry="bad_agents:crash")), units, slot, endpoint, _arm()
    )
    assert crashed.status == "error" and "RuntimeError: tool blew up" in (crashed.error or "")
    assert "Traceback" in (crashed.error or "") and len(crashed.steps) == 1  # the call it made is kept
    cached = run_agent_rollout(
        YourAgent(AgentSettings(entry="bad_agents:cached")), units, slot, endpoint, _arm()
    )
    assert cached.status == "error" and "no model call" in (cached.error or "")
    spent = run_agent_rollout(
        YourAgent(AgentSettings(entry="bad_agents:greedy")), units, slot, endpoint, _arm()
    )
    assert spent.status == "finished" and not spent.success and len(spent.steps) == 4  # the step budget


@pytest.mark.integration
def test_a_langgraph_react_agent_plays_through_the_endpoint(
    endpoint: InterventionEndpoint, units: TaskFileSuite
) -> None:
    agent = YourAgent(AgentSettings(entry="langgraph_agent:build", kind="langgraph"))
    slot = _slot(units, 1)
    traj = run_agent_rollout(agent, units, slot, endpoint, _arm(constraints=(UNITS_CONSTRAINT,)))
    assert traj.status == "finished", traj.error
    assert traj.steps[0].observation == slot.task.instruction and traj.steps[0].rules == ["tasks-args"]
    assert traj.prompt is not None and "unit conversion" in traj.prompt.system
    first = traj.steps[0].tool_call  # the example binds tool_choice="required"
    assert first is not None and first.name in ("convert", "list_units")


def test_recorded_calls_replay_into_the_exact_prompts_forwarded_as_training_examples() -> None:
    from ratchet.training.examples import replay
    from tests.factories import traj as make_trajectory

    system = {"role": "system", "content": "You convert.\n\nSkills you have learned: ..."}
    first = [system, {"role": "user", "content": "3 km in m?"}]
    assistant = {
        "role": "assistant",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "convert", "arguments": "{}"}}],
    }
    second = [*first, assistant, {"role": "tool", "tool_call_id": "c1", "content": "3 km = 3000 m"}]
    rewritten = [system, {"role": "user", "content": "Answer in one number."}]  # history not kept
    args = {"value": 3, "from_unit": "km", "to_unit": "m"}
    calls = [
        Call(
            request={"messages": first},
            sent={"messages": first, "tools": [CONVERT]},
            fired=[],
            menu=None,
            reply=_reply(call=("convert", args, "c1")),
        ),
        Call(
            request={"messages": second},
            sent={"messages": second, "tools": [CONVERT]},
            fired=[],
            menu=None,
            reply=_reply("3000 meters"),
        ),
        Call(
            request={"messages": rewritten},
            sent={"messages": rewritten},
            fired=[],
            menu=None,
            reply=_reply("3000"),
        ),
    ]
    steps = steps_of(calls)
    assert steps[1].call is not None and steps[1].call.continues and steps[1].call.tools is None
    assert steps[1].call.messages == second[2:]  # only what it added is stored
    assert steps[2].call is not None and not steps[2].call.continues and steps[2].call.tools == []
    traj = make_trajectory([], success=True, task="tasks:units:train:u1").model_copy(update={"steps": steps})
    examples = replay(traj)  # no prompt record needed: each call carries its own
    assert [e.messages for e in examples] == [first, second, rewritten]
    assert [e.tools for e in examples] == [[CONVERT], [CONVERT], []]
    assert examples[0].target["tool_calls"][0]["function"]["name"] == "convert"
    assert examples[1].target == {"role": "assistant", "content": "3000 meters"}
    prompt, target = examples[0].turns()  # rendered as the embedded server renders a request
    assert (
        prompt[0]["role"] == "system" and "convert" in prompt[0]["content"] and target["role"] == "assistant"
    )


# ---------------------------------------------------------------- hostile requests


@pytest.fixture
def offline_endpoint() -> Any:
    """An endpoint whose model is unreachable (a port nothing listens on): what it refuses,
    it refuses before forwarding."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with InterventionEndpoint(dead, timeout_s=5) as ep:
        yield ep


def test_the_endpoint_listens_on_loopback_only_without_nagle(offline_endpoint: InterventionEndpoint) -> None:
    assert offline_endpoint.url.startswith("http://127.0.0.1:")
    assert offline_endpoint._sock.getsockname()[0] == "127.0.0.1"
    import socket

    # without it each reply waited for the agent's delayed ACK: 40 ms a call (endpoint_overhead)
    assert offline_endpoint._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@pytest.mark.parametrize(
    ("payload", "status", "says"),
    [
        (b"{not json", 400, "not JSON"),
        (b"[1, 2]", 400, "needs 'messages'"),
        (b'{"messages": "hi"}', 400, "needs 'messages'"),
        (b'{"model": "m"}', 400, "needs 'messages'"),
        (b"\xff\xfe", 400, "not JSON"),
        (b"\x80\x81{}", 400, "not JSON"),
        (b'{"messages": [' * 20000, 400, "not JSON"),
    ],
)
def test_malformed_bodies_are_refused_and_record_nothing(
    offline_endpoint: InterventionEndpoint, payload: bytes, status: int, says: str
) -> None:
    rec = offline_endpoint.rollouts.open(_arm())
    got = httpx.post(
        f"{offline_endpoint.rollout_url(rec.key)}/chat/completions",
        content=payload,
        headers={"Content-Type": "application/json"},
    )
    assert got.status_code == status and says in got.json()["error"]["message"]
    assert rec.calls == []


def test_an_oversized_body_is_refused(offline_endpoint: InterventionEndpoint) -> None:
    rec = offline_endpoint.rollouts.open(_arm())
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * (17 * 1024 * 1024)}]})
    got = httpx.post(
        f"{offline_endpoint.rollout_url(rec.key)}/chat/completions",
        content=huge,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert got.status_code == 413 and rec.calls == []


@pytest.mark.parametrize(
    "tools",
    [
        "convert",
        [{"type": "function", "function": {"name": 5}}],
        [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}],
        [None, 3],
        [{"type": "code_interpreter"}],
    ],
)
def test_hostile_tool_lists_never_break_the_endpoint(
    offline_endpoint: InterventionEndpoint, tools: Any
) -> None:
    """Tools the policy cannot read are passed on as sent (the model server judges them): the
    endpoint neither crashes nor rewrites what it does not understand."""
    arm = _arm(constraints=(UNITS_CONSTRAINT,), rules=(RuleSpec(name="r", avoid=("convert: *",)),))
    sent, fired, menu = arm_request(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools}, arm, 0, []
    )
    assert sent["tools"] == tools and fired == [] and menu is None


@pytest.mark.parametrize(
    "path",
    [
        "/r/{wrong}/v1/chat/completions",
        "/r/{prefix}/v1/chat/completions",
        "/r/{key}%2F..%2F/v1/chat/completions",
        "/r//v1/chat/completions",
        "/r/{key}/../{other}/v1/chat/completions",
    ],
)
def test_a_guessed_or_mangled_key_never_lands_in_a_rollout(
    offline_endpoint: InterventionEndpoint, path: str
) -> None:
    rec = offline_endpoint.rollouts.open(_arm())
    other = offline_endpoint.rollouts.open(_arm())
    url = offline_endpoint.url + path.format(
        wrong="x" * len(rec.key), prefix=rec.key[:-1], key=rec.key, other=other.key
    )
    got = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert got.status_code in (404, 405, 502) and rec.calls == []
    # the dot-segment is resolved by the client or the router: at most the other rollout is named,
    # with the key it was given, and never the first one's
    assert all(c.request["messages"][0]["content"] == "hi" for c in other.calls)


def test_a_path_key_wins_over_a_header_key(offline_endpoint: InterventionEndpoint) -> None:
    rec = offline_endpoint.rollouts.open(_arm())
    other = offline_endpoint.rollouts.open(_arm())
    httpx.post(
        f"{offline_endpoint.rollout_url(rec.key)}/chat/completions",
        headers={"X-Ratchet-Rollout": other.key},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert len(rec.calls) == 1 and other.calls == []


def test_an_unreachable_model_is_a_retried_rollout_not_an_agent_error(
    offline_endpoint: InterventionEndpoint, units: TaskFileSuite
) -> None:
    from ratchet.agents.model import is_transient

    agent = YourAgent(AgentSettings(entry="openai_agent:run"))
    with pytest.raises(Exception) as err:
        run_agent_rollout(agent, units, _slot(units), offline_endpoint, _arm())
    assert is_transient(err.value) and "unreachable" in str(err.value)
    assert len(offline_endpoint.rollouts) == 0  # closed: a late retry of the client lands nowhere


def test_a_task_file_passes_the_conformance_kit(units: TaskFileSuite) -> None:
    from ratchet.conformance import check_suite

    failed = [r for r in check_suite(units, tokenizer=lambda text: len(text.split())) if not r.ok]
    assert failed == []


@pytest.mark.integration
def test_a_generation_evolves_your_agent_and_gates_a_candidate_through_it(
    embedded_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole loop with the plain openai agent, unchanged: explore, diagnose, distill, a
    gate played through the agent, evaluate; a rerun plays nothing again."""
    from ratchet.config import load_settings
    from ratchet.flows.evolve import evolve_flow
    from ratchet.memory.trajectory_store import open_store

    monkeypatch.chdir(EXAMPLE)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    settings = load_settings(
        {
            "data_dir": tmp_path,
            "tasks.file": str(EXAMPLE / "tasks.jsonl"),
            "tasks.score": "score:score",
            "tasks.max_steps": 4,
            "agent.entry": "openai_agent:run",
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
    rows = journal.rows()
    assert [r.generation for r in rows] == [0, 1] and rows[1].test_n == 3
    # no random level for a task file: generation 1 is paired with generation 0, task by task
    assert rows[0].random_success is None and len(rows[0].test_by_task or {}) == 3
    assert rows[1].vs_first_p is not None and 0 <= rows[1].vs_first_better + rows[1].vs_first_worse <= 3
    store = open_store(settings.trajectories_db)
    try:
        trajs = store.query(evolution="default")
    finally:
        store.close()
    assert {t.split for t in trajs} == {"train", "dev", "test"}  # the gate played dev tasks through it
    assert all(t.status == "finished" and t.suite == "tasks" for t in trajs), [t.error for t in trajs]
    assert all(t.steps and t.steps[0].call is not None for t in trajs)  # every call recorded, replayable
    assert {t.arm for t in trajs if t.split == "dev"} >= {"baseline"}
    assert all(t.steps[0].observation == t.instruction for t in trajs)
    before = {t.id: t.created_at for t in trajs}
    evolve_flow(settings=settings, generations=1, base_url=embedded_server)
    store = open_store(settings.trajectories_db)
    try:
        assert {t.id: t.created_at for t in store.query(evolution="default")} == before
    finally:
        store.close()


def test_preflight_refuses_your_agent_where_it_cannot_play(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before anything runs: an agent that does not import, search (it replays the actor), and
    a suite whose tasks take tool calls are each one line."""
    from ratchet.config import load_settings
    from ratchet.errors import RatchetError
    from ratchet.flows.runtime import preflight

    monkeypatch.chdir(EXAMPLE)
    base = {
        "data_dir": str(tmp_path),
        "tasks.file": str(EXAMPLE / "tasks.jsonl"),
        "tasks.score": "score:score",
        "splits.train": 4,
        "splits.test": 4,
    }
    with pytest.raises(RatchetError, match="cannot load agent 'no_such_module:run'") as err:
        preflight(load_settings(base | {"agent.entry": "no_such_module:run"}))
    assert "\n" not in str(err.value)
    with pytest.raises(RatchetError, match="set explore.search = 0"):
        preflight(load_settings(base | {"agent.entry": "openai_agent:run", "explore.search": 10}))
    with pytest.raises(RatchetError, match="takes tool calls"):
        preflight(
            load_settings(
                {
                    "data_dir": str(tmp_path),
                    "suite": "reasoning-gym:chain_sum",
                    "agent.entry": "openai_agent:run",
                }
                | {"splits.train": 1}
            )
        )
    with pytest.raises(RatchetError, match="cannot load scoring function 'score:nope'"):
        preflight(load_settings(base | {"tasks.score": "score:nope"}))


def test_the_same_request_twice_is_two_calls_with_their_own_seeds() -> None:
    """An agent that retries a request word for word: each is its own call, its own index."""
    rec = Rollouts().open(_arm())
    same = {"messages": [{"role": "user", "content": "3 km in m?"}]}
    first, second = rec.begin(same), rec.begin(dict(same))
    assert first is not None and second is not None
    assert rec.calls.index(second) == 1 and rec.calls.index(first) == 0
