"""OpenAI-compatible HTTP API over the Engine: the embedded default model server.

Why not `transformers serve`: measured on this stack it ignores
`response_format` and `tool_choice` and emits no `tool_calls` for this model, and the
135M model emits almost no valid actions unconstrained. So this server renders tools into
the prompt itself and constrains the output with xgrammar:

* `tools` + `tool_choice` "required" or a named function: the reply is forced to be
  `{"name": <tool>, "arguments": <that tool's JSON schema>}` and returned as `tool_calls`;
* `tools` + "auto" (the default): forced to be either such a call or `{"content": "..."}`;
* `response_format` `json_schema` / `json_object`: forced to match;
* otherwise free text.

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/chat/completions`,
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's request shape:
`{"lora_name": ..., "lora_path": ...}`; afterwards the adapter is addressed as `model`),
`POST /reset_prefix_cache`.

Only loopback binding is supported. A web page reaches a loopback server through the
user's browser, so every route answers only loopback Host names, no foreign Origin and
only JSON bodies (`ratchet.http_guard`: DNS rebinding, cross-site posts). Every change but a
chat completion (all but `OPEN`: which adapter serves under which name, the cache) needs the
token of this start (`AdminToken`): `server.launcher` makes one per start and hands it over
in the environment, never in argv, which every local user can read. An adapter is loaded
only from inside the data dir the server was started for, after resolving every link, and
`/v1/models` names adapters, never their paths.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from ratchet.http_guard import SAFE_METHODS, LoopbackOnly, headers_of, matches, presented, refuse
from ratchet.server.engine import AdapterError, Engine, GenRequest, GenResult
from ratchet.server.memory import resident_mb
from ratchet.server.sse import sse_chunks
from ratchet.toolcalls import read_cut_text, read_reply, render_tools, to_chatml_messages, tool_call_schema


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    n: int = 1
    stream: bool = False
    ignore_eos: bool = False  # vLLM extension: keep generating past end-of-sequence (benchmarks)


class LoraRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = ""


# the only change any local client may make without the token: asking the model
OPEN = frozenset({"/v1/chat/completions"})
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind}})


class AdminToken:
    """ASGI middleware: any request but a read or a chat completion must carry `token` in
    `Authorization: Bearer` (401 without, 403 with a wrong one), checked before its body is
    read. No token (None): every such request is refused."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS and scope["path"] not in OPEN:
            candidate = presented(headers_of(scope))
            if candidate is None:
                await refuse(scope, receive, send, 401, NO_TOKEN, www_authenticate="Bearer")
                return
            if self.token is None or not matches(self.token, candidate):
                await refuse(scope, receive, send, 403, WRONG_TOKEN)
                return
        await self.app(scope, receive, send)


NO_TOKEN = "refused: this route needs the server's admin token (Authorization: Bearer)"
WRONG_TOKEN = "refused: that is not this server's admin token"


def adapter_problem(path: str, data_dir: Path | None) -> str | None:
    """Why the adapter at `path` may not be loaded, or None: it must lie inside `data_dir`
    once every link is resolved, and so must each file of it the loader reads (a link inside
    the data dir pointing out is refused too)."""
    if data_dir is None:
        return "this server loads no adapters (started without a data dir)"
    if not path or not Path(path).is_absolute():
        return "lora_path must be an absolute path"
    root = data_dir.resolve()
    try:
        where = Path(path).resolve()
        resolved = [where, *((where / name).resolve() for name in ADAPTER_FILES)]
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a link loop
        return "lora_path cannot be resolved"
    if any(p != root and root not in p.parents for p in resolved):
        return "adapters are loaded only from inside the server's data dir (after resolving links)"
    return None


