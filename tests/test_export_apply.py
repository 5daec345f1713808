"""An export's apply.py (`flows/export_apply.py`, stdlib only) changes a request body exactly as
ratchet's `apply_request` does for the same policy: property-style over random policies (prompt
skills, exemplars, rules of every shape, argument constraints of every field) and random bodies
(system or not, parts, history, tools with menus, grids, free tools, tools that are not plain
functions, junk entries); the episode's tried actions it reads from the history as the
intervention endpoint records them; its per-task choice of texts is the live retriever's on the
real MiniLM embeddings; it imports nothing but the standard library and runs without ratchet."""

from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ratchet.config import load_settings
from ratchet.endpoint.apply import reply_call, tried_before
from ratchet.endpoint.recording import Call
from ratchet.flows import export_apply
from ratchet.flows.export import FORMAT, prompt_data, write_policy
from ratchet.skills.calls import apply_request, for_task, latest_observation
from ratchet.types import ArgConstraint, ConstraintSpec, Policy, RuleSpec, SkillText

GO = {
    "type": "function",
    "function": {
        "name": "go",
        "description": "move",
        "parameters": {
            "type": "object",
            "properties": {"where": {"type": "string", "enum": ["north", "south", "east", "west"]}},
            "required": ["where"],
        },
    },
}
MACRO = {
    "type": "function",
    "function": {
        "name": "macro",
        "description": "two moves",
        "parameters": {
            "type": "object",
            "properties": {
                "first": {"type": "string", "enum": ["north", "south", "east"]},
                "second": {"type": "string", "enum": ["north", "south", "east"]},
            },
            "required": ["first", "second"],
        },
    },
    "x-agent-key": 7,
}
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "description": "convert units",
        "parameters": {
            "type": "object",
            "properties": {
                "value": {"type": "number"},
                "from_unit": {"type": "string"},
                "to_unit": {"type": "string", "maxLength": 12},
                "code": {"type": "string", "minLength": 3},
                "premise": {"type": "string"},
                "count": {"type": "integer"},
            },
            "required": ["value", "from_unit", "to_unit"],
        },
    },
}
PICK = {  # two enumerated parameters, one optional: not a grid, not a menu; one `pick: *` entry
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {
                "item": {"type": "string", "enum": ["coin", "key"]},
                "hand": {"type": "string", "enum": ["left", "right"]},
            },
            "required": ["item"],
        },
    },
}
ACT = {  # one enumerated parameter beside a free one: a menu of its values
    "type": "function",
    "function": {
        "name": "act",
        "parameters": {
            "type": "object",
            "properties": {
                "action": {"type": "string", "enum": ["open door", "take coin", "go north"]},
                "why": {"type": "string"},
            },
            "required": ["action"],
        },
    },
}
LOOK = {"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {}}}}
ANSWER = {
    "function": {
        "name": "answer",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
    }
}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: taken as none
# not plain function tools: the request's tools pass through untouched
SEARCH = {"type": "web_search"}
CUSTOM = {"type": "custom", "function": {"name": "go", "parameters": GO["function"]["parameters"]}}
TOOLS = [GO, MACRO, PICK, ACT, CONVERT, LOOK, ANSWER, PING]

WORDS = [
    "hall",
    "Kitchen",
    "door",
    "COIN",
    "north",
    "convert",
    "miles",
    "new  york",
]  # compared in normal form
PATTERNS = ["go: south", "go: *", "macro: north, *", "macro: east, east", "convert: *", "look", "answer: *"]
PATTERNS += ["pick: *", "pick: coin", "act: take *", "act: open door", "ping"]
TEXTS = [
    "How many meters are in 5.2 miles? You are in the hall.",
    "Convert 3 kilometers to meters for New York, in EUR or USD. The kitchen has a coin.",
    "Premises:\n1. (Q ∧ P)\n2. - R or S\n.3. T\nThe hall has a door to the north.",
    "I have 56 kilograms. How much is that in pounds? 42 coins; 7.5 l.",
    " ".join(f"Word{i}" for i in range(120)) + " in 3 rooms",  # more spans than an enum may hold
]


def _rule(rng: random.Random, i: int) -> RuleSpec:
    return RuleSpec(
        name=f"r{rng.randint(0, 99)}-{i}",  # listed in any order: applied in name order
        when=tuple(rng.sample(WORDS, rng.choice([0, 0, 1, 2]))),
        avoid=tuple(rng.sample(PATTERNS, rng.randint(0, 2))),
        prefer=tuple(rng.sample(PATTERNS, rng.randint(0, 1))),
        no_repeat=rng.random() < 0.5,
    )


def _arg(rng: random.Random) -> ArgConstraint:
    from_context = rng.random() < 0.8
    return ArgConstraint(
        from_context=from_context,
        whole_line=from_context and rng.random() < 0.3,
        max_length=rng.choice([None, 6, 12, 40]),
        min_length=rng.choice([None, 3]) if from_context else None,
        shape=rng.choice([None, None, "upper", "title"]) if from_context else None,
        integer=rng.random() < 0.3,
    )


def _constraint(rng: random.Random, i: int) -> ConstraintSpec:
    args = rng.sample(
        ["value", "from_unit", "to_unit", "code", "premise", "count", "missing"], rng.randint(1, 4)
    )
    tools = {"convert": {a: _arg(rng) for a in args}}
    if rng.random() < 0.3:
        tools["answer"] = {"text": _arg(rng)}
    if rng.random() < 0.3:
        tools["act"] = {"why": _arg(rng), "action": _arg(rng)}  # `action` has an enum: left alone
    return ConstraintSpec(name=f"c{rng.randint(0, 99)}-{i}", tools=tools)  # applied in name order


def _text(rng: random.Random, prefix: str, i: int) -> SkillText:
    return SkillText(
        name=f"{prefix}-{i}",
        description=rng.choice(TEXTS)[:40],
        body="\n".join(rng.sample(["go: north", "look", "convert: miles, meters, 5.2", "  take coin  "], 2)),
    )


def random_policy(rng: random.Random) -> Policy:
    skills = [_text(rng, "skill", i) for i in range(rng.randint(0, 3))]
    rng.shuffle(skills)  # listed in any order: shown in name order
    return Policy(
        model="base",
        adapter=rng.choice([None, "adapter-0123456789ab"]),
        skills=tuple(skills),
        exemplars=tuple(_text(rng, "demo", i) for i in range(rng.randint(0, 3))),
        rules=tuple(_rule(rng, i) for i in range(rng.randint(0, 3))),
        constraints=tuple(_constraint(rng, i) for i in range(rng.randint(0, 2))),
    )


def _call(name: str, args: dict[str, Any], i: int) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def random_body(rng: random.Random) -> dict[str, Any]:
    messages: list[Any] = []
    if rng.random() < 0.7:
        role = rng.choice(["system", "system", "developer"])
        content: Any = "Be brief."
        if rng.random() < 0.3:
            content = [
                {"type": "text", "text": "Be brief."},
                {"type": "image_url", "image_url": {"url": "x"}},
            ]
        messages.append({"role": role, "content": content})
    observation = rng.choice(TEXTS)
    messages.append({"role": "user", "content": observation})
    for turn in range(rng.randint(0, 3)):
        name, args = rng.choice(
            [
                ("go", {"where": rng.choice(["north", "south"])}),
                ("macro", {"first": "north", "second": "east"}),
            ]
            + [("convert", {"value": 5.2, "from_unit": "miles", "to_unit": "meters"}), ("look", {})]
        )
        call = _call(name, args, turn)
        if rng.random() < 0.1:
            call["function"]["arguments"] = "{not json"
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        result = observation if rng.random() < 0.5 else rng.choice(TEXTS)  # back where it was, or not
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    if rng.random() < 0.1:
        messages.insert(rng.randint(0, len(messages)), "junk")  # not an object: dropped, as ratchet drops it
    body: dict[str, Any] = {"model": "whatever", "messages": messages, "temperature": 0.7}
    r = rng.random()
    if r < 0.75:
        tools = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
        body["tools"] = [*tools, rng.choice([SEARCH, CUSTOM])] if rng.random() < 0.1 else tools
        body["tool_choice"] = "auto"
    elif r < 0.85:
        body["tools"] = []
    return body


def export_of(policy: Policy, directory: Path, vectors: dict[str, list[float]] | None = None) -> ModuleType:
    """The export files apply.py reads for `policy` (prompt.json's embeddings: `vectors`, else
    arbitrary), and the export's own apply.py loaded from its file."""
    if vectors is None:
        rng = random.Random(0)
        vectors = {
            s.content_hash: [rng.gauss(0, 1) for _ in range(4)] for s in (*policy.skills, *policy.exemplars)
        }
    directory.mkdir(parents=True, exist_ok=True)
    write_policy(
        policy, prompt_data(load_settings({"data_dir": directory / "data"}), policy, vectors), directory
    )
    manifest = {"format": FORMAT, "served_model": policy.served_model}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return load_module(directory / "apply.py")


def load_module(path: Path) -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"apply_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def endpoint_tried(messages: list[Any]) -> list[Any]:
    """The episode's tried actions as the intervention endpoint records them: each earlier
    call's request and reply (`endpoint/app.py:_earlier`), for a history-keeping agent."""
    from ratchet.endpoint.app import _earlier

    kept = [m for m in messages if isinstance(m, dict)]
    calls = [
        Call(
            request={"messages": kept[:i]}, sent={}, fired=[], menu=None, reply={"choices": [{"message": m}]}
        )
        for i, m in enumerate(kept)
        if m.get("role") == "assistant"
    ]
    return tried_before(_earlier(calls))


def test_apply_py_gives_ratchets_body_for_random_policies_and_bodies(tmp_path: Path) -> None:
    rng = random.Random(20261207)
    fired_any = changed_tools = 0
    for case in range(60):
        policy = random_policy(rng)
        module = export_of(policy, tmp_path / str(case))
        export = module.Export(tmp_path / str(case))
        for _ in range(12):
            body = random_body(rng)
            snapshot = json.dumps(body)
            ours = apply_request(policy, body, endpoint_tried(body["messages"]))
            sent, fired = export.apply_request(body)
            assert sent == ours.body, (case, body)
            assert fired == ours.fired
            assert json.dumps(body) == snapshot  # the agent's body is not changed
            fired_any += bool(fired)
            changed_tools += sent.get("tools") != body.get("tools")
    assert fired_any > 100 and changed_tools > 100  # the cases exercised rules and constraints


def test_the_tried_actions_are_read_from_the_history_as_the_endpoint_records_them() -> None:
    rng = random.Random(5)
    for _ in range(200):
        messages = random_body(rng)["messages"]
        kept = [m for m in messages if isinstance(m, dict)]
        ours = [(t.state, t.action) for t in endpoint_tried(messages)]
        assert export_apply.tried_in(kept) == ours
    # and the pieces agree with the endpoint's own readers
    reply = {"role": "assistant", "tool_calls": [_call("go", {"where": "North"}, 0)]}
    assert export_apply.first_call(reply) == ("go", {"where": "North"})
    text, call, _ = reply_call({"choices": [{"message": reply}]})
    assert call is not None and call.args == {"where": "North"}
    assert export_apply.latest_observation([{"role": "user", "content": "a"}]) == latest_observation(
        [{"role": "user", "content": "a"}]
    )


def test_a_no_repeat_rule_takes_off_what_the_history_already_did_from_the_same_state(tmp_path: Path) -> None:
    policy = Policy(model="m", rules=(RuleSpec(name="no-repeat", no_repeat=True),))
    export = export_of(policy, tmp_path).Export(tmp_path)
    hall = "You are in the hall."
    messages = [
        {"role": "user", "content": hall},
        {"role": "assistant", "tool_calls": [_call("go", {"where": "north"}, 0)]},
        {"role": "tool", "tool_call_id": "call_0", "content": hall},  # a wall: back in the hall
    ]
    sent, fired = export.apply_request({"messages": messages, "tools": [GO]})
    assert fired == ["no-repeat"]
    assert sent["tools"][0]["function"]["parameters"]["properties"]["where"]["enum"] == [
        "south",
        "east",
        "west",
    ]


@pytest.fixture(scope="module")
def minilm_policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Policy]:
    """A data dir whose live index holds some of a policy's texts (the rest are embedded when
    exported, as the retriever embeds what its index lacks), with real MiniLM embeddings."""
    from ratchet.flows.runtime import live_retriever

    settings = load_settings({"data_dir": tmp_path_factory.mktemp("minilm") / "data", "skills.k": 2})
    demos = [
        SkillText(name=f"units-{i}", description=q, body=a)
        for i, (q, a) in enumerate(
            [
                ("How many meters are in 5.2 miles?", "convert: miles, meters, 5.2"),
                ("Convert 3 kilograms to pounds.", "convert: kilograms, pounds, 3"),
                ("What is 85 hours in seconds?", "convert: hours, seconds, 85"),
                ("Express 2 gallons in liters.", "convert: gallons, liters, 2"),
                ("I have 9 inches. How much is that in centimeters?", "convert: inches, centimeters, 9"),
                ("Find the coin in the kitchen.", "go: north\ntake coin"),
            ]
        )
    ]
    skills = [
        SkillText(name="copy-units", description="units are words of the question", body="Copy them."),
        SkillText(name="explore", description="look around rooms for coins", body="Open doors " * 60),
        SkillText(name="time", description="hours, minutes and seconds", body="3600 seconds an hour."),
    ]
    live_retriever(settings).sync([*skills[:2], *demos[::2]])  # some stored, some not
    return settings, Policy(model="m", skills=tuple(skills), exemplars=tuple(demos))


