"""Who may reach the gateway, decided before any of a request's body is read.

The gateway forwards with the user's upstream API key (`model.api_key`) and runs distilled
tools in the sandbox, so what it must not let through is a web page the user visits, a client
that can hold the process's files or memory, or (bound beyond loopback) anyone without the
data dir's gateway token. `Guard` checks, in order, on every HTTP request:

1. bound beyond loopback (`--host`), the token on every request, reads included:
   `Authorization: Bearer` with the token in `DATA_DIR/gateway.token` (401 without, 403 with
   another); clients on other machines cannot be told from a web page by their Host, so the
   token is what admits them;
2. the rules of `ratchet.http_guard.refusal`, on every method: a loopback `Host` (DNS
   rebinding: 421; any Host once the token is required), no foreign `Origin` and no cross-site
   fetch (403), a body only as `application/json` (415: a `text/plain` post needs no CORS
   preflight);
3. the route: `/v1/chat/completions` (POST), `/v1/models`, `/health` (GET), `/mcp` (the MCP
   transport's methods), `/admin/reload` and `/v1/feedback` (POST); any other path is 404,
   another method 405; a change other than a chat completion or an MCP request (which ask the
   model or a tool and change nothing) needs the token on loopback too: feedback becomes what
   the next generation learns from;
4. the body: over `Limits.max_body` from its declared length is 413 unread, a chunked one is
   counted as it arrives and refused at the limit, and one that has not all arrived
   `Limits.body_timeout_s` after its first read is 408 (`ratchet.endpoint.limits`).

Each refusal is one line in OpenAI's error shape and closes the connection.

The token is `ratchet.http_guard.ensure_private_token`'s, as the dashboard's and the model
server's are (mode 0600, one name, this user's), in a file of its own: an agent on another
machine holds the gateway's token, which cannot promote or roll back anything.
"""

from __future__ import annotations

from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from ratchet.endpoint.gate import refuse
from ratchet.endpoint.limits import Limits, RateLimitedLog, Refusal, declared_refusal, read_body, replayed
from ratchet.errors import StateFileError
from ratchet.http_guard import (
    BODYLESS,
    SAFE_METHODS,
    NotPrivate,
    ensure_private_token,
    headers_of,
    matches,
    presented,
    refusal,
)

TOKEN_FILE = "gateway.token"
MCP_PATH = "/mcp"
ROUTES: dict[str, frozenset[str]] = {
    "/v1/chat/completions": frozenset({"POST"}),
    "/v1/models": frozenset({"GET", "HEAD"}),
    "/health": frozenset({"GET", "HEAD"}),
    "/admin/reload": frozenset({"POST"}),
    "/v1/feedback": frozenset({"POST"}),
}
OPEN = frozenset({"/v1/chat/completions", MCP_PATH})  # a change any loopback client may make: asking
WHERE = f"send `Authorization: Bearer` with the token in DATA_DIR/{TOKEN_FILE}"


def token_path(data_dir: Path) -> Path:
    return Path(data_dir) / TOKEN_FILE


def gateway_token(data_dir: Path) -> str:
    """The data dir's gateway token, written on the first start; one line if it is refused."""
    path = token_path(data_dir)
    try:
        return ensure_private_token(path)
    except NotPrivate as exc:
        raise StateFileError(
            f"the gateway token {path} {exc}", "delete it; `ratchet gateway` then writes a new one"
        ) from None


class Guard:
    """ASGI middleware: the checks of the module's docstring. `public`: bound beyond loopback
    (the token on every request)."""

    def __init__(self, app: ASGIApp, token: str, public: bool, limits: Limits, log: RateLimitedLog) -> None:
        self.app, self.token, self.public, self.limits, self.log = app, token, public, limits, log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path, headers = scope["method"], scope["path"], headers_of(scope)
        refused = (
            (self._token(headers) if self.public else None)
            or refusal(method, headers, every_method=True, any_host=self.public)
            or _route(method, path)
        )
        if refused is None and not self.public and method not in SAFE_METHODS and _open(path) is None:
            refused = self._token(headers)
        if refused is None and method not in BODYLESS:
            refused = declared_refusal(headers, self.limits)
            if refused is None:
                read = await read_body(receive, self.limits)
                if isinstance(read, list):
                    await self.app(scope, replayed(read, receive), send)
                    return
                refused = read
        if refused is not None:
            if refused[0] in (401, 403):
                self.log.warning("gateway: a request without the token refused (%d)", refused[0])
            await refuse(scope, receive, send, *refused)
            return
        await self.app(scope, receive, send)

    def _token(self, headers: dict[str, str]) -> Refusal | None:
        candidate = presented(headers)
        if candidate is None:
            return 401, f"this gateway needs its token: {WHERE}"
        if not matches(self.token, candidate):
            return 403, f"that is not this gateway's token: {WHERE}"
        return None


def _open(path: str) -> str | None:
    """The route a change needs no token on (None: it needs one)."""
    route = MCP_PATH if path in (MCP_PATH, MCP_PATH + "/") else path
    return route if route in OPEN else None


def _route(method: str, path: str) -> Refusal | None:
    if path in (MCP_PATH, MCP_PATH + "/"):
        return None  # the MCP transport answers its own methods
    allowed = ROUTES.get(path)
    if allowed is None:
        return 404, "no such path: the gateway serves /v1/chat/completions, /v1/models, /mcp and /health"
    if method not in allowed:
        return 405, f"{path} takes {' or '.join(sorted(allowed))}"
    return None
