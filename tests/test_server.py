"""The embedded model server against the real shipped model (integration)."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ratchet.errors import EndpointError, PortInUseError
from ratchet.server.__main__ import UNUSED_IMPORTS
from ratchet.server.launcher import EmbeddedServer, admin_headers, check_endpoint, reset_prefix_cache
from ratchet.toolcalls import to_chatml_messages, tool_call_schema

MODEL = "smollm2-135m-instruct"
ACT = {
    "type": "function",
    "function": {
        "name": "act",
        "description": "take one action",
        "parameters": {
            "type": "object",
            "properties": {"action": {"type": "string", "enum": ["open door", "take coin", "go north"]}},
            "required": ["action"],
        },
    },
}
USER = [{"role": "user", "content": "You are in a room with a door and a coin. What do you do?"}]


def chat(url: str, **body) -> dict:
    r = httpx.post(f"{url}/chat/completions", json={"model": MODEL, "messages": USER, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------- unit: request translation
def test_tool_schema_allows_exactly_the_offered_calls():
    schema = tool_call_schema([ACT], allow_text=False)
    assert schema["properties"]["name"] == {"const": "act"}
    assert schema["additionalProperties"] is False
    both = tool_call_schema([ACT, ACT], allow_text=True)
    assert len(both["anyOf"]) == 3 and both["anyOf"][-1]["required"] == ["content"]


def test_history_with_tool_calls_becomes_plain_turns():
    msgs = [
        {"role": "system", "content": "sys"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "1",
                    "type": "function",
                    "function": {"name": "act", "arguments": '{"action": "go north"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "You are north."},
    ]
    turns = to_chatml_messages(msgs, "TOOLS")
    assert turns[0] == {"role": "system", "content": "sys\n\nTOOLS"}
    assert json.loads(turns[1]["content"]) == {"name": "act", "arguments": {"action": "go north"}}
    assert turns[2] == {"role": "user", "content": "Result: You are north."}


def test_unreachable_endpoint_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EndpointError, match="unreachable"):
        check_endpoint(f"http://127.0.0.1:{port}/v1", timeout=2)


# ---------------------------------------------------------------- integration: real model


@pytest.mark.integration
def test_health_and_models(embedded_server):
    health = httpx.get(embedded_server.removesuffix("/v1") + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL
    assert check_endpoint(embedded_server) == [MODEL]


@pytest.mark.integration
def test_health_says_how_much_of_the_key_value_pool_is_held(embedded_server):
    """After a request its prompt stays cached: the pool says so, within its size."""
    kitchen = [{"role": "user", "content": "Describe the kitchen. " * 20}]
    chat(embedded_server, temperature=0, max_tokens=2, messages=kitchen)
    health = httpx.get(embedded_server.removesuffix("/v1") + "/health").json()
    assert 380 <= health["kv_pool_mb"] and 1 <= health["kv_in_use_mb"] <= health["kv_pool_mb"]
    assert health["prefix_cache_evictions"] >= 0


@pytest.mark.integration
def test_a_reset_prefix_cache_prefills_a_cached_prompt_again(embedded_server):
    """The same prompt twice is prefilled once; after `POST /reset_prefix_cache` it is
    prefilled in full again."""
    root = embedded_server.removesuffix("/v1")
    pantry = [{"role": "user", "content": "List what is in the pantry. " * 12}]

    def prefilled_by_one_request() -> tuple[int, int]:
        before = httpx.get(root + "/health").json()
        chat(embedded_server, temperature=0, max_tokens=4, messages=pantry)
        after = httpx.get(root + "/health").json()
        new = after["prefilled_tokens"] - before["prefilled_tokens"]
        return new, after["prompt_tokens"] - before["prompt_tokens"]

    prefilled_by_one_request()
    cached, prompt = prefilled_by_one_request()
    assert cached < prompt // 4  # the whole prompt but its last tokens came from the cache
    # the route itself, as a client calls it: JSON, with the token of the server's start
    r = httpx.post(root + "/reset_prefix_cache", json={}, headers=admin_headers(embedded_server))
    assert r.status_code == 200
    assert prefilled_by_one_request() == (prompt, prompt)


def _server_pid(url: str) -> int:
    """The pid of the `python -m ratchet.server` process listening on `url`'s port."""
    from ratchet.server.memory import server_pids

    port = str(httpx.URL(url).port)
    pids = server_pids("--port", port)
    assert len(pids) == 1, f"ratchet.server processes serving port {port}: {pids}"
    return pids[0]


