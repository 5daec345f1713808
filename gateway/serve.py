"""The gateway, served: the first snapshot read, the audit watch started, uvicorn on a thread.

`Gateway` is what `ratchet gateway` runs in the foreground and what tests and benchmarks run in
process: `with Gateway(settings, upstream) as gw:` serves on `gw.url` until the block ends. The
upstream (the embedded model server, or any `--endpoint`) is the caller's: `cli/gateway.py`
starts and stops the embedded one around it. Held to `ratchet.endpoint.limits`: no client can
take the process's files, memory or log with it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn

from ratchet.config import Settings
from ratchet.endpoint.limits import Limits, RateLimitedLog, listening_socket, server_config
from ratchet.errors import EndpointError, RatchetError
from ratchet.gateway.app import create_app
from ratchet.gateway.guard import gateway_token
from ratchet.gateway.policy import AuditWatch, audit_logs, load_snapshot, reloader, signature
from ratchet.gateway.record import Recorder
from ratchet.gateway.request import Chooser
from ratchet.gateway.snapshot import Live, Snapshot
from ratchet.http_guard import LOOPBACK

START_TIMEOUT_S = 120.0  # a loaded 2-core machine can take seconds to start a thread's loop


class NoChampion(RatchetError):
    """The evolution has nothing promoted, and serving the base model was not asked for."""


def is_loopback(host: str) -> bool:
    return host.strip("[]").lower() in LOOPBACK or host.startswith("127.")


class Gateway:
    """The gateway in front of `upstream` (an OpenAI-compatible base URL, …/v1) for the live
    policy of `settings`' evolution. `allow_base`: start even when nothing is promoted.
    `poll_s`: how often the audit logs are looked at. `temperature`: every request's, in place of
    what the agent sends (None: the agent's own), e.g. 0 to serve as the gate measured.
    `record`: every completion an MLflow trace, and feedback taken on it (`gateway/record.py`)."""

    def __init__(
        self,
        settings: Settings,
        upstream: str,
        host: str = "127.0.0.1",
        port: int = 0,
        allow_base: bool = False,
        poll_s: float = 0.5,
        limits: Limits | None = None,
        temperature: float | None = None,
        record: bool = True,
    ) -> None:
        self.settings, self.upstream, self.host = settings, upstream, host
        self.public = not is_loopback(host)
        self.limits = limits or Limits()
        self.token = gateway_token(settings.data_dir)
        self.chooser = Chooser(settings.skills)
        logs = audit_logs(settings)
        seen = signature(logs)  # before the first read: a decision made during it is seen
        first = load_snapshot(settings, upstream, self.chooser)
        if not first.champion and not allow_base:
            raise NoChampion(
                f"evolution {settings.evolution!r} in {settings.data_dir} has no champion (none promoted)",
                "promote a candidate, or pass --allow-base to serve the base model (each answer says so)",
            )
        self.live = Live(first)
        reload = reloader(settings, upstream, self.live, self.chooser)
        self.watch = AuditWatch(logs, reload, poll_s, seen=seen)
        log = RateLimitedLog(logging.getLogger("ratchet.gateway.http"), self.limits.log_lines_per_minute)
        m = settings.model
        self.app = create_app(
            self.live,
            self.chooser,
            upstream,
            m.api_key.get_secret_value(),
            m.timeout_s,
            self.token,
            public=self.public,
            limits=self.limits,
            log=log,
            reload=self.watch.reload,
            status=self.status,
            sampling={} if temperature is None else {"temperature": temperature},
            recorder=Recorder(settings) if record else None,
        )
        self._sock = listening_socket(host, port)
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(server_config(self.app, self.limits, log))
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)

    @property
    def url(self) -> str:
        """The OpenAI base URL (…/v1) an agent is pointed at."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def snapshot(self) -> Snapshot:
        return self.live.current

    def status(self) -> dict[str, Any]:
        return {"reload_error": self.watch.error}

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            await self.app.state.client.aclose()

    def start(self) -> Gateway:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive():
                raise EndpointError("the gateway failed to start", "see the log above")
            if time.monotonic() > deadline:
                raise EndpointError(f"the gateway did not start in {START_TIMEOUT_S:.0f} s", "retry")
            time.sleep(0.02)
        self.watch.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self.watch.stop()
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._sock.close()

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
