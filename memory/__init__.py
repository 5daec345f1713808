"""Memory: the trajectory store (SQLite now, Postgres later), vector index and retrieval."""

from ratchet.memory.trajectory_store import (
    SQLiteTrajectoryStore,
    TrajectoryStore,
    TrajectorySummary,
    open_store,
)

__all__ = ["SQLiteTrajectoryStore", "TrajectoryStore", "TrajectorySummary", "open_store"]