@pytest.mark.integration
def test_the_server_maps_no_library_of_a_package_it_never_calls(embedded_server):
    """triton and scipy are installed (xgrammar and others ask for them) but the CPU server
    never calls them; if anything loads them again, their libraries show in its memory map,
    ~140 MB of resident memory."""
    chat(embedded_server, temperature=0, max_tokens=2)  # a forward and a reply have run
    maps = Path(f"/proc/{_server_pid(embedded_server)}/maps").read_text()
    assert "/site-packages/torch/" in maps  # the reading is of the right process
    for name in UNUSED_IMPORTS:
        assert f"/site-packages/{name}/" not in maps, name


@pytest.mark.integration
def test_the_launcher_starts_the_configured_number_format(embedded_server, base_model_dir, tmp_path):
    """`model.dtype`, `model.kv_cache_mb` and `model.kv_dtype` reach the server process: a
    second server in the format the session's server does not use, with a small key-value pool
    in a format of its own and a flag of its own, says so in `/health`, and answers. Shape
    buckets and the pool's format follow the model's format unless set."""
    session = httpx.get(embedded_server.removesuffix("/v1") + "/health").json()
    assert session["shape_buckets"] == (4 if session["dtype"] == "bfloat16" else 0)
    assert session["kv_dtype"] == ("bfloat16" if session["dtype"] == "bfloat16" else "float16")
    other = "float32" if session["dtype"] == "bfloat16" else "bfloat16"
    server = EmbeddedServer(
        base_model_dir.parent,
        tmp_path,
        dtype=other,
        kv_cache_mb=64,
        kv_dtype="float32",
        server_args=("--shape-buckets", "2"),
    )
    with server as url:
        health = httpx.get(url.removesuffix("/v1") + "/health").json()
        assert health["dtype"] == other and 60 <= health["kv_pool_mb"] <= 64
        assert health["kv_dtype"] == "float32" and health["shape_buckets"] == 2
        reply = chat(url, temperature=0, max_tokens=4)["choices"][0]["message"]["content"]
        assert reply.strip()


@pytest.mark.integration
def test_required_tool_choice_always_gives_a_valid_action(embedded_server):
    for seed in range(4):
        body = chat(
            embedded_server, tools=[ACT], tool_choice="required", temperature=1.2, seed=seed, max_tokens=40
        )
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        call = choice["message"]["tool_calls"][0]
        assert call["function"]["name"] == "act" and call["id"].startswith("call_")
        assert (
            json.loads(call["function"]["arguments"])["action"]
            in ACT["function"]["parameters"]["properties"]["action"]["enum"]
        )
        assert body["usage"]["completion_tokens"] > 0 and body["usage"]["prompt_tokens"] > 20


@pytest.mark.integration
def test_seeded_sampling_is_reproducible(embedded_server):
    """The same seed gives the same reply when the request is computed the same way. Whether
    the prompt is already in the prefix cache changes how (see the engine's docstring), and
    that depends on what the session's server answered before, so the first request puts it
    there: the two compared are then both cache hits, and another seed must differ."""

    def sample(seed: int) -> str:
        body = chat(embedded_server, temperature=1.0, seed=seed, max_tokens=24)
        return body["choices"][0]["message"]["content"]

    sample(42)
    a, b = sample(42), sample(42)
    assert a == b and a
    assert sample(7) != a


@pytest.mark.integration
def test_json_schema_response_format(embedded_server):
    schema = {
        "type": "object",
        "properties": {"count": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["count", "ok"],
        "additionalProperties": False,
    }
    body = chat(
        embedded_server,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        max_tokens=40,
        temperature=0,
    )
    value = json.loads(body["choices"][0]["message"]["content"])
    assert set(value) == {"count", "ok"} and isinstance(value["count"], int)


@pytest.mark.integration
def test_concurrent_requests_are_served_in_batches(embedded_server):
    health_url = embedded_server.removesuffix("/v1") + "/health"
    before = httpx.get(health_url).json()
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda s: chat(embedded_server, temperature=0.9, seed=s, max_tokens=48), range(6)))
    after = httpx.get(health_url).json()
    assert after["requests"] - before["requests"] == 6
    assert after["forward_steps"] - before["forward_steps"] < 6 * 48  # requests shared decode steps
    assert after["largest_batch"] >= 2


@pytest.mark.integration
def test_langchain_chat_openai_gets_tool_calls(embedded_server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=embedded_server, api_key="x", max_tokens=40, temperature=0)
    msg = llm.bind_tools([ACT], tool_choice="required").invoke("There is a coin here.")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "act"
    streamed = llm.bind_tools([ACT], tool_choice="required").stream("There is a coin here.")
    chunks = list(streamed)
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.tool_calls and merged.tool_calls[0]["args"]["action"] == msg.tool_calls[0]["args"]["action"]


