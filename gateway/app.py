"""The gateway's OpenAI-compatible API over the live policy.

`POST /v1/chat/completions` (with tools, and with `stream: true` as server-sent events in
OpenAI's chunk format), `GET /v1/models`, `GET /health`, the champion's function tools over MCP
at `/mcp`, `POST /admin/reload` (the token: read the live policy again now) and
`POST /v1/feedback` (the token: a user's verdict on one answer, `gateway/record.py`). Every
request passes `gateway/guard.py:Guard` first.

Each chat completion takes the live snapshot once (`gateway/snapshot.py`) and is forwarded
under it (`gateway/request.py`) to the upstream with the user's upstream key. The answer
names the snapshot's version: the `X-Ratchet-Policy` header, and `system_fingerprint` in the
body and in every streamed chunk; `X-Ratchet-Champion` says when nothing is promoted. Each is an
MLflow trace whose id is the `X-Ratchet-Trace` header. A
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
from ratchet.gateway.record import TRACE_HEADER, Feedback, FeedbackError, Recorder, Recording, write_feedback
from ratchet.gateway.request import BadRequest, Chooser, forwarded, parse, read_json
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
    recorder: Recorder | None = None,
) -> FastAPI:
    """The gateway over `upstream` (an OpenAI-compatible base URL, …/v1). `public`: bound beyond
    loopback (the token on every request); `reload`: what `/admin/reload` calls; `status`: more
    of `/health` (the watch's last error); `sampling`: set on every request over the agent's own
    (`--temperature`); `recorder`: every completion traced to MLflow, feedback taken on
    `POST /v1/feedback` (`gateway/record.py`; None: neither)."""
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
    app.state.client, app.state.recorder = client, recorder

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

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> Response:
        """A user's feedback on one answer, as MLflow assessments on its trace (the token: the
        Guard admits no other client here)."""
        if recorder is None:
            return error(404, "this gateway records no traces (--no-record): there is nothing to rate")
        try:
            said = Feedback.parse(read_json(await request.body(), "feedback body"))
            ids = await anyio.to_thread.run_sync(write_feedback, recorder.experiment_id, said)
        except BadRequest as exc:
            return error(400, str(exc))
        except FeedbackError as exc:
            return error(exc.status, str(exc))
        return JSONResponse({"trace_id": said.trace_id, "assessments": ids})

    def _prepare(snap: Snapshot, body: dict[str, Any]) -> tuple[dict[str, Any], Recording | None]:
        sent = forwarded(snap.policy, body, chooser) | (sampling or {})
        return sent, recorder.begin(body, snap) if recorder is not None else None

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        started = time.perf_counter()
        snap = live.current  # once: everything below is this version's
        try:
            body = parse(await request.body())
            sent, rec = await anyio.to_thread.run_sync(_prepare, snap, body)
            payload = encode(sent)
        except BadRequest as exc:
            return error(400, str(exc), snap)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a message or tool it cannot read
            return error(400, f"malformed request: {type(exc).__name__}: {exc}"[:500], snap)
        head = snap.headers() | ({TRACE_HEADER: rec.trace_id} if rec is not None else {})
        if sent.get("stream"):
            return await _stream(snap, head, payload, rec)
        return await _complete(snap, head, payload, started, rec)

    def _failed(rec: Recording | None, answer: Response) -> Response:
        if recorder is not None and rec is not None:
            recorder.end(rec, error=f"HTTP {answer.status_code}: {bytes(answer.body)[:300]!r}")
        return answer

    async def _complete(
        snap: Snapshot, head: dict[str, str], payload: bytes, started: float, rec: Recording | None
    ) -> Response:
        asked = time.perf_counter()
        try:
            got = await client.post("/chat/completions", content=payload)
        except httpx.HTTPError as exc:
            return _failed(rec, _unreachable(exc, snap))
        upstream_s = time.perf_counter() - asked
        if got.status_code >= 400:
            return _failed(rec, _passed_on(got.status_code, got.content, got.headers, snap))
        try:
            reply = strict_json(got.content)
        except NotJSON as exc:
            return _failed(rec, error(502, f"the model endpoint answered what {exc}", snap, "server_error"))
        if not isinstance(reply, dict):
            why = "the model endpoint answered no completion object"
            return _failed(rec, error(502, why, snap, "server_error"))
        reply["system_fingerprint"] = snap.version
        if recorder is not None:
            recorder.end(rec, reply)
        answer = JSONResponse(reply, headers=head)
        own_s = time.perf_counter() - started - upstream_s  # reading, applying, relaying: the gateway's cost
        timing = f"gateway;dur={1000 * own_s:.2f}, upstream;dur={1000 * upstream_s:.2f}"
        answer.headers["Server-Timing"] = timing
        return answer

    async def _stream(
        snap: Snapshot, head: dict[str, str], payload: bytes, rec: Recording | None
    ) -> Response:
        req = client.build_request("POST", "/chat/completions", content=payload)
        try:
            got = await client.send(req, stream=True)
        except httpx.HTTPError as exc:
            return _failed(rec, _unreachable(exc, snap))
        if got.status_code >= 400:
            try:
                content = await got.aread()
            except httpx.HTTPError as exc:
                return _failed(rec, _unreachable(exc, snap))
            finally:
                await got.aclose()
            return _failed(rec, _passed_on(got.status_code, content, got.headers, snap))
        media = got.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "text/event-stream":
            await got.aclose()
            what = media or "no content type"
            return _failed(
                rec, error(502, f"the model endpoint answered a stream with {what}", snap, "server_error")
            )
        head = head | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        relay = _relay(got, snap.version, rec, recorder)
        return StreamingResponse(relay, media_type="text/event-stream", headers=head)

    app.mount("/", Versioned(tools, live))  # last: every route above is matched first
    return app


async def _relay(
    got: httpx.Response, version: str, rec: Recording | None = None, recorder: Recorder | None = None
) -> AsyncIterator[str]:
    """The upstream's events, each chunk named by `version`; a stream the upstream cuts, or a
    chunk that is no JSON object, ends with one error event. `rec` keeps what the chunks say
    and is closed when the stream ends (as an error if it ended with one)."""
    failed: str | None = "the stream ended before [DONE]"
    try:
        async for line in got.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank lines between events, comments, event names: OpenAI's chunks need none
            data = line[5:].strip()
            if data == "[DONE]":
                failed = None
                yield "data: [DONE]\n\n"
                return
            try:
                chunk = strict_json(data.encode("utf-8", "surrogatepass"))
            except NotJSON as exc:
                failed = f"the model endpoint streamed a chunk that {exc}"
                yield _event_error(failed)
                return
            if not isinstance(chunk, dict):
                failed = "the model endpoint streamed a chunk that is no JSON object"
                yield _event_error(failed)
                return
            if "error" not in chunk:
                chunk["system_fingerprint"] = version
                if rec is not None:
                    rec.chunk(chunk)
            yield f"data: {json.dumps(chunk)}\n\n"
    except httpx.HTTPError as exc:
        failed = f"the model endpoint's stream broke off: {type(exc).__name__}: {exc}"
        yield _event_error(failed)
    finally:
        await got.aclose()
        if recorder is not None:
            recorder.end(rec, error=failed)


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
