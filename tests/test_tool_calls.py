"""Tool calls as JSON (`model.tool_calls = "json"`): the request a server without tool support
gets, the reply read back as a call, the probe that picks the mode, and (integration) that on
the real engine both modes play the same game call for call; against llama.cpp's own server
when the bench has built it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult

from ratchet.agents.model import JsonToolChatOpenAI, as_json_request, chat_model, read_tool_calls
from ratchet.config import load_settings
from ratchet.errors import ConfigError
from ratchet.flows.runtime import tool_call_mode
from ratchet.server.launcher import probe_tool_calls, reset_prefix_cache
from ratchet.toolcalls import render_tools, tool_call_schema

ACT = {
    "type": "function",
    "function": {
        "name": "act",
        "description": "Do one action.",
        "parameters": {
            "type": "object",
            "properties": {"action": {"type": "string", "enum": ["take coin", "move north"]}},
            "required": ["action"],
        },
    },
}
LOOK = {"type": "function", "function": {"name": "look", "description": "Look.", "parameters": {}}}


def _history() -> list:
    return [
        SystemMessage(content="You play a game."),
        HumanMessage(content="Task: find the coin."),
        AIMessage(content="", tool_calls=[{"name": "act", "args": {"action": "move north"}, "id": "c1"}]),
        ToolMessage(content="You are in the pantry.", tool_call_id="c1"),
    ]


def test_a_required_call_becomes_the_servers_own_prompt_and_schema() -> None:
    messages, kwargs, tools = as_json_request(
        _history(), {"tools": [ACT, LOOK], "tool_choice": "required", "seed": 3}
    )
    assert "tools" not in kwargs and "tool_choice" not in kwargs and kwargs["seed"] == 3
    schema = kwargs["response_format"]["json_schema"]["schema"]
    assert schema == tool_call_schema([ACT, LOOK], allow_text=False)  # a call, never text
    assert [type(m) for m in messages] == [SystemMessage, HumanMessage, AIMessage, HumanMessage]
    assert messages[0].content == "You play a game.\n\n" + render_tools([ACT, LOOK])
    assert json.loads(messages[2].content) == {"name": "act", "arguments": {"action": "move north"}}
    assert messages[3].content == "Result: You are in the pantry."  # what the embedded server shows
    assert tools == [ACT, LOOK]


def test_auto_allows_text_a_named_function_narrows_and_no_tools_passes_through() -> None:
    _, kwargs, _ = as_json_request(_history(), {"tools": [ACT, LOOK]})
    assert kwargs["response_format"]["json_schema"]["schema"] == tool_call_schema(
        [ACT, LOOK], allow_text=True
    )
    named = {"type": "function", "function": {"name": "look"}}
    _, kwargs, tools = as_json_request(_history(), {"tools": [ACT, LOOK], "tool_choice": named})
    assert tools == [LOOK] and kwargs["response_format"]["json_schema"]["schema"] == tool_call_schema(
        [LOOK], False
    )
    history = _history()
    same, kwargs, tools = as_json_request(history, {"temperature": 0})
    assert same is history and kwargs == {"temperature": 0} and tools == []


def _result(content: str) -> ChatResult:
    return ChatResult(generations=[ChatGeneration(message=AIMessage(content=content))])


def test_a_json_reply_reads_back_as_a_call_or_as_text() -> None:
    call = read_tool_calls(_result('{"name":"act","arguments":{"action":"take coin"}}')).generations[0]
    assert call.message.tool_calls[0]["name"] == "act"
    assert call.message.tool_calls[0]["args"] == {"action": "take coin"} and call.message.content == ""
    text = read_tool_calls(_result('{"content":"I give up"}')).generations[0]
    assert text.message.content == "I give up" and not text.message.tool_calls and text.text == "I give up"
    for raw in ['{"name": 3}', "[1]", "not json", '{"name":"act","arguments":"x"}']:  # cut off, wrong shape
        kept = read_tool_calls(_result(raw)).generations[0].message
        assert kept.content == raw and not kept.tool_calls


def test_the_mode_is_as_configured_and_the_embedded_server_is_never_probed(tmp_path: Path) -> None:
    s = load_settings({"data_dir": tmp_path})
    assert s.model.tool_calls == "auto"
    assert tool_call_mode(s, "http://127.0.0.1:9/v1") == "native"  # embedded: no request (port 9 is closed)
    forced = load_settings(
        {"data_dir": tmp_path, "model.endpoint": "http://127.0.0.1:9/v1", "model.tool_calls": "json"}
    )
    assert tool_call_mode(forced, "http://127.0.0.1:9/v1") == "json"
    assert isinstance(chat_model("http://x/v1", "m", tool_calls="json"), JsonToolChatOpenAI)
    assert not isinstance(chat_model("http://x/v1", "m"), JsonToolChatOpenAI)
    with pytest.raises(ConfigError, match="model.tool_calls"):
        load_settings({"data_dir": tmp_path, "model.tool_calls": "xml"})


@pytest.fixture
def plain_text_server() -> Iterator[tuple[str, list[dict]]]:
    """A real HTTP endpoint that answers every chat request in plain text, tools or not (what
    llama-server does for a model whose template has no tools); records the requests."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if self.path.endswith("/load_lora_adapter"):  # llama-server has no such route
                return self._send(404, {"error": {"message": "File Not Found"}})
            status = 503 if seen[-1]["model"] == "broken" else 200
            self._send(
                status, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "pong"}}]}
            )

        def do_GET(self) -> None:  # noqa: N802
            self._send(200, {"object": "list", "data": [{"id": "m"}]})

        def _send(self, status: int, doc: dict) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(doc).encode())

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    finally:
        server.shutdown()