@pytest.mark.parametrize(
    "query",
    [
        "How many feet are in 12 meters?",
        "What is 3 days in hours?",
        "Find the key in the hall.",
        "Convert 7 liters to gallons.",
        "",
    ],
)
def test_the_per_task_choice_is_the_live_retrievers(
    minilm_policy: tuple[Any, Policy], tmp_path: Path, query: str
) -> None:
    from ratchet.flows.runtime import live_retriever
    from ratchet.memory.vector_index import embed

    settings, policy = minilm_policy
    module = export_of(policy, tmp_path)  # arbitrary embeddings: replaced below
    prompt = prompt_data(settings, policy)  # the live index's embeddings, or computed as it would
    (tmp_path / "prompt.json").write_text(json.dumps(prompt))
    export = module.Export(tmp_path)
    retriever, s = live_retriever(settings), settings.skills
    shown_skills = tuple(retriever.select(query, policy.skills, s.k, s.token_budget))
    shown_demos = tuple(retriever.select(query, policy.exemplars, s.exemplars, s.exemplar_budget))
    vector = [float(x) for x in embed([query])[0]]
    skills, demos = export.shown(vector)
    assert [d["name"] for d in demos] == [d.name for d in shown_demos]
    assert [x["name"] for x in skills] == [x.name for x in shown_skills]
    body = {"messages": [{"role": "system", "content": "You convert."}, {"role": "user", "content": query}]}
    ours = apply_request(for_task(policy, shown_skills, shown_demos), body)
    assert export.apply(body, vector) == ours.body
    if query:  # the proxy's query: the first user message
        assert export_apply.task_query(body) == query