@pytest.mark.integration
def test_lora_adapter_loads_by_name_and_matches_peft_in_process(embedded_server, base_model_dir, tmp_path):
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    # the server's number format (`model.dtype`): the in-process reference runs in the same one
    served_dtype = getattr(torch, httpx.get(f"{embedded_server.removesuffix('/v1')}/health").json()["dtype"])
    adapter_dir = tmp_path / "adapter"
    get_peft_model(base, cfg).save_pretrained(adapter_dir)

    r = httpx.post(
        f"{embedded_server}/load_lora_adapter",
        json={"lora_name": "t1", "lora_path": str(adapter_dir)},
        headers=admin_headers(embedded_server),
    )
    assert r.status_code == 200, r.text
    try:
        ids = [m["id"] for m in httpx.get(f"{embedded_server}/models").json()["data"]]
        assert "t1" in ids
        served = httpx.post(
            f"{embedded_server}/chat/completions",
            timeout=120,
            json={"model": "t1", "messages": USER, "temperature": 0, "max_tokens": 12},
        ).json()
        text = served["choices"][0]["message"]["content"]
        base_text = chat(embedded_server, temperature=0, max_tokens=12)["choices"][0]["message"]["content"]
        assert text != base_text  # the adapter changes what the model says

        tok = AutoTokenizer.from_pretrained(base_model_dir)
        fresh = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=served_dtype)
        model = PeftModel.from_pretrained(fresh, adapter_dir).eval()
        prompt = tok.apply_chat_template(
            USER, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
        expected = tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
        assert text == expected
    finally:
        httpx.post(
            f"{embedded_server}/unload_lora_adapter",
            json={"lora_name": "t1"},
            headers=admin_headers(embedded_server),
        )
    gone = httpx.post(f"{embedded_server}/chat/completions", json={"model": "t1", "messages": USER})
    assert gone.status_code == 404
    # with its last adapter gone, the base model serves as before
    assert (
        chat(embedded_server, temperature=0, max_tokens=12)["choices"][0]["message"]["content"] == base_text
    )


@pytest.mark.integration
def test_bad_requests_get_clear_errors(embedded_server, tmp_path):
    r = httpx.post(f"{embedded_server}/chat/completions", json={"model": "gpt-9", "messages": USER})
    assert r.status_code == 404 and "gpt-9" in r.json()["error"]["message"]
    r = httpx.post(f"{embedded_server}/chat/completions", json={"model": MODEL, "messages": USER, "top_p": 0})
    assert r.status_code == 422  # validated before it can reach (and fail) a shared batch
    r = httpx.post(
        f"{embedded_server}/chat/completions",
        json={"model": MODEL, "messages": USER, "tools": [{"type": "function", "function": {}}]},
    )
    assert r.status_code == 400 and "malformed" in r.json()["error"]["message"]
    auth = admin_headers(embedded_server)
    r = httpx.post(
        f"{embedded_server}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"}, headers=auth
    )
    assert r.status_code == 400 and "inside the server's data dir" in r.json()["error"]["message"]
    nope = tmp_path / "nope"  # inside the data dir (the session's temporary tree), but no adapter
    r = httpx.post(
        f"{embedded_server}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(nope)}, headers=auth
    )
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]


@pytest.mark.integration
def test_port_in_use_is_refused_before_starting(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"port {port}"):
            EmbeddedServer(Path(tmp_path), Path(tmp_path), port=port).start()


def test_a_port_whose_last_server_just_stopped_is_free(tmp_path):
    """Connections the server closed stay in TIME_WAIT for a minute; uvicorn binds the port
    anyway, so restarting on a fixed port right after a run must not be refused."""
    from ratchet.server.launcher import check_port_free

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()  # the server's side closes first: it is the side left in TIME_WAIT
        client.recv(1)
        client.close()
    check_port_free("127.0.0.1", port)  # no listener, only a closed connection's TIME_WAIT
    with socket.socket() as again:  # and a listener on it is still refused
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
        again.listen()
        with pytest.raises(PortInUseError, match=f"port {port}"):
            check_port_free("127.0.0.1", port)


@pytest.mark.integration
def test_a_corrupt_adapter_is_refused_and_changes_nothing(embedded_server, tmp_path):
    reset_prefix_cache(embedded_server)  # both replies prefill in full
    before = chat(embedded_server, temperature=0, max_tokens=12)["choices"][0]["message"]["content"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 4,
                "lora_alpha": 8,
                "target_modules": ["q_proj"],
                "task_type": "CAUSAL_LM",
            }
        )
    )
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    r = httpx.post(
        f"{embedded_server}/load_lora_adapter",
        json={"lora_name": "bad", "lora_path": str(bad)},
        headers=admin_headers(embedded_server),
    )
    assert r.status_code == 400 and "cannot load adapter" in r.json()["error"]["message"]
    assert "bad" not in [m["id"] for m in httpx.get(f"{embedded_server}/models").json()["data"]]
    reset_prefix_cache(embedded_server)
    after = chat(embedded_server, temperature=0, max_tokens=12)["choices"][0]["message"]["content"]
    assert after == before