def test_the_probe_finds_json_where_tools_are_ignored_and_fails_clearly(plain_text_server) -> None:
    from ratchet.errors import EndpointError

    url, seen = plain_text_server
    assert probe_tool_calls(url, "m-probe-1") == "json"
    assert seen[0]["tool_choice"] == "required" and seen[0]["tools"][0]["function"]["name"] == "ping"
    assert probe_tool_calls(url, "m-probe-1") == "json" and len(seen) == 1  # once per process and endpoint
    with pytest.raises(EndpointError, match="HTTP 503"):
        probe_tool_calls(url, "broken")
    with pytest.raises(EndpointError, match="did not answer"):
        probe_tool_calls("http://127.0.0.1:9/v1", "m-probe-2", timeout=5)


def test_an_endpoint_without_runtime_lora_says_how_to_serve_the_adapter(
    plain_text_server, tmp_path: Path
) -> None:
    from ratchet.errors import EndpointError
    from ratchet.server.launcher import ensure_adapter

    url, _ = plain_text_server
    with pytest.raises(EndpointError, match="cannot load LoRA adapters at run time") as err:
        ensure_adapter(url, "coin-v1", tmp_path)
    assert "convert_lora_to_gguf.py" in err.value.fix and "finetune.mode" in err.value.fix


# ------------------------------------------------------------------ the real engine


def _play(url: str, mode: str, tasks: int = 3) -> list[list[tuple[str, dict]]]:
    from ratchet.agents.actor import ActorSettings, build_actor
    from ratchet.agents.rollout import RolloutSlot, run_rollout
    from ratchet.server.weights import BASE_MODEL_NAME
    from ratchet.suites.registry import get_suite
    from ratchet.types import Policy

    suite = get_suite("textworld-express:coin")
    try:
        actor = build_actor(chat_model(url, BASE_MODEL_NAME, tool_calls=mode))  # type: ignore[arg-type]
        played = []
        for i, task in enumerate(suite.tasks("train", tasks)):
            t = run_rollout(
                actor, suite, RolloutSlot(mode, 0, task, i), Policy(model=BASE_MODEL_NAME), ActorSettings(8)
            )
            assert t.status == "finished"
            played.append(
                [(s.tool_call.name, s.tool_call.args) if s.tool_call else ("", {}) for s in t.steps]
            )
        return played
    finally:
        suite.close()


@pytest.mark.integration
def test_on_the_embedded_server_json_mode_plays_the_same_game_as_native(embedded_server: str) -> None:
    """Same prompt, same schema, greedy: the two modes must agree call for call. A difference in
    how history or tools are rendered client side would show up as a different move.

    Each game starts from an empty prefix cache: where a prompt is split between cached and new
    tokens changes the sums' order, and a near tie between two moves can then go either way."""
    assert probe_tool_calls(embedded_server, "smollm2-135m-instruct") == "native"
    reset_prefix_cache(embedded_server)
    native = _play(embedded_server, "native")
    assert all(name == "act" for game in native for name, _ in game)
    reset_prefix_cache(embedded_server)
    assert _play(embedded_server, "json") == native


LLAMA_SERVER = Path(__file__).resolve().parents[1] / ".ratchet" / "bench"


@pytest.mark.slow
def test_llama_cpp_server_plays_through_json_tool_calls(tmp_path: Path) -> None:
    """llama.cpp's own server (built by `python -m bench llama_cpp build`; skipped if not): the
    probe finds it ignores tools, and every step of a greedy game is still a valid call."""
    from bench.llama_cpp import SERVER_BIN, llama_server

    if not SERVER_BIN.exists():
        pytest.skip("llama-server not built: python -m bench llama_cpp build")
    with llama_server(parallel=2, log=tmp_path / "llama.log") as url:
        assert probe_tool_calls(url, "smollm2-135m-instruct") == "json"
        games = _play(url, "json")
    assert all(name == "act" and args.get("action") for game in games for name, args in game)


@pytest.mark.parametrize(
    ("text", "cut"),
    [
        ('{"content":"The weather in Pe', "The weather in Pe"),
        ('{"content": "a \\"quote\\" and a lone \\', 'a "quote" and a lone '),
        ('{"content":"done"', "done"),
        ('{"name":"act","arguments":{"action":"mo', None),  # a cut call is no text
        ('{"name":"act","arguments":{}', None),
        ("plain words", None),
    ],
)
def test_a_text_reply_cut_off_by_the_limit_is_read_as_its_text_so_far(text: str, cut: str | None) -> None:
    from ratchet.server.app import completion_body
    from ratchet.server.engine import GenResult
    from ratchet.toolcalls import read_cut_text

    assert read_cut_text(text) == cut
    body = completion_body("m", GenResult([1, 2], text, "length", 5, grammar_complete=False), tool_mode=True)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == (text if cut is None else cut)
    json_mode = read_tool_calls(ChatResult(generations=[ChatGeneration(message=AIMessage(content=text))]))
    assert json_mode.generations[0].message.content == (text if cut is None else cut)