def create_app(
    engine: Engine, model_name: str, token: str | None = None, data_dir: Path | None = None
) -> FastAPI:
    """The server's app. `token`: the admin routes' (None: they refuse every request);
    `data_dir`: the only place adapters are loaded from (None: nowhere)."""
    # no /docs, /redoc, /openapi.json: Swagger's page loads its script from a CDN
    app = FastAPI(title="ratchet embedded model server", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(AdminToken, token=token)
    app.add_middleware(LoopbackOnly, every_method=True)  # outermost: before the token
    started = int(time.time())

    @lru_cache(maxsize=256)
    def compiled(schema_json: str | None) -> Any:
        return engine.compile_any_json() if schema_json is None else engine.compile_json_schema(schema_json)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": model_name,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "adapters": sorted(engine.adapters),
            **engine.stats,
            **resident_mb(),
            # the key-value pool (`server.kv_pool`): its size and what running requests or the
            # prefix cache hold of it (read beside the worker: a moment's figure)
            "kv_dtype": str(engine.kv_dtype).removeprefix("torch."),  # what the pool stores
            "kv_pool_mb": engine.pool.capacity * engine.pool.slot_bytes >> 20,
            "kv_in_use_mb": engine.pool.in_use() * engine.pool.slot_bytes >> 20,
            "prefix_cache_evictions": engine.prefix_cache.evictions,
            "shape_buckets": engine.shape_buckets,  # prefill widths per power of two; 0: exact
        }

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        """The base model and each adapter by name; vLLM's `root` (the adapter's path on disk)
        is left out: no client needs it, and it would map the data dir for any reader."""
        data = [{"id": model_name, "object": "model", "created": started, "owned_by": "ratchet"}]
        data += [
            {"id": a, "object": "model", "created": started, "owned_by": "ratchet", "parent": model_name}
            for a in sorted(engine.adapters)
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    def load_lora(req: LoraRequest) -> Any:
        if req.lora_name == model_name:
            return _error(400, f"adapter name {req.lora_name!r} is the base model's name")
        problem = adapter_problem(req.lora_path, data_dir)
        if problem is not None:
            return _error(400, f"cannot load adapter {req.lora_name!r}: {problem}")
        try:
            engine.load_adapter(req.lora_name, str(Path(req.lora_path).resolve()))  # the path checked
        except AdapterError as exc:
            return _error(400, str(exc))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    def unload_lora(req: LoraRequest) -> Any:
        try:
            engine.unload_adapter(req.lora_name)
        except AdapterError as exc:
            return _error(404, str(exc), "not_found_error")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache() -> Any:  # vLLM's route: reproducible replies need the same cache state
        engine.reset_prefix_cache()
        return PlainTextResponse("Success: prefix cache reset.")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
        try:
            return await _chat(req)
        except (KeyError, TypeError, ValueError) as exc:  # a malformed tool or message
            return _error(400, f"malformed request: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - keep the OpenAI error shape for clients
            return _error(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")

    async def _chat(req: ChatRequest) -> Any:
        if req.model not in (model_name, *engine.adapters):
            return _error(
                404,
                f"model {req.model!r} not found (have {model_name!r} and adapters {sorted(engine.adapters)})",
                "not_found_error",
            )
        if req.n != 1:
            return _error(400, "only n=1 is supported")
        tools = req.tools or []
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        schema: dict[str, Any] | None = None
        want_json = False
        if tools and choice != "none":
            if isinstance(choice, dict):
                name = choice.get("function", {}).get("name")
                tools = [t for t in tools if t.get("function", t).get("name") == name]
                if not tools:
                    return _error(400, f"tool_choice names unknown function {name!r}")
            schema = tool_call_schema(tools, allow_text=(choice == "auto"))
        elif req.response_format:
            kind = req.response_format.get("type")
            if kind == "json_schema":
                schema = (req.response_format.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    return _error(400, "response_format.json_schema.schema must be an object")
            elif kind == "json_object":
                want_json = True
        tools_text = render_tools(tools) if tools and choice != "none" else None
        turns = to_chatml_messages(req.messages, tools_text)
        prompt_ids = engine.tokenizer.apply_chat_template(
            turns, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if hasattr(prompt_ids, "input_ids"):
            prompt_ids = prompt_ids["input_ids"]
        try:
            grammar = (
                compiled(json.dumps(schema, sort_keys=True))
                if schema is not None
                else (compiled(None) if want_json else None)
            )
        except Exception as exc:  # noqa: BLE001 - a schema xgrammar can't compile is the caller's error
            return _error(400, f"cannot compile JSON schema: {exc}")
        gen = GenRequest(
            prompt_ids=list(prompt_ids),
            max_tokens=req.max_completion_tokens or req.max_tokens or 256,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            grammar=grammar,
            adapter=None if req.model == model_name else req.model,
            ignore_eos=req.ignore_eos,
        )
        try:
            result = await asyncio.wrap_future(engine.submit(gen))
        except AdapterError as exc:
            return _error(404, str(exc), "not_found_error")
        body = completion_body(req.model, result, tool_mode=schema is not None and bool(tools))
        if req.stream:
            return StreamingResponse(sse_chunks(body), media_type="text/event-stream")
        return body

    return app


def completion_body(model: str, res: GenResult, tool_mode: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": res.text}
    finish = res.finish_reason
    reply = read_reply(res.text) if tool_mode and res.grammar_complete else None
    if isinstance(reply, tuple):
        name, arguments = reply
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": name,
                        "arguments": json.dumps(arguments),
                    },
                }
            ],
        }
        finish = "tool_calls"
    elif isinstance(reply, str):
        message["content"] = reply
    elif tool_mode and (cut := read_cut_text(res.text)) is not None:
        message["content"] = cut  # finish_reason stays "length": the caller knows it was cut
    completion = len(res.token_ids) + (1 if res.finish_reason == "stop" else 0)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": res.prompt_tokens + completion,
        },
    }
