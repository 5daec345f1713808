"""Who may reach the intervention endpoint, decided before any of a request's body is read.

The endpoint holds the user's upstream API key and forwards with it, so a request that names no
rollout must never be forwarded: any web page the user visits, and any local process, could
spend the key. `Gate` checks, in order, on every route:

1. the dashboard's rules (`ratchet.http_guard.refusal`, reads included): a loopback `Host`
   (DNS rebinding: 421), no foreign `Origin` and no cross-site fetch (403), a body only as
   `application/json` (415: a `text/plain` post needs no CORS preflight);
2. the path and its key: `/health` (a read) needs none; every model route does, `/r/<key>/…`
   in the path or `X-Ratchet-Rollout` on `/v1/…`: none is 401 (counted as `unattributed`),
   an unknown or closed one 404 (counted as `refused`); any other path is 404;
3. the body, only once the key is known: over `Limits.max_body` from its declared length is
   413 unread; a chunked one is counted as it arrives and refused at the limit; one that has
   not all arrived `Limits.body_timeout_s` after its first read is 408.

The app then gets the body as it came (replayed), never one it would have to cut short. Each
refusal is one line in OpenAI's error shape and closes the connection (its body is unread).
"""

from __future__ import annotations

import re

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ratchet.endpoint.limits import Limits, RateLimitedLog, Refusal, declared_refusal, read_body, replayed
from ratchet.endpoint.recording import Rollouts
from ratchet.http_guard import headers_of, refusal

KEY_HEADER = "x-ratchet-rollout"
KEYED_PATH = re.compile(r"^/r/([^/]*)/")
KINDS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    421: "permission_error",
}


async def refuse(scope: Scope, receive: Receive, send: Send, code: int, message: str) -> None:
    """`{"error": {"message": one line, "type": …}}`, and the connection closed."""
    body = {"error": {"message": message, "type": KINDS.get(code, "invalid_request_error")}}
    await JSONResponse(body, status_code=code, headers={"connection": "close"})(scope, receive, send)


class Gate:
    """ASGI middleware: the checks of the module's docstring, on every HTTP request."""

    def __init__(self, app: ASGIApp, rollouts: Rollouts, limits: Limits, log: RateLimitedLog) -> None:
        self.app, self.rollouts, self.limits, self.log = app, rollouts, limits, log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = headers_of(scope)
        refused = refusal(scope["method"], headers, every_method=True) or self._route(scope, headers)
        if refused is None and scope["path"] != "/health":
            refused = declared_refusal(headers, self.limits)
            if refused is None:
                read = await read_body(receive, self.limits)
                if isinstance(read, list):
                    await self.app(scope, replayed(read, receive), send)
                    return
                refused = read
        if refused is not None:
            await refuse(scope, receive, send, *refused)
            return
        await self.app(scope, receive, send)

    def _route(self, scope: Scope, headers: dict[str, str]) -> Refusal | None:
        path = scope["path"]
        if path == "/health":
            return None if scope["method"] in ("GET", "HEAD") else (405, "/health is read with GET")
        keyed = KEYED_PATH.match(path)
        if keyed is not None:
            key = keyed.group(1)
        elif path == "/v1" or path.startswith("/v1/"):
            key = headers.get(KEY_HEADER, "")
            if not key:
                self.rollouts.unattributed += 1
                self.log.warning("intervention endpoint: a call without a rollout key refused (401)")
                return 401, (
                    "no rollout key: call the base URL ratchet gave this rollout (…/r/<key>/v1); "
                    "a call without one is never forwarded"
                )
        else:
            return 404, "no such path"
        if self.rollouts.get(key) is None:
            self.rollouts.refused += 1
            return 404, "unknown or closed rollout key: a call made after its task ended"
        return None
