"""The gateway's OpenAI-compatible API over the live policy.

`POST /v1/chat/completions` (with tools, and with `stream: true` as server-sent events in
OpenAI's chunk format), `GET /v1/models`, `GET /health`, the champion's function tools over MCP
at `/mcp`, and `POST /admin/reload` (the token: read the live policy again now). Every request
passes `gateway/guard.py:Guard` first.

Each chat completion takes the live snapshot once (`gateway/snapshot.py`) and is forwarded
under it (`gateway/request.py`) to the upstream with the user's upstream key. The answer
names the snapshot's version: the `X-Ratchet-Policy` header, and `system_fingerprint` in the
body and in every streamed chunk; `X-Ratchet-Champion` says when nothing is promoted. A
completion's `Server-Timing` header splits its time into the upstream's and the gateway's own.

What goes wrong is one line in OpenAI's error shape, never a 500 of the gateway's own and
never a hung connection: a request the policy cannot be applied to is 400; the upstream's own
error is passed on with its status and body; an upstream that cannot be reached is 502, one
that does not answer within `model.timeout_s` 504. A stream cut after its first chunk ends with
an error event (`data: {"error": …}`), as OpenAI's streams do.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ratchet.endpoint.app import NotJSON, encode, strict_json
from ratchet.endpoint.gate import KINDS
from ratchet.endpoint.limits import Limits, RateLimitedLog
from ratchet.errors import one_line
from ratchet.gateway.guard import Guard
from ratchet.gateway.request import BadRequest, Chooser, forwarded, parse
from ratchet.gateway.snapshot import Live, Snapshot
from ratchet.gateway.tools import Versioned, mcp_app

CONNECT_TIMEOUT_S = 10.0


def error(status: int, message: str, snap: Snapshot | None = None, kind: str | None = None) -> JSONResponse:
    kind = kind or KINDS.get(status, "invalid_request_error")
    body = {"error": {"message": one_line(message), "type": kind}}
    return JSONResponse(status_code=status, content=body, headers=snap.headers() if snap else None)


def create_app(
    live: Live,
    chooser: Chooser,
    upstream: str,
    api_key: str,
    timeout_s: float,
    token: str,
    public: bool = False,
    limits: Limits | None = None,
    log: RateLimitedLog | None = None,
    reload: Callable[[], object] | None = None,
    status: Callable[[], dict[str, Any]] | None = None,
    sampling: dict[str, Any] | None = None,
) -> FastAPI:
    """The gateway over `upstream` (an OpenAI-compatible base URL, …/v1). `public`: bound beyond
    loopback (the token on every request); `reload`: what `/admin/reload` calls; `status`: more
    of `/health` (the watch's last error); `sampling`: set on every request over the agent's own
    (`--temperature`)."""
    limits = limits or Limits()
    log = log or RateLimitedLog(logging.getLogger("ratchet.gateway.http"), limits.log_lines_per_minute)
    tools = mcp_app(live, loopback=not public)
    app = FastAPI(
        title="ratchet gateway", lifespan=tools.lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.add_middleware(Guard, token=token, public=public, limits=limits, log=log)
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    timeout = httpx.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s))
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), headers=headers, timeout=timeout)
    app.state.client = client

    @app.get("/health")
    def health() -> Response:
        snap = live.current
        doc = {
            "status": "ok",
            "policy": snap.version,
            "champion": snap.champion,
            "served_model": snap.policy.served_model,
            "live_since": snap.since,
            "swaps": live.swaps,
            **(status() if status else {}),
        }
        return JSONResponse(doc, headers=snap.headers())

    @app.get("/v1/models")
    def models() -> Response:
        """The one model the gateway serves (any `model` a request names is served by it)."""
        snap = live.current
        served = {"id": snap.policy.served_model, "object": "model", "created": 0, "owned_by": "ratchet"}
        return JSONResponse({"object": "list", "data": [served]}, headers=snap.headers())

    @app.post("/admin/reload")
    async def reload_now() -> Response:
        before = live.current.version
        if reload is not None:
            try:
                await anyio.to_thread.run_sync(reload)
            except Exception as exc:  # noqa: BLE001 - the last good version keeps serving
                return error(409, f"the live policy could not be reloaded: {type(exc).__name__}: {exc}")
        snap = live.current
        return JSONResponse({"was": before, "policy": snap.version}, headers=snap.headers())

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        started = time.perf_counter()
        snap = live.current  # once: everything below is this version's
        try:
            body = parse(await request.body())
            sent = await anyio.to_thread.run_sync(forwarded, snap.policy, body, chooser) | (sampling or {})
            payload = encode(sent)
        except BadRequest as exc:
            return error(400, str(exc), snap)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a message or tool it cannot read
            return error(400, f"malformed request: {type(exc).__name__}: {exc}"[:500], snap)
        if sent.get("stream"):
            return await _stream(snap, payload)
        return await _complete(snap, payload, started)

    async def _complete(snap: Snapshot, payload: bytes, started: float) -> Response:
        asked = time.perf_counter()
        try:
            got = await client.post("/chat/completions", content=payload)
        except httpx.HTTPError as exc:
            return _unreachable(exc, snap)
        upstream_s = time.perf_counter() - asked
        if got.status_code >= 400:
            return _passed_on(got.status_code, got.content, got.headers, snap)
        try:
            reply = strict_json(got.content)
        except NotJSON as exc:
            return error(502, f"the model endpoint answered what {exc}", snap, "server_error")
        if not isinstance(reply, dict):
            return error(502, "the model endpoint answered no completion object", snap, "server_error")
        reply["system_fingerprint"] = snap.version
        answer = JSONResponse(reply, headers=snap.headers())
        own_s = time.perf_counter() - started - upstream_s  # reading, applying, relaying: the gateway's cost
        timing = f"gateway;dur={1000 * own_s:.2f}, upstream;dur={1000 * upstream_s:.2f}"
        answer.headers["Server-Timing"] = timing
        return answer

    async def _stream(snap: Snapshot, payload: bytes) -> Response:
        req = client.build_request("POST", "/chat/completions", content=payload)
        try:
            got = await client.send(req, stream=True)
        except httpx.HTTPError as exc:
            return _unreachable(exc, snap)
        if got.status_code >= 400:
            try:
                content = await got.aread()
            except httpx.HTTPError as exc:
                return _unreachable(exc, snap)
            finally:
                await got.aclose()
            return _passed_on(got.status_code, content, got.headers, snap)
        media = got.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "text/event-stream":
            await got.aclose()
            what = media or "no content type"
            return error(502, f"the model endpoint answered a stream with {what}", snap, "server_error")
        head = snap.headers() | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(_relay(got, snap.version), media_type="text/event-stream", headers=head)

    app.mount("/", Versioned(tools, live))  # last: every route above is matched first
    return app


async def _relay(got: httpx.Response, version: str) -> AsyncIterator[str]:
    """The upstream's events, each chunk named by `version`; a stream the upstream cuts, or a
    chunk that is no JSON object, ends with one error event."""
    try:
        async for line in got.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank lines between events, comments, event names: OpenAI's chunks need none
            data = line[5:].strip()
            if data == "[DONE]":
                yield "data: [DONE]\n\n"
                return
            try:
                chunk = strict_json(data.encode("utf-8", "surrogatepass"))
            except NotJSON as exc:
                yield _event_error(f"the model endpoint streamed a chunk that {exc}")
                return
            if not isinstance(chunk, dict):
                yield _event_error("the model endpoint streamed a chunk that is no JSON object")
                return
            if "error" not in chunk:
                chunk["system_fingerprint"] = version
            yield f"data: {json.dumps(chunk)}\n\n"
    except httpx.HTTPError as exc:
        yield _event_error(f"the model endpoint's stream broke off: {type(exc).__name__}: {exc}")
    finally:
        await got.aclose()


def _event_error(message: str) -> str:
    return f"data: {json.dumps({'error': {'message': one_line(message), 'type': 'server_error'}})}\n\n"


def _unreachable(exc: httpx.HTTPError, snap: Snapshot) -> Response:
    if isinstance(exc, httpx.TimeoutException):
        why = f"the model endpoint did not answer in time ({type(exc).__name__})"
        return error(504, why, snap, "server_error")
    return error(502, f"the model endpoint is unreachable: {type(exc).__name__}: {exc}", snap, "server_error")


def _passed_on(status: int, content: bytes, headers: httpx.Headers, snap: Snapshot) -> Response:
    """The upstream's own error, with its status and body (never its other headers)."""
    media = headers.get("content-type", "application/json")
    return Response(content, status, media_type=media, headers=snap.headers())
