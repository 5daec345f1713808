"""Trajectory store: every rollout, finished or failed, keyed by its deterministic id.

`TrajectoryStore` is the interface flows talk to; `SQLiteTrajectoryStore` is the embedded
backend (one file in WAL mode, safe for a thread pool of rollouts writing at once). A
Postgres backend can implement the same protocol later; `open_store` picks the backend.

Writes are upserts on `Trajectory.id`, which is derived from (evolution, generation,
task_id, rollout, arm): rerunning a killed generation rewrites the same rows, and
`finished_ids` tells a flow which rollouts it can skip.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, TypedDict, TypeVar, Unpack, runtime_checkable

from ratchet.errors import ConfigError, StateFileError
from ratchet.types import Diagnosis, Split, Trajectory

__all__ = [
    "SCHEMA_VERSION",
    "SQLiteTrajectoryStore",
    "TrajectoryFilters",
    "TrajectoryStore",
    "TrajectorySummary",
    "open_store",
]

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class TrajectorySummary:
    """A trajectory without its steps: cheap enough to list thousands of them."""

    id: str
    evolution: str
    generation: int
    task_id: str
    subset: str
    split: Split
    rollout: int
    kind: str
    status: str
    success: bool
    score: float
    n_steps: int
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    policy_version: str
    created_at: datetime


class TrajectoryFilters(TypedDict, total=False):
    """Equality filters shared by query, summaries, count and export; None means 'any'."""

    evolution: str | None
    generation: int | None
    task_id: str | None
    split: Split | None
    suite: str | None
    success: bool | None
    status: str | None
    kind: str | None
    policy_version: str | None


@runtime_checkable
class TrajectoryStore(Protocol):
    """What every trajectory backend provides. All methods are safe to call from any thread."""

    def put(self, traj: Trajectory) -> None:
        """Insert or atomically replace the trajectory with this id."""
        ...

    def get(self, id: str) -> Trajectory | None: ...

    def finished_ids(
        self, ids: Iterable[str], policy_version: str | None = None, suite_version: str | None = None
    ) -> set[str]:
        """The subset of `ids` stored with status 'finished' (error rows do not count), and,
        when given, played by that policy version and on that suite version (a row stored
        before suite versions were recorded counts as any)."""
        ...

    def suite_versions(self, evolution: str) -> dict[str, set[str]]:
        """Per suite name, the suite versions an evolution's stored rollouts were played on
        ('' for rows stored before versions were recorded)."""
        ...

    def query(
        self, *, limit: int | None = None, offset: int = 0, **filters: Unpack[TrajectoryFilters]
    ) -> list[Trajectory]:
        """Matching trajectories ordered by (generation, task_id, rollout), ties broken by
        (evolution, id) so that limit/offset pages are stable."""
        ...

    def summaries(
        self, *, limit: int | None = None, offset: int = 0, **filters: Unpack[TrajectoryFilters]
    ) -> list[TrajectorySummary]:
        """Like `query`, without loading steps."""
        ...

    def count(self, **filters: Unpack[TrajectoryFilters]) -> int: ...

    def export_jsonl(self, path: str | os.PathLike[str], **filters: Unpack[TrajectoryFilters]) -> int:
        """Write matching trajectories as JSON lines (all or nothing); returns how many."""
        ...

    # -- diagnoses: stored beside the trajectory they explain, keyed by its id

    def put_diagnoses(self, diagnoses: Iterable[Diagnosis]) -> None:
        """Insert or replace diagnoses (idempotent: rerunning `diagnose` rewrites the same rows)."""
        ...

    def diagnoses(
        self, evolution: str, generation: int | None = None, mode: str | None = None
    ) -> list[Diagnosis]:
        """Diagnoses of an evolution (optionally one generation or mode), by trajectory id."""
        ...

    def check_integrity(self) -> None:
        """Raise StateFileError if the store's files are damaged."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- SQLite backend

