"""Process environment for everything ratchet runs, set before Prefect, MLflow or torch load.

Keeps all state under the data dir (Prefect's database, MLflow's store) and everything
offline: no telemetry, no hub downloads. First it checks that the data dir and MLflow's
database can be used at all: each way they cannot is one line, not a traceback from deep
inside SQLAlchemy.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from urllib.parse import quote

from ratchet import services, shutdown
from ratchet.config import Settings, sqlite_url
from ratchet.errors import DataDirError, StateFileError

# Prefect gives its ephemeral API server 20 s to answer; a new Prefect database alone takes
# 10-25 s to migrate on 2 busy cores. Ours: the slowest machine we know, several times over.
PREFECT_STARTUP_TIMEOUT_S = 600


# What Prefect's database URL is read from: set, it is the user's, and left alone.
PREFECT_DB_URL_VARS = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")
SQLITE_HEADER = b"SQLite format 3\x00"


def prepare_environment(settings: Settings) -> list[str]:
    """Check the data dir and MLflow's database (nothing is written if either is unusable),
    then point every service's state at the data dir. Stops the services a killed run left
    in it (`ratchet.services`) and returns one line per service stopped, to print."""
    check_data_dir(settings.data_dir)
    check_mlflow_store(settings.data_dir / "mlflow.db")
    offline_environment()
    shutdown.set_logs_dir(str(settings.logs_dir))
    stopped = services.use(settings.data_dir)
    defaults = {
        "PREFECT_HOME": str(settings.prefect_home),
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": str(PREFECT_STARTUP_TIMEOUT_S),
        "MLFLOW_TRACKING_URI": settings.mlflow_uri,
        "MLFLOW_ENABLE_ASYNC_TRACE_LOGGING": "true",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "MLFLOW_LOGGING_LEVEL": "WARNING",  # its INFO lines (database migrations) would break a log's lines
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # model-loading bars would tear through Rich's
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    _quote_prefect_database(os.environ["PREFECT_HOME"])
    return stopped


# No telemetry, no fetch: every library that would reach the network on its own is told not to.
OFFLINE = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_MODEL_CATALOG_URI": "",  # traced model calls: prices from the bundled catalog, no fetch
    "MLFLOW_DISABLE_TELEMETRY": "true",  # MLflow reads DO_NOT_TRACK only as "true"
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "ANONYMIZED_TELEMETRY": "False",
    "DO_NOT_TRACK": "1",
}


def offline_environment() -> None:
    """Set `OFFLINE` (what the user set stays). Before anything starts a service: a Prefect
    flow called before the settings are prepared starts its API server with this environment."""
    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)


def check_data_dir(data: Path) -> None:
    """Create the data dir, or say in one line why it cannot be. As root, permission bits stop
    no write, and `os.access` is false only for what truly cannot be written (a read-only mount)."""
    fix = "choose another --data-dir (or data_dir in ratchet.toml)"
    try:
        data.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file by that name
        raise DataDirError(f"the data dir {data} is a file", f"move the file away or {fix}") from None
    except OSError as exc:
        raise DataDirError(
            f"the data dir {data} cannot be created: {exc.strerror or exc}", f"{fix}, or create it writable"
        ) from None
    _check_writable(data, data, fix)


def check_data_dir_unmade(data: Path) -> None:
    """`check_data_dir` without creating anything (`ratchet doctor`): the data dir, or where it
    would be created, is a directory this process may write."""
    fix = "choose another --data-dir (or data_dir in ratchet.toml)"
    here = data
    while not os.path.lexists(here) and here != here.parent:
        here = here.parent
    if not here.is_dir():
        what = "the data dir" if here == data else f"{here}, where the data dir {data} would be made,"
        raise DataDirError(
            f"{what} is not a directory" if here != data else f"the data dir {data} is a file",
            f"move the file away or {fix}",
        )
    _check_writable(here, data, fix)


def _check_writable(here: Path, data: Path, fix: str) -> None:
    if not os.access(here, os.W_OK | os.X_OK):
        what = f"the data dir {data}" if here == data else f"{here} (where the data dir {data} would be made)"
        raise DataDirError(
            f"{what} is read-only",
            f"make it writable (its permissions, or the file system's mount) or {fix}",
        )


def check_mlflow_store(db: Path) -> None:
    """MLflow's SQLite database, before MLflow opens it: a damaged or read-only file otherwise
    fails inside MLflow's set-up with a traceback of 100-200 lines. Cheap (a header and the
    schema table): a file damaged past its schema is not found here."""
    if not os.path.lexists(db):
        return  # MLflow creates it on first use
    aside = "move it aside (e.g. to mlflow.db.damaged) and run again: MLflow then starts an empty one"
    if not db.is_file():
        raise StateFileError(f"the MLflow database {db} is not a regular file", aside)
    try:
        with db.open("rb") as f:
            header = f.read(len(SQLITE_HEADER))
    except OSError as exc:
        raise StateFileError(
            f"the MLflow database {db} cannot be read: {exc.strerror or exc}", "fix its permissions"
        ) from None
    if header and header != SQLITE_HEADER:
        raise StateFileError(f"the MLflow database {db} is damaged (not an SQLite file)", aside)
    if not (os.access(db, os.W_OK) and os.access(db.parent, os.W_OK | os.X_OK)):
        raise StateFileError(
            f"the MLflow database {db} is read-only",
            "make it (and its directory) writable, or choose another --data-dir",
        )
    try:
        conn = sqlite3.connect(db, timeout=5)  # a path, not a URI: no character is special
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        finally:
            conn.close()
    except sqlite3.OperationalError as exc:  # cannot open, I/O, locked: not the content's fault
        if "locked" in str(exc) or "busy" in str(exc):
            return  # another ratchet process is writing: the file is fine
        raise StateFileError(
            f"the MLflow database {db} cannot be opened ({exc})", "check the file, its directory and the disk"
        ) from None
    except sqlite3.DatabaseError as exc:  # not a database, malformed: the content
        raise StateFileError(f"the MLflow database {db} is damaged ({exc})", aside) from None


def _quote_prefect_database(home: str) -> None:
    """Prefect builds its database URL from PREFECT_HOME unquoted, so a '?' or '%' in the data
    dir's path would put its database elsewhere: give it the quoted URL. Only then, so a
    profile's own database setting stays in force for every ordinary path."""
    if quote(home, safe="/") == home or any(v in os.environ for v in PREFECT_DB_URL_VARS):
        return
    os.environ[PREFECT_DB_URL_VARS[0]] = sqlite_url(Path(home) / "prefect.db", "sqlite+aiosqlite")
