"""The intervention endpoint: an OpenAI-compatible API in front of the real model.

An agent's base URL names its rollout: `http://127.0.0.1:PORT/r/<key>/v1` (or the header
`X-Ratchet-Rollout: <key>` on `/v1`). Each chat completion of a rollout is recorded
(`endpoint/recording.py`) and forwarded, with the user's upstream API key, with the live policy
of the arm the rollout plays (`endpoint/apply.py`). Nothing without a key is forwarded, and
nothing from a web page: `endpoint/gate.py` refuses both before the body is read, and a key the
endpoint does not know (or a rollout already closed) with 404, so a late call never lands in
another rollout. `/v1/models` is answered here: the one model a rollout is served. The arm's
distilled tools are served over MCP at `/r/<key>/mcp` (`endpoint/tools.py`). Streaming: the
reply is produced whole and sent as one SSE chunk and a finish chunk, which OpenAI clients read
as a stream. Loopback only, like the model server behind it.

A body is JSON any JSON API can carry, or a one-line 400 before anything is recorded: Python's
parser takes NaN, Infinity and lone surrogates (`"\\ud800"`), which fail only later, when the
body is sent on or stored. A chat completion is an object whose `messages` is a list of
objects, and whose `tools`, if any, is a list of objects: what the recording can read.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ratchet.endpoint.apply import arm_request, latest_observation, reply_call
from ratchet.endpoint.gate import KEY_HEADER, KINDS, Gate
from ratchet.endpoint.limits import Limits, RateLimitedLog
from ratchet.endpoint.recording import Call, Recording, Rollouts
from ratchet.endpoint.tools import KnownKeys, mcp_app
from ratchet.errors import one_line
from ratchet.server.sse import sse_chunks
from ratchet.types import ToolCall


def _error(status: int, message: str, kind: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind or KINDS.get(status, "invalid_request_error")}}
    return JSONResponse(status_code=status, content=body)


class NotJSON(ValueError):
    """A body that is not JSON any JSON API can carry; the message says why, in one line."""


def _constant(name: str) -> Any:
    raise NotJSON(f"holds {name}, which JSON does not allow")


def encode(value: Any) -> bytes:
    """`value` as sent on: strict JSON in UTF-8 (ValueError on NaN or Infinity, UnicodeEncodeError
    on a lone surrogate)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def strict_json(raw: bytes) -> Any:
    """`raw` as JSON that can be sent on and stored, else `NotJSON`."""
    try:
        value = json.loads(raw, parse_constant=_constant)
    except NotJSON:
        raise
    except (ValueError, RecursionError) as exc:  # not JSON, bytes that are no text, nested past reason
        raise NotJSON(f"is not JSON: {type(exc).__name__}") from None
    try:
        encode(value)
    except UnicodeEncodeError:
        raise NotJSON(
            "holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is no text"
        ) from None
    return value


