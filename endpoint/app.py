"""The intervention endpoint: an OpenAI-compatible API in front of the real model.

An agent's base URL names its rollout: `http://127.0.0.1:PORT/r/<key>/v1` (or the header
`X-Ratchet-Rollout: <key>` on `/v1`). Each chat completion of a rollout is recorded
(`endpoint/recording.py`) and forwarded with the live policy of the arm the rollout plays
(`endpoint/apply.py`). A request without a key is forwarded unchanged and counted as
unattributed; a key the endpoint does not know (or a rollout already closed) is refused
with 404, so a late call never lands in another rollout. The arm's distilled tools are served
over MCP at `/r/<key>/mcp` (`endpoint/tools.py`). Streaming: the reply is produced
whole and sent as one SSE chunk and a finish chunk, which OpenAI clients read as a stream.
Loopback only, like the model server behind it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ratchet.endpoint.apply import apply_policy, latest_observation, reply_call
from ratchet.endpoint.recording import Call, Recording, Rollouts
from ratchet.endpoint.tools import KnownKeys, mcp_app
from ratchet.server.sse import sse_chunks
from ratchet.types import ToolCall

log = logging.getLogger(__name__)

KEY_HEADER = "x-ratchet-rollout"
MAX_BODY = 16 * 1024 * 1024  # a request larger than this is refused, not read into memory


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind}})


def create_app(rollouts: Rollouts, upstream: str, api_key: str, timeout_s: float) -> FastAPI:
    """The endpoint over `upstream` (an OpenAI-compatible base URL, …/v1), with each rollout's
    distilled tools over MCP at `/r/<key>/mcp` (`endpoint/tools.py`)."""
    tools = mcp_app(rollouts)
    app = FastAPI(title="ratchet intervention endpoint", lifespan=tools.lifespan)
    headers = {"Authorization": f"Bearer {api_key}"}
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
    async def models(key: str = "") -> Response:
        got = await client.get("/models")
        return Response(got.content, got.status_code, media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_unkeyed(request: Request) -> Response:
        return await _chat(request, request.headers.get(KEY_HEADER, ""))

    @app.post("/r/{key}/v1/chat/completions")
    async def chat_keyed(key: str, request: Request) -> Response:
        return await _chat(request, key)

    async def _chat(request: Request, key: str) -> Response:
        declared = request.headers.get("content-length", "0")
        if not declared.isdigit() or int(declared) > MAX_BODY:  # refused before it is read
            return _error(413, f"request body over {MAX_BODY} bytes (or a malformed length)")
        raw = await request.body()
        if len(raw) > MAX_BODY:  # a chunked body declares no length
            return _error(413, f"request body over {MAX_BODY} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # not JSON, bytes that are no text, nested past reason
            return _error(400, f"request body is not JSON: {type(exc).__name__}")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(400, "a chat completion needs 'messages', a list")
        if not key:
            rollouts.unattributed += 1
            log.warning("unattributed model call (no rollout key): forwarded unchanged, not recorded")
            return await _forward(body, stream=bool(body.get("stream")))
        rec = rollouts.get(key)
        call = rec.begin(body) if rec is not None else None
        if call is None:
            if rec is not None and rec.budget_spent:
                return _error(
                    400, f"step budget spent: this rollout may make {rec.arm.max_steps} model calls"
                )
            rollouts.refused += 1
            return _error(
                404, "unknown or closed rollout key: a call made after its task ended", "not_found_error"
            )
        assert rec is not None  # a call is begun only on an open rollout
        return await _recorded(rec, call, body)

    async def _recorded(rec: Recording, call: Call, body: dict[str, Any]) -> Response:
        started = time.perf_counter()
        with rec.lock:
            index = rec.calls.index(call)
            earlier = _earlier(rec.calls[:index])
        try:
            call.sent, call.fired, call.menu = apply_policy(body, rec.arm, index, earlier)
        except Exception as exc:  # noqa: BLE001 - a malformed tool or message is the caller's
            call.error = f"malformed request: {type(exc).__name__}: {exc}"
            return _error(400, call.error)
        try:
            return await _send(call.sent, bool(body.get("stream")), rec, call)
        finally:
            call.seconds = time.perf_counter() - started

    async def _forward(body: dict[str, Any], stream: bool) -> Response:
        sent = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        return await _send(sent, stream)

    async def _send(
        sent: dict[str, Any], stream: bool, rec: Recording | None = None, call: Call | None = None
    ) -> Response:
        """`sent` to the model, its answer to the agent. With a rollout's `call`, the reply (or
        why there is none) is recorded, and a failure of the model marks the rollout for a
        retry (`Recording.upstream_error`); an unrecorded reply is parsed only to stream it."""

        def failed(status: int, error: str, transient: bool, content: bytes | None = None) -> Response:
            if call is not None and rec is not None:
                call.error = error
                if transient:
                    rec.upstream_error = error
            if content is not None:  # the model's own error, passed on as it answered
                return Response(content, status, media_type="application/json")
            return _error(status, error, "server_error")

        try:
            got = await client.post("/chat/completions", json=sent)
        except httpx.HTTPError as exc:
            return failed(502, f"model endpoint unreachable: {type(exc).__name__}: {exc}", True)
        if got.status_code >= 400:
            error = f"model endpoint answered {got.status_code}: {got.text[:300]}"
            return failed(got.status_code, error, got.status_code >= 500, got.content)
        if call is None and not stream:
            return Response(got.content, got.status_code, media_type="application/json")
        try:
            reply = got.json()
        except ValueError:
            return failed(502, f"model endpoint answered what is not JSON: {got.text[:200]!r}", True)
        if call is not None:
            call.reply = reply
        if stream:
            return StreamingResponse(sse_chunks(reply), media_type="text/event-stream")
        return JSONResponse(reply)

    app.mount("/", KnownKeys(tools, rollouts))  # last: every route above is matched first
    return app


def _earlier(calls: list[Call]) -> list[tuple[str, ToolCall]]:
    """(observation, call) of each earlier call that called a tool, for the `no_repeat` rule."""
    out = []
    for c in calls:
        _, tool_call, _ = reply_call(c.reply)
        if tool_call is not None:
            out.append((latest_observation(c.request.get("messages") or []), tool_call))
    return out
