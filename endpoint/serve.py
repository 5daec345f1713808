"""The intervention endpoint, run in the loop's own process on a free loopback port.

In-process because the rollouts it records are opened and closed by the rollout threads of
the same process (`endpoint/agent.py`); uvicorn serves it on a thread of its own with its
own event loop, so an agent's blocking HTTP call never waits on a rollout thread. Being in the
loop's process, it is held to `Limits` (`endpoint/limits.py`): no client can take the process's
files, memory or log with it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import TracebackType

import uvicorn

from ratchet.config import REQUEST_TIMEOUT_S
from ratchet.endpoint.app import create_app
from ratchet.endpoint.limits import Limits, RateLimitedLog, listening_socket, server_config
from ratchet.endpoint.recording import Rollouts
from ratchet.errors import EndpointError

START_TIMEOUT_S = 120.0  # generous: a loaded 2-core machine can take seconds to start a thread's loop


class InterventionEndpoint:
    """`with InterventionEndpoint(upstream, key, timeout) as ep:` serves on `ep.url` until the
    block ends; `ep.rollouts` opens and closes the rollouts it records."""

    def __init__(
        self,
        upstream: str,
        api_key: str = "not-needed",
        timeout_s: float = REQUEST_TIMEOUT_S,
        limits: Limits | None = None,
    ) -> None:
        self.rollouts = Rollouts()
        self.limits = limits or Limits()
        log = RateLimitedLog(logging.getLogger("ratchet.endpoint.http"), self.limits.log_lines_per_minute)
        self.app = create_app(self.rollouts, upstream, api_key, timeout_s, self.limits, log)
        self._sock = listening_socket("127.0.0.1", 0)
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(server_config(self.app, self.limits, log))
        self._thread = threading.Thread(target=self._run, name="intervention-endpoint", daemon=True)

    @property
    def url(self) -> str:
        """The endpoint's root; a rollout's base URL is `rollout_url(key)`."""
        return f"http://127.0.0.1:{self.port}"

    def rollout_url(self, key: str) -> str:
        return f"{self.url}/r/{key}/v1"

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        try:
            await self._server.serve(sockets=[self._sock])
        finally:
            await self.app.state.client.aclose()

    def start(self) -> InterventionEndpoint:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive():
                raise EndpointError("the intervention endpoint failed to start", "see the log above")
            if time.monotonic() > deadline:
                raise EndpointError(
                    f"the intervention endpoint did not start in {START_TIMEOUT_S:.0f} s", "retry"
                )
            time.sleep(0.02)
        return self

    def close(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._sock.close()

    def __enter__(self) -> InterventionEndpoint:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