def shape_problem(body: Any) -> str | None:
    """Why the recording could not read a chat completion (None: it can)."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return "a chat completion needs 'messages', a list"
    for field in ("messages", "tools"):
        items = body.get(field)
        if items is None:
            continue
        if not isinstance(items, list):
            return f"'{field}' must be a list of objects"
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                return f"'{field}' entry {i} is not an object"
    return None


def create_app(
    rollouts: Rollouts,
    upstream: str,
    api_key: str,
    timeout_s: float,
    limits: Limits | None = None,
    log: RateLimitedLog | None = None,
) -> FastAPI:
    """The endpoint over `upstream` (an OpenAI-compatible base URL, …/v1), with each rollout's
    distilled tools over MCP at `/r/<key>/mcp` (`endpoint/tools.py`), behind `Gate`."""
    limits = limits or Limits()
    log = log or RateLimitedLog(logging.getLogger(__name__), limits.log_lines_per_minute)
    tools = mcp_app(rollouts)
    # no /docs, /redoc or /openapi.json: nothing but the model routes, /health and MCP
    app = FastAPI(
        title="ratchet intervention endpoint",
        lifespan=tools.lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(Gate, rollouts=rollouts, limits=limits, log=log)
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), headers=headers, timeout=timeout_s)
    app.state.client = client

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "open_rollouts": len(rollouts),
            "unattributed": rollouts.unattributed,
            "refused": rollouts.refused,
        }

    @app.get("/v1/models")
    @app.get("/r/{key}/v1/models")
    async def models(request: Request, key: str = "") -> Response:
        """The model a rollout is served (whatever `model` it sends), answered here: the
        upstream's own list is never asked for."""
        rec = rollouts.get(key or request.headers.get(KEY_HEADER, ""))
        if rec is None:
            return _error(404, "unknown or closed rollout key")
        served = {"id": rec.arm.policy.served_model, "object": "model", "created": 0, "owned_by": "ratchet"}
        return JSONResponse({"object": "list", "data": [served]})

    @app.post("/v1/chat/completions")
    async def chat_by_header(request: Request) -> Response:
        return await _chat(request, request.headers.get(KEY_HEADER, ""))

    @app.post("/r/{key}/v1/chat/completions")
    async def chat_keyed(key: str, request: Request) -> Response:
        return await _chat(request, key)

    async def _chat(request: Request, key: str) -> Response:
        rec = rollouts.get(key)  # the gate let only a known key through; it may have closed since
        if rec is None:
            rollouts.refused += 1
            return _error(404, "unknown or closed rollout key: a call made after its task ended")
        try:
            body = strict_json(await request.body())
        except NotJSON as exc:
            return _refused(rec, f"request body {exc}")
        problem = shape_problem(body)
        if problem is not None:
            return _refused(rec, problem)
        call = rec.begin(body)
        if call is None:
            if rec.budget_spent:
                return _error(
                    400, f"step budget spent: this rollout may make {rec.arm.max_steps} model calls"
                )
            rollouts.refused += 1
            return _error(404, "unknown or closed rollout key: a call made after its task ended")
        return await _recorded(rec, call, body)

    def _refused(rec: Recording, reason: str) -> Response:
        """A request the recording cannot take: 400, nothing recorded but the reason."""
        rec.refuse(reason)
        return _error(400, reason)

    async def _recorded(rec: Recording, call: Call, body: dict[str, Any]) -> Response:
        started = time.perf_counter()
        with rec.lock:
            index = rec.calls.index(call)
            earlier = _earlier(rec.calls[:index])
        try:
            call.sent, call.fired, call.menu = arm_request(body, rec.arm, index, earlier)
        except Exception as exc:  # noqa: BLE001 - a malformed tool or message is the caller's
            call.error = one_line(f"malformed request: {type(exc).__name__}: {exc}")[:500]
            return _error(400, call.error)
        try:
            return await _send(call.sent, bool(body.get("stream")), rec, call)
        finally:
            call.seconds = time.perf_counter() - started

    async def _send(sent: dict[str, Any], stream: bool, rec: Recording, call: Call) -> Response:
        """`sent` to the model, its answer to the agent; the reply, or why there is none, is
        recorded, and a failure of the model marks the rollout for a retry
        (`Recording.upstream_error`)."""

        def failed(status: int, error: str, transient: bool, content: bytes | None = None) -> Response:
            call.error = one_line(error)
            if transient:
                rec.upstream_error = call.error
            if content is not None:  # the model's own error, passed on as it answered
                return Response(content, status, media_type="application/json")
            return _error(status, call.error, "server_error")

        try:
            payload = encode(sent)
        except (ValueError, TypeError) as exc:  # the policy's own text: never the agent's (checked)
            return failed(500, f"the request as forwarded is not JSON: {type(exc).__name__}", False)
        try:
            got = await client.post("/chat/completions", content=payload)
        except httpx.HTTPError as exc:
            return failed(502, f"model endpoint unreachable: {type(exc).__name__}: {exc}", True)
        if got.status_code >= 400:
            error = f"model endpoint answered {got.status_code}: {got.text[:300]}"
            return failed(got.status_code, error, got.status_code >= 500, got.content)
        try:
            reply = strict_json(got.content)
        except NotJSON as exc:
            return failed(502, f"model endpoint answered what {exc}", True)
        if not isinstance(reply, dict):
            return failed(502, f"model endpoint answered {type(reply).__name__}, not a completion", True)
        if not stream:
            call.reply = reply
            return JSONResponse(reply)
        try:  # whole before the first byte: a reply a stream cannot carry is an error, not a cut stream
            chunks = [chunk async for chunk in sse_chunks(_streamable(reply, sent.get("model")))]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            error = f"model endpoint answered a completion a stream cannot carry: {type(exc).__name__} {exc}"
            return failed(502, error, False)
        call.reply = reply
        return StreamingResponse(iter(chunks), media_type="text/event-stream")

    app.mount("/", KnownKeys(tools, rollouts))  # last: every route above is matched first
    return app


def _streamable(reply: dict[str, Any], model: Any) -> dict[str, Any]:
    """`reply` with what a stream's chunks repeat filled in where the model left it out (its id,
    time, model, usage, finish reason); without a first choice's message it cannot be streamed."""
    choice = reply["choices"][0]
    first = {"finish_reason": "stop"} | choice | {"message": choice["message"]}
    defaults = {"id": "chatcmpl-ratchet", "created": 0, "model": model, "usage": None}
    return defaults | reply | {"choices": [first]}


def _earlier(calls: list[Call]) -> list[tuple[str, ToolCall]]:
    """(observation, call) of each earlier call that called a tool, for the `no_repeat` rule."""
    out = []
    for c in calls:
        _, tool_call, _ = reply_call(c.reply)
        if tool_call is not None:
            out.append((latest_observation(c.request.get("messages") or []), tool_call))
    return out
