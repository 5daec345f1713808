"""Prefect's API before the first flow run: started here, with a limit we chose.

Without a Prefect server (`PREFECT_API_URL` unset), Prefect starts an ephemeral API server
in a subprocess at the first flow run and gives it 20 s to answer. In a new data dir that
server first creates and migrates its SQLite database: 10 s on a quiet 2-core machine,
23 s on a busy one, so a first run failed with "Timed out while attempting to connect to
ephemeral Prefect API server". Here the same server (Prefect keeps one per process) is
started ahead of the flow, under a spinner, and waited for as long as
`PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS` says (`ratchet.runtime_env` sets it to
`PREFECT_STARTUP_TIMEOUT_S` unless you did, so a flow started some other way waits as long);
a server that is not up by then is broken, not slow, and gets one line.
"""

from __future__ import annotations

import os
import time

from ratchet import services
from ratchet.errors import PrefectStartError
from ratchet.runtime_env import PREFECT_STARTUP_TIMEOUT_S


def start_prefect_api() -> float:
    """Start the ephemeral API server now (no-op with a Prefect server); returns seconds taken."""
    if os.environ.get("PREFECT_API_URL"):
        return 0.0
    timeout_s = int(
        os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", PREFECT_STARTUP_TIMEOUT_S)
    )
    from prefect.server.api.server import SubprocessASGIServer

    started = time.monotonic()
    server = SubprocessASGIServer()
    try:
        server.start(timeout=timeout_s)
    except Exception as exc:  # Prefect raises RuntimeError (timeout, exit) or httpx errors
        detail = " ".join(str(exc).split())[:300]
        raise PrefectStartError(
            f"Prefect's API server did not start within {timeout_s} s ({detail})",
            f"check {os.environ.get('PREFECT_HOME', '~/.prefect')} is writable, or start a server "
            "(prefect server start --host 127.0.0.1) and export PREFECT_API_URL=http://127.0.0.1:4200/api",
        ) from None
    if server.server_process is not None:  # Prefect stops it at exit; a killed run cannot
        services.register("Prefect's API server", server.server_process.pid)
    return time.monotonic() - started
