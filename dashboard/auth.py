"""The dashboard's token: every change (POST and any other non-read method) must carry it.

`dashboard.hosts` stops web pages (DNS rebinding, cross-site posts); the token stops the
rest: another user on this machine, or any process that cannot read the data dir, can no
longer promote or reject under any name it likes.

* **Where it lives**: `DATA_DIR/dashboard.token`, mode 0600, owned by whoever runs the
  dashboard. Written once, on the first start, atomically (written whole under a temporary
  name, then hard-linked into place, which fails rather than replaces; created in place
  with `O_EXCL` where the filesystem has no hard links): a file that exists is never
  overwritten, so two starts at once agree on one token and URLs printed earlier stay
  valid. A token file that others may read (group or world bits), that another user
  owns, that is a symlink, that has a second name (a hard link: another data dir's token
  file, whose token it would share) or that is damaged is refused with one line: its token
  may have leaked or been planted, and changing its mode would not undo that. Delete it to
  get a new one. The checks are `ratchet.http_guard.read_private_token`'s, shared with the
  model server's admin token.
* **How a client sends it**: `Authorization: Bearer TOKEN`, compared with
  `hmac.compare_digest`. Never from a cookie and never from the query string: a change
  carrying the token only in its URL is refused like one without it.
* **How the page gets it**: `ratchet dashboard` prints `http://127.0.0.1:PORT/?token=TOKEN`
  (as Jupyter does). The page's script keeps the token from that URL in the origin's
  `localStorage` in that browser (after the server said it is the right one), removes it
  from the address bar, and sends it as the header above with each decision. Chosen over an HttpOnly
  SameSite=Strict cookie because cookies are not isolated by port: every other server on
  127.0.0.1 the browser visits would receive the cookie, and a page on another local port
  is "same-site", so the browser would attach it to that page's forged requests.
  `localStorage` belongs to this exact origin (scheme, host, port), and a header is never
  sent by the browser on its own: a forged request carries no credential, and setting
  the header cross-origin needs a CORS preflight this server never grants.
* **Reading needs no token** (unlike Jupyter): pages and GETs of the API show what the
  data dir holds, which its file modes already let local users read (0644 files under a
  umask of 022); bookmarks, links from MLflow traces and health checks keep working. The
  server never writes the token into a page, so reading a page reveals nothing. Known
  gap: a data dir made private (0700) is still readable through the dashboard's pages.
"""

from __future__ import annotations

import time
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from ratchet.dashboard.hosts import SAFE_METHODS, headers_of, refuse
from ratchet.errors import StateFileError
from ratchet.http_guard import (  # noqa: F401 - presented, matches, TOKEN_RE: this module's API
    TOKEN_RE,
    NotPrivate,
    ensure_private_token,
    matches,
    presented,
    read_private_token,
)

TOKEN_FILE = "dashboard.token"  # in the data dir; hard-coded, not a setting
SETTLE_S = 1.0  # how long a start waits for a concurrent first start to drop its temporary link


def token_path(data_dir: Path) -> Path:
    return Path(data_dir) / TOKEN_FILE


def _refused(path: Path, why: str) -> StateFileError:
    return StateFileError(
        f"the dashboard token {path} {why}",
        "delete it; `ratchet dashboard` then writes a new one (open the new URL it prints)",
    )


def read_token(data_dir: Path, settle_s: float = 0.0) -> str:
    """The data dir's token, refused unless only its owner (this user) can read it and it has
    one name (a hard link from another data dir would share its token). `settle_s`: how long
    a second link may be a concurrent first start's temporary one (`ensure_token`)."""
    path = token_path(data_dir)
    deadline = time.monotonic() + settle_s
    while True:
        try:
            return read_private_token(path)
        except NotPrivate as exc:
            if not exc.linked or time.monotonic() >= deadline:
                raise _refused(path, str(exc)) from None
        time.sleep(0.02)


def ensure_token(data_dir: Path) -> str:
    """The data dir's token, written on the first start (mode 0600, atomically, never over
    an existing file: a second start at the same moment reads the first one's token)."""
    path = token_path(data_dir)
    try:
        return ensure_private_token(path, settle_s=SETTLE_S)
    except NotPrivate as exc:
        raise _refused(path, str(exc)) from None


class TokenRequired:
    """ASGI middleware: any request but GET/HEAD/OPTIONS must carry the token (401 without
    one, 403 with a wrong one), checked before its body is read."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS:
            candidate = presented(headers_of(scope))
            if candidate is None:
                await refuse(scope, receive, send, 401, NO_TOKEN, www_authenticate="Bearer")
                return
            if not matches(self.token, candidate):
                await refuse(scope, receive, send, 403, WRONG_TOKEN)
                return
        await self.app(scope, receive, send)


WHERE = (
    "open the URL `ratchet dashboard` printed (…/?token=…), "
    f"or send `Authorization: Bearer` with the token in DATA_DIR/{TOKEN_FILE}"
)
NO_TOKEN = f"refused: a change needs the dashboard's token: {WHERE}"
WRONG_TOKEN = f"refused: that is not this dashboard's token: {WHERE}"
