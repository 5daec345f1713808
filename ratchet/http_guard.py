"""Only this machine's clients, and no web page, may talk to ratchet's HTTP servers.

Every server ratchet runs (the dashboard and its API, `ratchet tools serve --transport http`,
the embedded model server) binds to 127.0.0.1, but a web page from anywhere can still reach
it through the user's browser:

* **DNS rebinding**: `attacker.example` resolves to 127.0.0.1 after the page loaded, so
  the page's requests land here with `Host: attacker.example`. Every request whose Host
  is not a loopback name (127.0.0.1, localhost, [::1]) gets 421, whatever its method.
* **Cross-site requests**: a page on another origin (including another port of
  localhost) posts to us. A state-changing request (anything but GET/HEAD/OPTIONS) must
  carry JSON if it can carry a body at all (a form or `text/plain` post is refused with
  415: those need no CORS preflight; a DELETE, which a form cannot send, needs no body)
  and, when the client names an origin (browsers always do on a cross-origin
  POST), that origin must be exactly the one the request was sent to (scheme, host and
  port of its Host); `Sec-Fetch-Site: cross-site` is refused too. Non-browser clients
  (curl, scripts) send no Origin and pass.

`every_method=True` (the MCP transport, the model server) applies the Origin and
`Sec-Fetch-Site` checks to reads too (an MCP event stream is a GET), as the MCP transport
spec asks of servers.

Pure helpers here, in the core, so that every layer's server uses the same rules: these,
and the bearer tokens' (`read_private_token`: a token file must be a regular file with one
name, this user's, mode 0600; `presented`, `matches`). Which requests need a token is each
server's own: `ratchet.dashboard.auth` (every change), `ratchet.server.app` (the admin
routes). Not covered here: a process on this machine (a token stops one that cannot read
the data dir), and a browser extension with access to localhost.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import stat
import time
from pathlib import Path
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
BODYLESS = SAFE_METHODS | {"DELETE"}  # a form cannot send these: no Content-Type rule


def _host_name(netloc: str) -> str:
    """'127.0.0.1:8780' -> '127.0.0.1'; '[::1]:80' -> '::1'; case folded."""
    return (urlsplit(f"//{netloc}").hostname or "").lower()


def refusal(
    method: str, headers: dict[str, str], every_method: bool = False, any_host: bool = False
) -> tuple[int, str] | None:
    """Why a request must be refused (status and one line), or None when it may pass.
    `every_method`: check Origin and Sec-Fetch-Site on reads too (the MCP transport).
    `any_host`: take any Host (a server bound beyond loopback that needs a token on every
    request, which a rebound page does not have); the other rules still hold."""
    host = headers.get("host", "")
    if not any_host and _host_name(host) not in LOOPBACK:
        return 421, f"refused: Host {host!r} is not this machine's loopback address"
    if method in SAFE_METHODS and not every_method:
        return None
    media = headers.get("content-type", "").split(";")[0].strip().lower()
    if method not in BODYLESS and media != "application/json":
        return 415, "refused: a change must be sent as application/json"
    if headers.get("sec-fetch-site", "") == "cross-site":
        return 403, "refused: cross-site request"
    origin = headers.get("origin")
    if origin is not None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or parts.netloc.lower() != host.lower():
            return 403, f"refused: origin {origin!r} is not this server's ({host})"
    return None


def headers_of(scope: Scope) -> dict[str, str]:
    """The request's headers, names folded to lower case (a repeated header: its last value)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def refuse(scope: Scope, receive: Receive, send: Send, code: int, detail: str, **headers: str) -> None:
    """Answer `code` with `{"detail": one line}`, and close the connection: a refused body
    is never read, so the connection cannot be reused."""
    from starlette.responses import JSONResponse

    head = {"connection": "close", **{k.replace("_", "-"): v for k, v in headers.items()}}
    await JSONResponse({"detail": detail}, status_code=code, headers=head)(scope, receive, send)


class LoopbackOnly:
    """ASGI middleware applying `refusal` to every HTTP request."""

    def __init__(self, app: ASGIApp, every_method: bool = False) -> None:
        self.app = app
        self.every_method = every_method

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = refusal(scope["method"], headers_of(scope), self.every_method)
            if refused is not None:
                await refuse(scope, receive, send, *refused)
                return
        await self.app(scope, receive, send)


# ------------------------------------------------------------------ bearer tokens in private files
TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{32,128}$")


class NotPrivate(Exception):
    """A token file that is not this user's alone (its token may have leaked or been planted):
    the message says why, in words that follow the file's path. `linked`: it has more than one
    name (another path shares it; for a moment also a first start's temporary name)."""

    def __init__(self, why: str, linked: bool = False) -> None:
        super().__init__(why)
        self.linked = linked


def read_private_token(path: Path) -> str:
    """The token in `path`, refused (`NotPrivate`) unless it is a regular file with one name
    (no symlink, no hard link: another path, perhaps another data dir's, would share it),
    owned by this user and readable by no one else."""
    try:  # no symlink followed, no wait on a FIFO
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if path.is_symlink():
            raise NotPrivate("is a symlink") from None
        raise NotPrivate(f"cannot be read ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotPrivate("is not a file")
        if info.st_uid != os.geteuid():
            raise NotPrivate(f"belongs to another user (uid {info.st_uid})")
        if info.st_mode & 0o077:
            mode = stat.S_IMODE(info.st_mode)
            raise NotPrivate(f"may be read by others (mode {mode:04o}): it may have leaked")
        if info.st_nlink != 1:
            raise NotPrivate(f"has {info.st_nlink} hard links: another path shares its token", linked=True)
        raw = os.read(fd, 256)
    finally:
        os.close(fd)
    token = raw.decode("ascii", "replace").strip()
    if not TOKEN_RE.match(token):
        raise NotPrivate("is damaged (not a token)")
    return token


def write_private_token(path: Path, token: str | None = None) -> str:
    """`token` (None: a new random one) in a new file (`O_EXCL`: never an existing one), mode
    0600, fsynced; returns the token."""
    token = token or secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # whatever the umask
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    return token


def ensure_private_token(path: Path, settle_s: float = 1.0) -> str:
    """The token in `path`, written on the first call: whole under a temporary name, then
    hard-linked into place, which fails rather than replaces (created in place with `O_EXCL`
    where the filesystem has no hard links), so two first starts at once agree on one token
    and a file that exists is never overwritten. Refused (`NotPrivate`) as
    `read_private_token` refuses; `settle_s`: how long a second name may be a concurrent first
    start's temporary one."""
    if not path.exists() and not path.is_symlink():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        write_private_token(tmp)
        try:
            os.link(tmp, path)  # fails if it exists: never replaces a token
        except FileExistsError:
            pass
        except OSError:  # no hard links here: create in place, still never over one
            try:
                write_private_token(path)
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    deadline = time.monotonic() + settle_s
    while True:
        try:
            return read_private_token(path)
        except NotPrivate as exc:
            if not exc.linked or time.monotonic() >= deadline:
                raise
        time.sleep(0.02)


def presented(headers: dict[str, str]) -> str | None:
    """The token a request carries in `Authorization: Bearer ...`, or None."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def matches(token: str, candidate: str | None) -> bool:
    """Constant-time comparison (bytes: a header may hold any latin-1 text)."""
    if candidate is None:
        return False
    return hmac.compare_digest(candidate.encode("latin-1", "replace"), token.encode("ascii"))
