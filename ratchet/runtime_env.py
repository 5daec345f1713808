"""Process environment for everything ratchet runs, set before Prefect, MLflow or torch load.

Keeps all state under the data dir (Prefect's database, MLflow's store) and everything
offline: no telemetry, no hub downloads.
"""

from __future__ import annotations

import os
import threading

from ratchet.config import Settings

# Prefect gives its ephemeral API server 20 s to answer; a new Prefect database alone takes
# 10-25 s to migrate on 2 busy cores. Ours: the slowest machine we know, several times over.
PREFECT_STARTUP_TIMEOUT_S = 600


def prepare_environment(settings: Settings) -> None:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    defaults = {
        "PREFECT_HOME": str(settings.prefect_home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": str(PREFECT_STARTUP_TIMEOUT_S),
        "MLFLOW_TRACKING_URI": settings.mlflow_uri,
        "MLFLOW_ENABLE_ASYNC_TRACE_LOGGING": "true",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "MLFLOW_MODEL_CATALOG_URI": "",  # traced model calls: prices from the bundled catalog, no fetch
        "MLFLOW_DISABLE_TELEMETRY": "true",  # MLflow reads DO_NOT_TRACK only as "true"
        "MLFLOW_LOGGING_LEVEL": "WARNING",  # its INFO lines (database migrations) would break a log's lines
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # model-loading bars would tear through Rich's
        "ANONYMIZED_TELEMETRY": "False",
        "DO_NOT_TRACK": "1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


# Set by the signal handlers below, before KeyboardInterrupt unwinds the main thread. Worker
# threads (Prefect's task runner) go on until their task ends; the runtime's stores and model
# server close under them, so a task checks this and stops quietly instead of failing loudly.
STOPPING = threading.Event()


def stopping() -> bool:
    """True once the process was told to stop (Ctrl-C or SIGTERM): start nothing new."""
    return STOPPING.is_set()


def stop_on_signals() -> None:
    """Make Ctrl-C (SIGINT) and `kill` (SIGTERM) unwind the same way: mark the process as
    stopping, then raise KeyboardInterrupt, so `with` blocks stop the model server and close
    stores, and exit handlers stop Prefect's API server. Left at Python's default, SIGTERM ends
    the process at once and leaves Prefect's server (uvicorn) running. A SIGINT the process
    was started to ignore (a shell's background job) stays ignored. For entry points: the CLI
    and the benchmarks."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        STOPPING.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, interrupt)
