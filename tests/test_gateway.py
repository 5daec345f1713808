"""The gateway (`gateway/`): the live champion applied to every call of a user's agent, the
version named on every answer, and swapped without a restart when a decision lands.

In front of a recording upstream on a real port (what the model server received is the
evidence), with a real data dir (a promoted procedure, a promoted argument constraint, the
audit logs the watch reads) and the real uvicorn server. The real embedded model and a real
`ratchet` process deciding beside it are in tests/test_gateway_live.py; attacks in
tests/test_gateway_attacks.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from ratchet.config import Settings, load_settings
from ratchet.endpoint.apply import arm_request
from ratchet.endpoint.recording import Arm
from ratchet.flows.runtime import champion_policy, live_retriever
from ratchet.gateway.policy import AuditWatch
from ratchet.gateway.request import BadRequest, Chooser, forwarded, parse, task_text
from ratchet.gateway.serve import Gateway, NoChampion
from ratchet.gateway.snapshot import CHAMPION_HEADER, POLICY_HEADER, Live, Snapshot
from ratchet.skills.calls import apply_request, for_task
from ratchet.skills.format import Skill
from ratchet.skills.kinds import render_skills
from ratchet.skills.library import SkillLibrary
from ratchet.types import ArgConstraint, ConstraintSpec, Policy, RuleSpec, SkillText, ToolCall, ToolSpec
from tests.factories import add_verified

MODEL = "smollm2-135m-instruct"
USER_KEY = "sk-the-users-own-upstream-key"
SYSTEM = "You answer unit conversion questions. Call the convert tool."
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "description": "Convert a quantity from one unit to another.",
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
    "x-agent-key": "kept",
}
ASK = {
    "model": "gpt-4o",
    "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How many meters are 3 km?"},
    ],
    "tools": [CONVERT],
    "tool_choice": "required",
    "temperature": 0.7,
    "top_p": 0.9,
    "max_tokens": 48,
}
UNITS = ConstraintSpec(
    name="units-args",
    tools={
        "convert": {
            "from_unit": ArgConstraint(from_context=True),
            "to_unit": ArgConstraint(from_context=True),
        }
    },
)


def completion(model: str, content: str = "3000 m") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
    }


class Upstream:
    """A scripted OpenAI-compatible model on a real port. Keeps every chat request (its body
    and the Authorization it carried); answers a completion, or `chunks` server-sent events
    `delay` seconds apart for `stream: true`, the first of them the system text it was sent;
    `status` answers an error instead; `cut` ends a stream after its first chunk without
    [DONE] (the connection dropped)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.status, self.delay, self.chunks, self.cut = 200, 0.0, 3, False
        self.loaded: list[dict[str, Any]] = []
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            names = [MODEL, *(a["lora_name"] for a in self.loaded)]
            return {"object": "list", "data": [{"id": n, "object": "model"} for n in names]}

        @app.post("/v1/load_lora_adapter")
        async def load(request: Request) -> Response:
            self.loaded.append(json.loads(await request.body()))
            return Response("ok")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            self.seen.append({"body": body, "auth": request.headers.get("authorization")})
            if self.status != 200:
                err = {"error": {"message": "slow down", "type": "rate_limit_error"}}
                head = {"Set-Cookie": "upstream=1", "X-Upstream-Secret": "s"}  # never passed on
                return Response(json.dumps(err), self.status, media_type="application/json", headers=head)
            if not body.get("stream"):
                await asyncio.sleep(self.delay)
                return Response(json.dumps(completion(body["model"])), media_type="application/json")
            system = next((m["content"] for m in body["messages"] if m["role"] == "system"), "")
            return StreamingResponse(self._events(body["model"], system), media_type="text/event-stream")

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve(sockets=[self._sock])), daemon=True
        )

    async def _events(self, model: str, system: str) -> Any:
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model}
        for i in range(self.chunks):
            delta = {"role": "assistant", "content": system} if i == 0 else {"content": f"part{i} "}
            yield f"data: {json.dumps(base | {'choices': [{'index': 0, 'delta': delta}]})}\n\n"
            if self.cut:
                raise RuntimeError("the model server went away")
            await asyncio.sleep(self.delay)
        end = {"index": 0, "delta": {}, "finish_reason": "stop"}
        yield f"data: {json.dumps(base | {'choices': [end]})}\n\n"
        yield "data: [DONE]\n\n"

    def __enter__(self) -> Upstream:
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def data_dir(root: Path, timeout_s: float = 5) -> Settings:
    """A data dir whose live policy is a promoted procedure and a promoted argument constraint;
    `timeout_s`: how long the gateway waits for the upstream (a scripted one answers at once)."""
    settings = load_settings({"data_dir": root / "data", "model.timeout_s": timeout_s})
    library = SkillLibrary(settings.skills_dir, settings.index_dir)
    add_verified(library, "units-read-both", "Read both units in the question before you convert.")
    library.transition("units-read-both", "promoted", who="test", why="live")
    constraint = Skill(
        name="units-args",
        description="Units are the question's own.",
        body="Argument constraints.",
        kind="constraint",
        family="tasks:units",
        evolution="default",
        generation=1,
        provenance=["t1"],
        constraint=UNITS,
    )
    library.add(constraint)
    library.transition("units-args", "verified", who="verify", why="gate passed")
    library.transition("units-args", "promoted", who="test", why="live")
    return settings