_SCHEMA = (
    """CREATE TABLE trajectories (
        id                TEXT PRIMARY KEY,
        evolution         TEXT    NOT NULL,
        generation        INTEGER NOT NULL,
        task_id           TEXT    NOT NULL,
        suite             TEXT    NOT NULL,
        suite_version     TEXT    NOT NULL DEFAULT '',
        subset            TEXT    NOT NULL,
        split             TEXT    NOT NULL,
        rollout           INTEGER NOT NULL,
        kind              TEXT    NOT NULL,
        status            TEXT    NOT NULL,
        success           INTEGER NOT NULL,
        score             REAL    NOT NULL,
        n_steps           INTEGER NOT NULL,
        prompt_tokens     INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        seconds           REAL    NOT NULL,
        policy_version    TEXT    NOT NULL,
        created_at        TEXT    NOT NULL,
        data              TEXT    NOT NULL  -- Trajectory.model_dump_json(), the only copy of steps
    )""",
    "CREATE INDEX ix_traj_order ON trajectories (evolution, generation, task_id, rollout)",
    "CREATE INDEX ix_traj_task ON trajectories (task_id)",
    "CREATE INDEX ix_traj_split ON trajectories (split, suite)",
    "CREATE INDEX ix_traj_status ON trajectories (status, success)",
    "CREATE INDEX ix_traj_policy ON trajectories (policy_version)",
)

# Added after schema version 1 without changing existing tables: created when missing.
_DIAGNOSES = (
    """CREATE TABLE IF NOT EXISTS diagnoses (
        trajectory_id TEXT PRIMARY KEY REFERENCES trajectories (id),
        evolution     TEXT    NOT NULL,
        generation    INTEGER NOT NULL,
        task_id       TEXT    NOT NULL,
        mode          TEXT    NOT NULL,
        data          TEXT    NOT NULL  -- Diagnosis.model_dump_json()
    )""",
    "CREATE INDEX IF NOT EXISTS ix_diag_gen ON diagnoses (evolution, generation, mode)",
)
# Columns added after schema version 1, to a table that lacks them (old rows get the default).
_ADDED_COLUMNS = {"suite_version": "TEXT NOT NULL DEFAULT ''"}

# Row columns besides `data`, in insert order; all of them are attributes of Trajectory.
_COLUMNS = (
    "id", "evolution", "generation", "task_id", "suite", "suite_version", "subset", "split", "rollout",
    "kind", "status", "success", "score", "n_steps", "prompt_tokens", "completion_tokens", "seconds",
    "policy_version", "created_at",
)  # fmt: skip
_FILTERS = tuple(TrajectoryFilters.__annotations__)
_SUMMARY_COLUMNS = tuple(f.name for f in fields(TrajectorySummary))
_ORDER = "ORDER BY generation, task_id, rollout, evolution, id"

_UPSERT = (
    f"INSERT INTO trajectories ({', '.join(_COLUMNS)}, data) "
    f"VALUES ({', '.join('?' * (len(_COLUMNS) + 1))}) "
    f"ON CONFLICT(id) DO UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in (*_COLUMNS[1:], "data"))
)


def _where(filters: dict[str, Any]) -> tuple[str, list[Any]]:
    unknown = set(filters) - set(_FILTERS)
    if unknown:
        raise TypeError(f"unknown trajectory filter(s): {', '.join(sorted(unknown))}")
    used = [(k, v) for k, v in filters.items() if v is not None]
    if not used:
        return "", []
    clause = " AND ".join(f"{k} = ?" for k, _ in used)
    return f"WHERE {clause}", [int(v) if isinstance(v, bool) else v for _, v in used]


F = TypeVar("F", bound=Any)


def damaged(path: Path, detail: str) -> StateFileError:
    detail = " ".join(detail.replace("*** in database main ***", "").split())[:200]
    return StateFileError(
        f"the trajectory database {path} is damaged ({detail})",
        f"recover what is readable: sqlite3 {path} .recover | sqlite3 {path}.recovered, then move "
        f"{path}.recovered into its place (stored rollouts are kept; lost ones rerun)",
    )


