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
  owns, that is a symlink or that is damaged is refused with one line: its token may have
  leaked or been planted, and changing its mode would not undo that. Delete it to get a
  new one.
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

import hmac
import os
import re
import secrets
import stat
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from ratchet.dashboard.hosts import SAFE_METHODS, headers_of, refuse
from ratchet.errors import StateFileError

TOKEN_FILE = "dashboard.token"  # in the data dir; hard-coded, not a setting
TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{32,128}$")


def token_path(data_dir: Path) -> Path:
    return Path(data_dir) / TOKEN_FILE


def _refused(path: Path, why: str) -> StateFileError:
    return StateFileError(
        f"the dashboard token {path} {why}",
        "delete it; `ratchet dashboard` then writes a new one (open the new URL it prints)",
    )


def read_token(data_dir: Path) -> str:
    """The data dir's token, refused unless only its owner (this user) can read it."""
    path = token_path(data_dir)
    try:  # no symlink followed, no wait on a FIFO
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if path.is_symlink():
            raise _refused(path, "is a symlink") from None
        raise _refused(path, f"cannot be read ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refused(path, "is not a file")
        if info.st_uid != os.geteuid():
            raise _refused(path, f"belongs to another user (uid {info.st_uid})")
        if info.st_mode & 0o077:
            mode = stat.S_IMODE(info.st_mode)
            raise _refused(path, f"may be read by others (mode {mode:04o}): it may have leaked")
        raw = os.read(fd, 256)
    finally:
        os.close(fd)
    token = raw.decode("ascii", "replace").strip()
    if not TOKEN_RE.match(token):
        raise _refused(path, "is damaged (not a token)")
    return token


def ensure_token(data_dir: Path) -> str:
    """The data dir's token, written on the first start (mode 0600, atomically, never over
    an existing file: a second start at the same moment reads the first one's token)."""
    path = token_path(data_dir)
    if not path.exists() and not path.is_symlink():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        _write_private(tmp)
        try:
            os.link(tmp, path)  # fails if it exists: never replaces a token
        except FileExistsError:
            pass
        except OSError:  # a filesystem without hard links: create in place, still never over one
            try:
                _write_private(path)
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    return read_token(data_dir)


def _write_private(path: Path) -> None:
    """A new token in a new file (`O_EXCL`: never an existing one), mode 0600, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # whatever the umask
        f.write(secrets.token_urlsafe(32) + "\n")
        f.flush()
        os.fsync(f.fileno())


def presented(headers: dict[str, str]) -> str | None:
    """The token a request carries in `Authorization: Bearer ...`, or None."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def matches(token: str, candidate: str | None) -> bool:
    """Constant-time comparison (bytes: a header may hold any latin-1 text)."""
    if candidate is None:
        return False
    return hmac.compare_digest(candidate.encode("latin-1", "replace"), token.encode("ascii"))


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