DECIDE = """
import sys
from ratchet.decisions import apply
from ratchet.skills.library import SkillLibrary
skills, index, name, action = sys.argv[1:]
apply(SkillLibrary(skills, index), name, action, who="another process", why="a decision")
"""


def decide_elsewhere(settings: Settings, name: str, action: str) -> None:
    """`action` on skill `name`, decided by another process (`ratchet.decisions`)."""
    argv = [sys.executable, "-c", DECIDE, str(settings.skills_dir), str(settings.index_dir), name, action]
    subprocess.run(argv, check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    with Upstream() as up:
        yield up


@pytest.fixture
def up(upstream: Upstream) -> Upstream:
    upstream.seen.clear()
    upstream.status, upstream.delay, upstream.chunks, upstream.cut = 200, 0.0, 3, False
    return upstream


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return data_dir(tmp_path_factory.mktemp("gateway"))


@pytest.fixture(scope="module")
def served(settings: Settings, upstream: Upstream) -> Iterator[Gateway]:
    with Gateway(settings, upstream.url, poll_s=0.1) as gw:
        yield gw


def _sse(text: str) -> list[dict[str, Any] | str]:
    """The events of a stream: each `data:` payload, parsed ('[DONE]' as is)."""
    out: list[dict[str, Any] | str] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---------------------------------------------------------------- the snapshot and the swap


def _snap(skill_body: str = "", champion: bool = True) -> Snapshot:
    skills = (SkillText(name="s", description="d", body=skill_body),) if skill_body else ()
    return Snapshot(Policy(model=MODEL, skills=skills), champion=champion)


def test_a_swap_moves_the_one_reference_and_logs_the_old_and_new_version(
    caplog: pytest.LogCaptureFixture,
) -> None:
    first = _snap("a")
    live = Live(first)
    with caplog.at_level(logging.INFO, logger="ratchet.gateway"):
        assert live.swap(_snap("a")) is None  # the same version again: nothing moves, nothing said
        assert live.current is first and live.swaps == 0 and not caplog.records
        second = _snap("b")
        assert live.swap(second) is first
    assert live.current is second and live.swaps == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"policy {first.version} → {second.version}" in line


def test_every_answer_names_the_version_and_a_base_model_says_it_is_one() -> None:
    assert _snap("a").headers() == {POLICY_HEADER: _snap("a").version}
    base = _snap(champion=False).headers()
    assert base[POLICY_HEADER] == Policy(model=MODEL).version and "base model" in base[CHAMPION_HEADER]


def test_the_audit_watch_reloads_on_a_change_only_and_retries_a_failed_reload(tmp_path: Path) -> None:
    log = tmp_path / "audit.jsonl"
    calls: list[float] = []
    failing = threading.Event()

    def reload() -> None:
        calls.append(time.monotonic())
        if failing.is_set():
            raise RuntimeError("adapter files changed")

    watch = AuditWatch([log, tmp_path / "absent.jsonl"], reload, poll_s=0.05, retry_s=0.2).start()
    try:
        time.sleep(0.5)
        assert calls == []  # nothing changed
        log.write_text('{"a": 1}\n')  # a new log: a change
        _until(lambda: len(calls) == 1)
        failing.set()
        with log.open("a") as f:
            f.write('{"b": 2}\n')
        _until(lambda: len(calls) >= 3)  # failed, then tried again with nothing more written
        assert watch.error == "RuntimeError: adapter files changed"
        failing.clear()
        _until(lambda: watch.error is None)
        n = len(calls)
        time.sleep(0.5)
        assert len(calls) == n  # reloaded once it worked, then quiet again
    finally:
        watch.stop()


def _until(ok: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not ok():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


# ---------------------------------------------------------------- the request, as forwarded


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"messages": [], "messages": [{"role": "user", "content": "x"}]}', '"messages" twice'),
        (b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}', '"role" twice'),
        (b'{"messages": [], "temperature": NaN}', "NaN"),
        (b'{"messages": [], "temperature": -Infinity}', "-Infinity"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
        (b'{"messages": "hi"}', "'messages', a list"),
        (b'{"messages": ["hi"]}', "entry 0 is not an object"),
        (b'{"messages": [], "tools": {"a": 1}}', "'tools' must be a list"),
        (b'{"messages": [], "stream": "yes"}', "'stream' must be true or false"),
        (b"[1, 2]", "'messages', a list"),
        (b"\xff\xfe not json", "is not JSON"),
        (b"[" * 50_000, "is not JSON"),
    ],
)
def test_a_request_the_policy_cannot_be_applied_to_is_one_line(raw: bytes, says: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse(raw)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_the_conversations_earlier_calls_feed_the_no_repeat_rule_as_the_endpoints_recording_does() -> None:
    go = ToolSpec(
        name="go",
        description="move",
        parameters={"type": "object", "properties": {"where": {"enum": ["north", "south", "east"]}}},
    )
    policy = Policy(model=MODEL, rules=(RuleSpec(name="no-repeat", no_repeat=True),))
    tool = {"type": "function", "function": go.model_dump()}
    called = {"id": "c1", "type": "function", "function": {"name": "go", "arguments": '{"where": "north"}'}}
    body = {
        "messages": [
            {"role": "user", "content": "You are in the hall."},
            {"role": "assistant", "content": None, "tool_calls": [called]},
            {"role": "tool", "tool_call_id": "c1", "content": "You are in the hall."},
        ],
        "tools": [tool],
    }
    sent = forwarded(policy, body, Chooser(load_settings({}).skills))
    assert sent["tools"][0]["function"]["parameters"]["properties"]["where"]["enum"] == ["south", "east"]
    earlier = [("You are in the hall.", ToolCall(name="go", args={"where": "north"}))]
    by_endpoint, _, _ = arm_request(body, Arm(policy, temperature=0.0, seed=0), 1, earlier)
    assert sent["tools"] == by_endpoint["tools"]


def test_the_skills_shown_are_the_ones_the_loops_retriever_chooses_for_the_task(tmp_path: Path) -> None:
    """The gateway embeds the promoted skills itself (it never reads the index an evolve writes);
    it must still pick what the loop's retriever picks from its index for the same text."""
    settings = load_settings({"data_dir": tmp_path, "skills.k": 2})
    topics = ["units of length", "units of mass", "temperatures", "currency", "time zones", "colours"]
    skills = tuple(
        SkillText(name=f"s{i}", description=t, body=f"How to handle {t}.") for i, t in enumerate(topics)
    )
    index = live_retriever(settings)
    index.sync(skills)
    policy = Policy(model=MODEL, skills=skills)
    chooser = Chooser(settings.skills)
    for question in ["How many grams in a pound?", "What is 3 km in miles?", "Convert 20 C to F", ""]:
        by_loop = tuple(index.select(question, skills, 2, settings.skills.token_budget))
        assert chooser.choose(policy, question) == (by_loop, None), question
    assert (
        task_text(
            [{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "q"}]}]
        )
        == "q"
    )


