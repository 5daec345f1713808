"""Only this machine's browser tabs of this very server may talk to the API.

The API and dashboard bind to 127.0.0.1, but a web page from anywhere can still reach
them through the user's browser:

* **DNS rebinding**: `attacker.example` resolves to 127.0.0.1 after the page loaded, so
  the page's requests land here with `Host: attacker.example`. Every request whose Host
  is not a loopback name (127.0.0.1, localhost, [::1]) gets 421, whatever its method.
* **Cross-site requests**: a page on another origin (including another port of
  localhost) posts to us. A state-changing request (anything but GET/HEAD/OPTIONS) must
  carry JSON (a form or `text/plain` post is refused with 415: those need no CORS
  preflight) and, when the client names an origin (browsers always do on a cross-origin
  POST), that origin must be exactly the one the request was sent to (scheme, host and
  port of its Host); `Sec-Fetch-Site: cross-site` is refused too. Non-browser clients
  (curl, scripts) send no Origin and pass.

Not covered: a process on this machine (it can call the API directly: the data dir is
its to change anyway), and a browser extension with access to localhost.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _host_name(netloc: str) -> str:
    """'127.0.0.1:8780' -> '127.0.0.1'; '[::1]:80' -> '::1'; case folded."""
    return (urlsplit(f"//{netloc}").hostname or "").lower()


def refusal(method: str, headers: dict[str, str]) -> tuple[int, str] | None:
    """Why a request must be refused (status and one line), or None when it may pass."""
    host = headers.get("host", "")
    if _host_name(host) not in LOOPBACK:
        return 421, f"refused: Host {host!r} is not this machine's loopback address"
    if method in SAFE_METHODS:
        return None
    media = headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        return 415, "refused: a change must be sent as application/json"
    if headers.get("sec-fetch-site", "") == "cross-site":
        return 403, "refused: cross-site request"
    origin = headers.get("origin")
    if origin is not None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or parts.netloc.lower() != host.lower():
            return 403, f"refused: origin {origin!r} is not this server's ({host})"
    return None


class LoopbackOnly:
    """ASGI middleware applying `refusal` to every HTTP request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            refused = refusal(scope["method"], headers)
            if refused is not None:
                from starlette.responses import JSONResponse

                code, detail = refused
                await JSONResponse({"detail": detail}, status_code=code)(scope, receive, send)
                return
        await self.app(scope, receive, send)
