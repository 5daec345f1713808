"""Where Prefect's and MLflow's own log lines go: the data dir's logs, not the console.

Both log INFO lines of their own (a flow run beginning and finishing, a database migration).
On a terminal they tear through the progress bars; in a log file (`ratchet evolve > run.log`,
a scheduler) they bury ratchet's one line per stage. They are kept, at INFO, in
`<data dir>/logs/services.log`; only their warnings and errors reach the console.

Both libraries configure their loggers when first imported (MLflow replaces its loggers'
handlers), so this runs after importing them, just before a flow starts.
"""

from __future__ import annotations

import io
import logging
import logging.handlers
from pathlib import Path

SERVICES = ("prefect", "mlflow", "alembic")  # not httpx: a line per model call
FILE = "services.log"
MAX_BYTES = 10 * 2**20  # then services.log.1 .. .3: a year of nightly runs stays small
BACKUPS = 3
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def keep_service_logs(logs_dir: Path) -> Path:
    """Send the services' INFO lines to `logs_dir/services.log` and keep only their warnings
    on the console; idempotent (a second call in the same process adds nothing). Returns the
    file's path."""
    import mlflow  # noqa: F401  (configures its loggers on import: ours must come after)
    import prefect  # noqa: F401

    logs_dir.mkdir(parents=True, exist_ok=True)
    path = (logs_dir / FILE).resolve()
    handler = _file_handler(path)
    root = logging.getLogger()
    _quiet_console(root)
    for name in SERVICES:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        _quiet_console(logger)
        if not logger.propagate:  # MLflow's loggers stop at their own handler
            _attach(logger, handler)
    _attach(root, handler)
    return path


def _file_handler(path: Path) -> logging.Handler:
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path:
            return h
    handler = logging.handlers.RotatingFileHandler(
        path, maxBytes=MAX_BYTES, backupCount=BACKUPS, encoding="utf-8", delay=True
    )
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(FORMAT))
    return handler


def _attach(logger: logging.Logger, handler: logging.Handler) -> None:
    if handler not in logger.handlers:
        logger.addHandler(handler)


def _quiet_console(logger: logging.Logger) -> None:
    """A handler writing to the terminal's streams shows warnings and errors only."""
    for h in logger.handlers:
        if _to_console(h):
            h.setLevel(max(h.level, logging.WARNING))


def _to_console(handler: logging.Handler) -> bool:
    """A stream handler on a terminal's stream: not a file, nor an in-memory capture (a
    test's `caplog`), whatever the stream object is now (MLflow keeps the one it found)."""
    if not isinstance(handler, logging.StreamHandler) or isinstance(handler, logging.FileHandler):
        return False
    return not isinstance(handler.stream, io.StringIO)