def test_a_gateway_told_a_temperature_sets_it_on_every_request(settings: Settings, up: Upstream) -> None:
    """`--temperature 0` serves as the gate measured (greedy), whatever the agent sends."""
    with Gateway(settings, up.url, poll_s=0.1, temperature=0.0) as gw:
        got = httpx.post(f"{gw.url}/chat/completions", json=ASK)
    assert got.status_code == 200, got.text
    (seen,) = up.seen
    assert seen["body"]["temperature"] == 0.0 and ASK["temperature"] == 0.7


# ---------------------------------------------------------------- through the real server


def test_the_upstream_receives_the_champions_system_section_and_bound_tools(
    served: Gateway, up: Upstream, settings: Settings
) -> None:
    got = httpx.post(
        f"{served.url}/chat/completions", json=ASK, headers={"Authorization": "Bearer sk-client"}
    )
    assert got.status_code == 200, got.text
    policy = champion_policy(settings, SkillLibrary(settings.skills_dir, settings.index_dir))
    assert got.headers[POLICY_HEADER] == policy.version == got.json()["system_fingerprint"]
    assert CHAMPION_HEADER not in got.headers
    own, upstream = (float(p.split(";dur=")[1]) for p in got.headers["Server-Timing"].split(", "))
    assert 0 < own and 0 < upstream  # the gateway's own part, and the upstream's, in ms
    (seen,) = up.seen
    sent = seen["body"]
    assert seen["auth"] == f"Bearer {settings.model.api_key.get_secret_value()}"  # never the client's
    assert sent["model"] == MODEL  # no adapter: the base model by name
    (skill,) = policy.skills
    assert sent["messages"][0] == {"role": "system", "content": f"{SYSTEM}\n\n{render_skills([skill])}"}
    units = sent["tools"][0]["function"]["parameters"]["properties"]["from_unit"]["enum"]
    assert {"km", "meters"} <= set(units)  # bound to what the question says
    assert sent["tools"][0]["x-agent-key"] == "kept"
    # the user's sampling passed on unchanged, and nothing the gateway applied of its own
    assert {k: sent[k] for k in ("temperature", "top_p", "max_tokens", "tool_choice")} == {
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 48,
        "tool_choice": "required",
    }
    assert sent == apply_request(for_task(policy, (skill,), None), ASK).body