def test_the_budget_skips_a_text_that_does_not_fit_and_keeps_the_next() -> None:
    items = [
        {"id": "a", "name": "a", "tokens": 250, "embedding": [1.0, 0.0]},
        {"id": "b", "name": "b", "tokens": 100, "embedding": [0.9, 0.1]},
        {"id": "c", "name": "c", "tokens": 10, "embedding": [0.0, 1.0]},
    ]
    assert [i["name"] for i in export_apply.select([1.0, 0.0], items, 3, 300)] == ["a", "c"]
    assert [i["name"] for i in export_apply.select([1.0, 0.0], items, 2, 300)] == ["a"]
    assert export_apply.select([1.0, 0.0], items, 0, 300) == []
    with pytest.raises(ValueError, match="query vector"):
        export_apply.select([1.0, 0.0, 0.0], items, 2, 300)


def test_apply_py_imports_only_the_standard_library_and_runs_without_ratchet(tmp_path: Path) -> None:
    tree = ast.parse(Path(export_apply.__file__).read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    policy = random_policy(random.Random(3)).model_copy(
        update={
            "constraints": (
                ConstraintSpec(name="u", tools={"convert": {"from_unit": ArgConstraint(from_context=True)}}),
            )
        }
    )
    export_of(policy, tmp_path)
    body = {"messages": [{"role": "user", "content": TEXTS[0]}], "tools": [CONVERT]}
    (tmp_path / "body.json").write_text(json.dumps(body))
    # -I -S: no site-packages at all (no ratchet, no pydantic), no PYTHONPATH, not the working dir
    done = subprocess.run(
        [sys.executable, "-I", "-S", "apply.py", "apply", "body.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == apply_request(policy, body).body
    bad = subprocess.run(
        [sys.executable, "-I", "-S", "apply.py", "--export", str(tmp_path / "nowhere"), "apply", "body.json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        bad.returncode == 2
        and bad.stderr.startswith("error: cannot read")
        and len(bad.stderr.splitlines()) == 1
    )


# ------------------------------------------------------------------------------ the proxy


class Upstream:
    """A stand-in model server: records what reaches it, answers a completion (a stream when
    asked), lists models, and fails where a request asks it to."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                seen.append((self.command, self.path, dict(self.headers), None))
                self._send(200, "application/json", b'{"data": [{"id": "m"}]}')

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append((self.command, self.path, dict(self.headers), body))
                if body.get("user") == "fail":
                    return self._send(500, "application/json", b'{"error": {"message": "boom"}}')
                if body.get("stream"):
                    chunks = b"".join(f"data: {json.dumps({'n': i})}\n\n".encode() for i in range(3))
                    return self._send(200, "text/event-stream", chunks + b"data: [DONE]\n\n")
                self._send(
                    200,
                    "application/json",
                    json.dumps({"choices": [{"message": {"content": "ok"}}]}).encode(),
                )

            def _send(self, status: int, kind: str, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        import threading

        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.fixture
def proxied(tmp_path: Path) -> Any:
    import httpx

    policy = Policy(
        model="base",
        adapter="adapter-0123456789ab",
        exemplars=(_text(random.Random(1), "demo", 0), _text(random.Random(2), "demo", 1)),
        constraints=(
            ConstraintSpec(name="u", tools={"convert": {"from_unit": ArgConstraint(from_context=True)}}),
        ),
    )
    module = export_of(policy, tmp_path, vectors=None)
    upstream = Upstream()
    proxy = module.serve(
        module.Export(tmp_path),
        upstream.url,
        port=0,
        embed=lambda text: [1.0, 0, 0, 0],
        overrides={"temperature": 0},
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{proxy.server_address[1]}/v1", timeout=30)
    yield policy, upstream, client
    client.close()
    proxy.shutdown()
    upstream.server.shutdown()


def test_the_proxy_applies_the_export_and_passes_the_rest_through(proxied: Any) -> None:
    policy, upstream, client = proxied
    body = {"model": "mine", "messages": [{"role": "user", "content": TEXTS[0]}], "tools": [CONVERT]}
    r = client.post(
        "/chat/completions", json=body, headers={"Authorization": "Bearer users-key", "Cookie": "x"}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    method, path, headers, sent = upstream.seen[-1]
    assert (method, path, headers["Authorization"]) == ("POST", "/v1/chat/completions", "Bearer users-key")
    assert "Cookie" not in headers  # only the key and the content type are passed on
    assert sent["model"] == "adapter-0123456789ab" and sent["temperature"] == 0
    assert "enum" in sent["tools"][0]["function"]["parameters"]["properties"]["from_unit"]
    assert sent["messages"][0]["content"].count("Task: ") == 2  # the per-task choice: both demos fit
    streamed = client.post("/chat/completions", json=body | {"stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.count("data: ") == 4 and streamed.text.endswith("data: [DONE]\n\n")
    models = client.get("/models")
    assert models.json() == {"data": [{"id": "m"}]} and upstream.seen[-1][:2] == ("GET", "/v1/models")
    failed = client.post("/chat/completions", json=body | {"user": "fail"})
    assert failed.status_code == 500 and failed.json() == {"error": {"message": "boom"}}  # as it answered


def test_the_proxy_refuses_bad_bodies_in_one_line_and_forwards_nothing(proxied: Any) -> None:
    import socket

    _, upstream, client = proxied
    before = len(upstream.seen)
    for content in (b"{not json", b"[1, 2]", b"", b"\xff\xfe"):
        r = client.post("/chat/completions", content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and len(r.json()["error"]["message"].splitlines()) == 1
    host, port = client.base_url.host, client.base_url.port
    with socket.create_connection((host, port), timeout=10) as s:  # a huge body, refused from its header
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.0 413")
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.0 400")
    assert len(upstream.seen) == before  # nothing went on
    upstream.server.shutdown()
    upstream.server.server_close()
    down = client.post("/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert down.status_code == 502 and "unreachable" in down.json()["error"]["message"]