def _intact(method: F) -> F:
    """Turn SQLite's 'malformed'/'not a database' (a damaged file, not a busy one) into one line."""

    @functools.wraps(method)
    def wrapper(self: SQLiteTrajectoryStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.DatabaseError as exc:
            if type(exc) is not sqlite3.DatabaseError:  # busy, locked, constraint: not damage
                raise
            raise damaged(self.path, str(exc)) from None

    return wrapper  # type: ignore[return-value]


class SQLiteTrajectoryStore:
    """Trajectories in one SQLite file (WAL), one connection per thread."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if str(path) == ":memory:":
            raise ConfigError(
                "the SQLite trajectory store needs a file, not ':memory:'",
                "pass a file path (e.g. under tmp_path in tests)",
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[sqlite3.Connection] = []
        self._closed = False
        try:
            self._create_schema()
        except sqlite3.DatabaseError as e:
            self.close()
            if type(e) is sqlite3.DatabaseError and "not a database" not in str(e):
                raise damaged(self.path, str(e)) from None
            raise ConfigError(
                f"cannot open trajectory store {self.path}: {e}",
                "point the store at a writable SQLite file or a new path",
            ) from e
        except BaseException:
            self.close()
            raise

    def _create_schema(self) -> None:
        conn = self._conn()
        conn.execute("PRAGMA journal_mode=WAL")  # persistent: recorded in the file
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            elif row[0] != SCHEMA_VERSION:
                raise ConfigError(
                    f"trajectory store {self.path} has schema version {row[0]}, "
                    f"this ratchet expects {SCHEMA_VERSION}",
                    "use a ratchet version matching the store or point to a new store file",
                )
            for statement in _DIAGNOSES:
                conn.execute(statement)
            have = {r[1] for r in conn.execute("PRAGMA table_info(trajectories)")}
            for column, decl in _ADDED_COLUMNS.items():
                if column not in have:
                    conn.execute(f"ALTER TABLE trajectories ADD COLUMN {column} {decl}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    # -- connections

    def _conn(self) -> sqlite3.Connection:
        if self._closed:
            raise RuntimeError(f"trajectory store {self.path} is closed")
        conn = getattr(self._local, "conn", None)
        if conn is None:
            # isolation_level=None: autocommit, so each single-statement write is atomic on its own.
            # check_same_thread=False only so close() can close every thread's connection.
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA busy_timeout=30000")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for conn in self._connections:
                conn.close()
            self._connections.clear()

    def check_integrity(self) -> None:
        """Read every page (`PRAGMA quick_check`, ~1 s per 100 MB): a damaged file is one
        StateFileError now, before a model server starts, not a traceback mid-run."""
        try:
            problem = self._conn().execute("PRAGMA quick_check(1)").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            problem = str(exc)
        if problem != "ok":
            raise damaged(self.path, problem)

    def __enter__(self) -> SQLiteTrajectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writes

    @_intact
    def put(self, traj: Trajectory) -> None:
        values = [getattr(traj, c) for c in _COLUMNS]
        values[_COLUMNS.index("success")] = int(traj.success)
        values[_COLUMNS.index("created_at")] = traj.created_at.isoformat()
        self._conn().execute(_UPSERT, (*values, traj.model_dump_json()))

    # -- reads

    @_intact
    def get(self, id: str) -> Trajectory | None:
        row = self._conn().execute("SELECT data FROM trajectories WHERE id = ?", (id,)).fetchone()
        return None if row is None else Trajectory.model_validate_json(row[0])

    @_intact
    def finished_ids(
        self, ids: Iterable[str], policy_version: str | None = None, suite_version: str | None = None
    ) -> set[str]:
        wanted = list(dict.fromkeys(ids))
        found: set[str] = set()
        wanted_versions = (("policy_version", policy_version), ("suite_version", suite_version))
        extra = [(c, v) for c, v in wanted_versions if v]
        # a row stored before suite versions were recorded ('') counts as any suite version
        same = "".join(f"AND {c} IN (?, '') " if c == "suite_version" else f"AND {c} = ? " for c, _ in extra)
        for i in range(0, len(wanted), 500):  # stay under SQLite's bound-parameter limit
            chunk = wanted[i : i + 500]
            rows = self._conn().execute(
                f"SELECT id FROM trajectories WHERE status = 'finished' {same}"
                f"AND id IN ({', '.join('?' * len(chunk))})",
                [v for _, v in extra] + chunk,
            )
            found.update(r[0] for r in rows)
        return found

    @_intact
    def suite_versions(self, evolution: str) -> dict[str, set[str]]:
        rows = self._conn().execute(
            "SELECT DISTINCT suite, suite_version FROM trajectories WHERE evolution = ?", (evolution,)
        )
        out: dict[str, set[str]] = {}
        for suite, version in rows:
            out.setdefault(suite, set()).add(version)
        return out

    def _select(
        self, columns: str, filters: dict[str, Any], limit: int | None = None, offset: int = 0
    ) -> sqlite3.Cursor:
        where, params = _where(filters)
        sql = f"SELECT {columns} FROM trajectories {where} {_ORDER} LIMIT ? OFFSET ?"
        return self._conn().execute(sql, (*params, -1 if limit is None else limit, offset))

    def _iter(
        self, filters: dict[str, Any], limit: int | None = None, offset: int = 0
    ) -> Iterator[Trajectory]:
        for (data,) in self._select("data", filters, limit, offset):
            yield Trajectory.model_validate_json(data)

    @_intact
    def query(
        self, *, limit: int | None = None, offset: int = 0, **filters: Unpack[TrajectoryFilters]
    ) -> list[Trajectory]:
        return list(self._iter(dict(filters), limit, offset))

    @_intact
    def summaries(
        self, *, limit: int | None = None, offset: int = 0, **filters: Unpack[TrajectoryFilters]
    ) -> list[TrajectorySummary]:
        rows = self._select(", ".join(_SUMMARY_COLUMNS), dict(filters), limit, offset)
        out = []
        for row in rows:
            values = dict(zip(_SUMMARY_COLUMNS, row, strict=True))
            values["success"] = bool(values["success"])
            values["created_at"] = datetime.fromisoformat(values["created_at"])
            out.append(TrajectorySummary(**values))
        return out

    @_intact
    def count(self, **filters: Unpack[TrajectoryFilters]) -> int:
        where, params = _where(dict(filters))
        sql = f"SELECT COUNT(*) FROM trajectories {where}"
        return self._conn().execute(sql, params).fetchone()[0]

    @_intact
    def export_jsonl(self, path: str | os.PathLike[str], **filters: Unpack[TrajectoryFilters]) -> int:
        rows = self._iter(dict(filters))  # validates every row before it is written
        return _write_jsonl_atomically(Path(path), (t.model_dump_json() for t in rows))

    # -- diagnoses

    @_intact
    def put_diagnoses(self, diagnoses: Iterable[Diagnosis]) -> None:
        rows = [
            (d.trajectory_id, d.evolution, d.generation, d.task_id, d.mode, d.model_dump_json())
            for d in diagnoses
        ]
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(
                "INSERT INTO diagnoses (trajectory_id, evolution, generation, task_id, mode, data) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(trajectory_id) DO UPDATE SET "
                "evolution = excluded.evolution, generation = excluded.generation, "
                "task_id = excluded.task_id, mode = excluded.mode, data = excluded.data",
                rows,
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @_intact
    def diagnoses(
        self, evolution: str, generation: int | None = None, mode: str | None = None
    ) -> list[Diagnosis]:
        sql, params = "SELECT data FROM diagnoses WHERE evolution = ?", [evolution]
        if generation is not None:
            sql, params = sql + " AND generation = ?", [*params, generation]
        if mode is not None:
            sql, params = sql + " AND mode = ?", [*params, mode]
        rows = self._conn().execute(sql + " ORDER BY generation, task_id, trajectory_id", params)
        return [Diagnosis.model_validate_json(r[0]) for r in rows]


def _write_jsonl_atomically(path: Path, lines: Iterable[str]) -> int:
    """Write lines to a temp file beside `path`, then rename: a failure leaves no half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    n = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
                n += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n


# ---------------------------------------------------------------- factory


def open_store(path_or_url: str | os.PathLike[str]) -> TrajectoryStore:
    """Open a trajectory store: a file path or `sqlite:///path` (only SQLite for now)."""
    target = os.fspath(path_or_url)
    if target.startswith("sqlite:///"):
        target = target.removeprefix("sqlite:///")
    elif target.startswith("sqlite:"):
        raise ConfigError(
            f"malformed SQLite URL {target!r}",
            "write sqlite:///relative/path.db or sqlite:////absolute/path.db",
        )
    elif "://" in target:
        scheme = target.split("://", 1)[0]  # never echo the rest: URLs can carry passwords
        raise ConfigError(
            f"trajectory store URL scheme {scheme!r} is not supported",
            "use a file path or sqlite:///path/to/trajectories.db",
        )
    if not target:
        raise ConfigError("trajectory store path is empty", "set it to a file path")
    return SQLiteTrajectoryStore(target)