def test_a_streamed_answer_names_the_version_on_every_chunk(served: Gateway, up: Upstream) -> None:
    from openai import OpenAI

    up.chunks = 4
    client = OpenAI(base_url=served.url, api_key="anything", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(**(ASK | {"stream": True}))
    version = raw.headers[POLICY_HEADER]
    chunks = list(raw.parse())
    assert len(chunks) == 5 and {c.system_fingerprint for c in chunks} == {version}
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text.startswith(SYSTEM) and text.endswith("part1 part2 part3 ")
    assert up.seen[-1]["body"]["stream"] is True
    text = httpx.post(f"{served.url}/chat/completions", json=ASK | {"stream": True}).text
    assert text.endswith("data: [DONE]\n\n")


def test_models_names_the_one_model_served(served: Gateway) -> None:
    got = httpx.get(f"{served.url}/models")
    assert got.json()["data"][0]["id"] == MODEL and got.headers[POLICY_HEADER] == served.snapshot.version


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_upstreams_own_error_is_passed_on(served: Gateway, up: Upstream, stream: bool) -> None:
    up.status = 429
    got = httpx.post(f"{served.url}/chat/completions", json=ASK | {"stream": stream})
    assert got.status_code == 429 and got.json()["error"]["message"] == "slow down"
    assert got.headers[POLICY_HEADER] == served.snapshot.version


def test_an_upstream_that_is_down_slow_or_cut_is_one_line_never_a_hang(
    settings: Settings, up: Upstream, tmp_path: Path
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with Gateway(settings, down) as gw:
        got = httpx.post(f"{gw.url}/chat/completions", json=ASK, timeout=30)
        assert got.status_code == 502 and "unreachable" in got.json()["error"]["message"]
        got = httpx.post(f"{gw.url}/chat/completions", json=ASK | {"stream": True}, timeout=30)
        assert got.status_code == 502
    slow = settings.model_copy(update={"model": settings.model.model_copy(update={"timeout_s": 0.5})})
    with Gateway(slow, up.url) as gw:
        up.delay = 3.0
        started = time.monotonic()
        got = httpx.post(f"{gw.url}/chat/completions", json=ASK, timeout=30)
        assert got.status_code == 504 and time.monotonic() - started < 3.0
        up.delay, up.cut = 0.0, True
        events = _sse(httpx.post(f"{gw.url}/chat/completions", json=ASK | {"stream": True}, timeout=30).text)
    assert isinstance(events[0], dict) and "choices" in events[0]
    assert isinstance(events[-1], dict) and "broke off" in events[-1]["error"]["message"]


def test_without_a_champion_it_starts_only_when_asked_and_says_so(tmp_path: Path, up: Upstream) -> None:
    bare = load_settings({"data_dir": tmp_path / "bare"})
    with pytest.raises(NoChampion, match="--allow-base") as info:
        Gateway(bare, up.url)
    assert "\n" not in str(info.value)
    with Gateway(bare, up.url, allow_base=True) as gw:
        got = httpx.post(f"{gw.url}/chat/completions", json=ASK)
    assert got.status_code == 200 and "base model" in got.headers[CHAMPION_HEADER]
    assert got.headers[POLICY_HEADER] == Policy(model=MODEL).version
    assert up.seen[-1]["body"]["messages"] == ASK["messages"]  # nothing added


# ---------------------------------------------------------------- hot swap


NEW_SKILL = "Check the unit of the answer."


def test_requests_in_flight_keep_their_version_while_decisions_land(
    tmp_path: Path, up: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    """8 streams at a time, each 1 s long, while another process promotes a skill and then rolls it
    back (`ratchet.decisions`, as the CLI, the dashboard and the `promote` flow decide): every
    answer is whole, names one version in its header and in every chunk, and the upstream was
    asked under that same version (its system text); new requests carry each new version soon."""
    settings = data_dir(tmp_path)
    add_verified(SkillLibrary(settings.skills_dir, settings.index_dir), "units-check", NEW_SKILL)
    up.chunks, up.delay = 5, 0.2
    stop = threading.Event()
    results: list[tuple[str, set[str], bool, bool]] = []  # header, fingerprints, whole, new skill shown
    errors: list[str] = []

    def client(gw: Gateway) -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                try:
                    got = c.post(f"{gw.url}/chat/completions", json=ASK | {"stream": True})
                    events = _sse(got.text)
                    chunks = [e for e in events if isinstance(e, dict)]
                    prints = {e["system_fingerprint"] for e in chunks}
                    shown = NEW_SKILL in chunks[0]["choices"][0]["delta"]["content"]  # what the model got
                    results.append((got.headers[POLICY_HEADER], prints, events[-1] == "[DONE]", shown))
                except Exception as exc:  # noqa: BLE001 - every failure is counted, none ends the load
                    errors.append(repr(exc))

    with caplog.at_level(logging.INFO, logger="ratchet.gateway"), Gateway(settings, up.url, poll_s=0.1) as gw:
        first = gw.snapshot.version
        with ThreadPoolExecutor(8) as pool:
            for _ in range(8):
                pool.submit(client, gw)
            time.sleep(1.5)
            decide_elsewhere(settings, "units-check", "promote")
            _until(lambda: gw.snapshot.version != first)
            second = gw.snapshot.version
            time.sleep(1.5)
            decide_elsewhere(settings, "units-check", "rollback")
            _until(lambda: gw.snapshot.version == first)
            time.sleep(1.5)
            stop.set()
    assert errors == [] and len(results) >= 16
    for header, prints, whole, shown in results:
        assert whole and prints == {header} and shown == (header == second), (header, prints, shown)
    assert {h for h, *_ in results} == {first, second}
    swaps = [r.getMessage() for r in caplog.records if "→" in r.getMessage()]
    assert [s.split(" (")[0] for s in swaps] == [f"policy {first} → {second}", f"policy {second} → {first}"]


# ---------------------------------------------------------------- the tools over MCP

SCALE = """
import re

def run(factor: float, task: str) -> str:
    return str(float(re.findall(r"-?[0-9.]+", task)[0]) * factor)
"""
MACRO = "def run() -> list:\n    return [{'tool': 'act', 'args': {'action': 'look'}}]\n"


def _tool_skill(name: str, kind: str, code: str, params: dict[str, Any]) -> Skill:
    from ratchet.skills.format import ToolSource

    return Skill(
        name=name,
        description=f"The {name} tool.",
        body="",
        kind="tool",
        family="tasks:units",
        evolution="default",
        generation=1,
        provenance=["t1"],
        tool=ToolSource(kind=kind, parameters=params, code=code),  # type: ignore[arg-type]
    )


@pytest.mark.integration  # the sandbox (bubblewrap) runs every tool call
def test_the_promoted_function_tools_are_served_over_mcp_under_the_live_version(
    tmp_path: Path, up: Upstream
) -> None:
    from fastmcp import Client

    settings = data_dir(tmp_path)
    library = SkillLibrary(settings.skills_dir, settings.index_dir)
    factor = {"type": "object", "properties": {"factor": {"type": "number"}}, "required": ["factor"]}
    for skill in (
        _tool_skill("units-scale", "function", SCALE, factor),
        _tool_skill("coin-go", "macro", MACRO, {"type": "object", "properties": {}}),
    ):
        library.add(skill)
        library.transition(skill.name, "verified", who="verify", why="gate passed")
        library.transition(skill.name, "promoted", who="test", why="live")
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    accept = {"Accept": "application/json, text/event-stream"}
    with Gateway(settings, up.url, poll_s=0.1) as gw:
        mcp = gw.url.removesuffix("/v1") + "/mcp"
        got = httpx.post(mcp, json=listing, headers=accept)
        assert got.headers[POLICY_HEADER] == gw.snapshot.version
        (tool,) = got.json()["result"]["tools"]  # the macro is a move in ratchet's suites: not offered
        assert tool["name"] == "units-scale" and tool["inputSchema"]["required"] == ["factor", "task"]

        async def call() -> Any:
            async with Client(mcp) as client:
                return await client.call_tool("units-scale", {"factor": 2, "task": "3 km"})

        assert asyncio.run(call()).data == {"result": "6.0"}
        before = gw.snapshot.version
        decide_elsewhere(settings, "units-scale", "retire")
        _until(lambda: gw.snapshot.version != before)
        got = httpx.post(mcp, json=listing, headers=accept)
        assert got.json()["result"]["tools"] == [] and got.headers[POLICY_HEADER] == gw.snapshot.version
