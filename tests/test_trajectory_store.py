"""Conformance suite for trajectory stores, plus SQLite-specific checks.

Every test taking `store` or `open_backend` runs against each backend in BACKENDS; a new
backend (Postgres) joins by adding a factory there.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import closing
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from ratchet.errors import ConfigError
from ratchet.memory import SQLiteTrajectoryStore, TrajectoryStore, TrajectorySummary, open_store
from ratchet.memory.trajectory_store import SCHEMA_VERSION
from ratchet.types import Step, ToolCall, Trajectory, task_id, trajectory_id

# ---------------------------------------------------------------- backends


def _sqlite(tmp_path: Path) -> Callable[[], TrajectoryStore]:
    # a nested, not yet existing directory: the store must create it
    return lambda: SQLiteTrajectoryStore(tmp_path / "data" / "nested" / "trajectories.db")


# name -> (tmp_path -> factory opening a store on the same underlying storage each call)
BACKENDS: dict[str, Callable[[Path], Callable[[], TrajectoryStore]]] = {"sqlite": _sqlite}


@pytest.fixture(params=sorted(BACKENDS))
def open_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    factory = BACKENDS[request.param](tmp_path)
    opened: list[TrajectoryStore] = []

    def open_() -> TrajectoryStore:
        store = factory()
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()


@pytest.fixture
def store(open_backend: Callable[[], TrajectoryStore]) -> TrajectoryStore:
    return open_backend()


# ---------------------------------------------------------------- data


def make(
    evolution: str = "evo-a",
    generation: int = 0,
    suite: str = "tw",
    subset: str = "coin",
    split: str = "train",
    seed: int = 1,
    rollout: int = 0,
    n_steps: int = 2,
    **fields: Any,
) -> Trajectory:
    tid = task_id(suite, subset, split, seed)  # type: ignore[arg-type]
    steps = [
        Step(
            index=i,
            observation=f"room {i}\nyou see a coin ✓ «quoted»",
            message=f"step {i}",
            tool_call=ToolCall(name="act", args={"command": f"go {i}", "nested": {"k": [i, None]}}),
            tool_result="ok",
            source="expert" if i % 2 else "model",
            error="invalid" if i == 1 else None,
            reward=0.5 * i,
            prompt_tokens=10 + i,
            completion_tokens=3 * i,
            seconds=0.25 * i,
        )
        for i in range(n_steps)
    ]
    values: dict[str, Any] = dict(
        id=trajectory_id(evolution, generation, tid, rollout),
        evolution=evolution,
        generation=generation,
        task_id=tid,
        suite=suite,
        subset=subset,
        split=split,
        rollout=rollout,
        seed=1000 + rollout,
        policy_version=f"pv{generation}",
        instruction="find the coin",
        steps=steps,
        score=0.5,
        seconds=1.5,
        created_at=datetime(2025, 3, 4, 5, 6, 7, 890123, tzinfo=UTC),
    )
    values.update(fields)
    return Trajectory(**values)


TASKS = [
    ("tw", "coin", "train", 1),
    ("tw", "coin", "dev", 2),
    ("rg", "chain_sum", "test", 3),
    ("rg", "chain_sum", "train", 4),
]


def corpus() -> list[Trajectory]:
    """48 trajectories varying every filterable field. Generations 2 and 10 and rollouts 2 and
    10 sort differently as text and as numbers."""
    out = []
    i = 0
    for evolution in ("evo-a", "evo-b"):
        for generation in (0, 2, 10):
            for suite, subset, split, seed in TASKS:
                for rollout in (2, 10):
                    i += 1
                    out.append(
                        make(
                            evolution, generation, suite, subset, split, seed, rollout,
                            n_steps=i % 4,
                            kind="expert" if i % 5 == 0 else "agent",
                            status="error" if i % 4 == 0 else "finished",
                            success=i % 3 == 0,
                            score=i / 48,
                            seconds=float(i),
                            created_at=datetime(2025, 1, 1, tzinfo=UTC) + timedelta(minutes=i),
                        )
                    )  # fmt: skip
    return out


def order_key(t: Trajectory | TrajectorySummary) -> tuple[int, str, int]:
    return (t.generation, t.task_id, t.rollout)


# ---------------------------------------------------------------- conformance


def test_implements_protocol(store: TrajectoryStore) -> None:
    assert isinstance(store, TrajectoryStore)


def test_round_trip_keeps_steps_and_datetimes(store: TrajectoryStore) -> None:
    tz = timezone(timedelta(hours=-7, minutes=-30))
    original = make(
        n_steps=4,
        created_at=datetime(2024, 12, 31, 23, 59, 58, 123456, tzinfo=tz),
        error="boom",
        success=True,
        kind="expert",
    )
    store.put(original)
    got = store.get(original.id)
    assert got == original
    assert got is not None
    assert got.steps[3].tool_call == ToolCall(
        name="act", args={"command": "go 3", "nested": {"k": [3, None]}}
    )
    assert got.steps[1].error == "invalid" and got.steps[1].source == "expert"
    assert got.created_at.utcoffset() == tz.utcoffset(None)
    assert got.prompt_tokens == original.prompt_tokens == 10 + 11 + 12 + 13
    assert store.get("no-such-id") is None


def test_put_is_an_idempotent_upsert(store: TrajectoryStore) -> None:
    first = make(n_steps=2, status="finished", success=True, score=1.0, policy_version="old")
    second = make(n_steps=5, status="error", success=False, score=0.0, policy_version="new",
                  error="timeout")  # fmt: skip
    assert first.id == second.id
    store.put(first)
    store.put(first)
    assert store.count() == 1
    store.put(second)

    assert store.count() == 1
    assert store.get(first.id) == second
    # the filterable columns follow the new content, not only the JSON
    [summary] = store.summaries()
    assert (summary.status, summary.success, summary.n_steps, summary.policy_version) == (
        "error", False, 5, "new",
    )  # fmt: skip
    assert store.query(status="finished") == []
    assert store.count(policy_version="old") == 0
    assert store.finished_ids([first.id]) == set()


def test_finished_ids_excludes_errors_and_unknown(store: TrajectoryStore) -> None:
    done = make(rollout=0, status="finished", success=False)  # finished but failed: still done
    crashed = make(rollout=1, status="error", error="endpoint down")
    repaired = make(rollout=2, status="error")
    store.put(done)
    store.put(crashed)
    store.put(repaired)
    store.put(repaired.model_copy(update={"status": "finished"}))  # a rerun finished it

    asked = [done.id, crashed.id, repaired.id, "missing", done.id]
    assert store.finished_ids(asked) == {done.id, repaired.id}
    assert store.finished_ids(iter(asked)) == {done.id, repaired.id}  # any iterable, once
    assert store.finished_ids([]) == set()


def test_finished_ids_with_many_ids(store: TrajectoryStore) -> None:
    stored = [make(rollout=r) for r in range(30)]
    for t in stored:
        store.put(t)
    asked = [f"missing-{i}" for i in range(2500)] + [t.id for t in stored]
    assert store.finished_ids(asked) == {t.id for t in stored}


FILTER_CASES: list[dict[str, Any]] = [
    {"evolution": "evo-b"},
    {"generation": 0},  # falsy values must still filter
    {"generation": 10},
    {"task_id": task_id("rg", "chain_sum", "test", 3)},
    {"split": "dev"},
    {"suite": "rg"},
    {"success": True},
    {"success": False},
    {"status": "error"},
    {"status": "finished"},
    {"kind": "expert"},
    {"policy_version": "pv2"},
    {"evolution": "evo-a", "split": "train", "success": False, "generation": 2},
]


@pytest.mark.parametrize("filters", FILTER_CASES, ids=lambda f: ",".join(map(str, f.items())))
def test_query_filters(store: TrajectoryStore, filters: dict[str, Any]) -> None:
    rows = corpus()
    for t in rows:
        store.put(t)
    expected = [t for t in rows if all(getattr(t, k) == v for k, v in filters.items())]
    assert 0 < len(expected) < len(rows)  # the case actually discriminates

    got = store.query(**filters)
    assert {t.id for t in got} == {t.id for t in expected}
    assert all(t == {e.id: e for e in expected}[t.id] for t in got)
    assert store.count(**filters) == len(expected)
    assert [s.id for s in store.summaries(**filters)] == [t.id for t in got]


def test_query_without_filters_returns_everything(store: TrajectoryStore) -> None:
    rows = corpus()
    for t in rows:
        store.put(t)
    assert store.count() == len(rows) == len(store.query()) == len(store.summaries())


def test_ordering_and_pagination(store: TrajectoryStore) -> None:
    rows = corpus()
    for t in reversed(rows):
        store.put(t)
    got = store.query()
    keys = [order_key(t) for t in got]
    assert keys == sorted(keys)  # numeric, not text order: 2 < 10
    assert keys[0][0] == 0 and keys[-1][0] == 10
    assert [order_key(s) for s in store.summaries()] == keys

    pages = [store.query(limit=7, offset=o) for o in range(0, len(rows), 7)]
    assert [len(p) for p in pages] == [7] * 6 + [6]
    assert [t.id for p in pages for t in p] == [t.id for t in got]
    assert [s.id for s in store.summaries(limit=5, offset=3)] == [t.id for t in got[3:8]]
    assert store.query(offset=len(rows)) == []


def test_summaries_match_full_rows(store: TrajectoryStore) -> None:
    rows = corpus()
    for t in rows:
        store.put(t)
    full = {t.id: t for t in rows}
    summaries = store.summaries()
    assert len(summaries) == len(rows)
    assert any(s.n_steps > 0 and s.prompt_tokens > 0 and s.completion_tokens > 0 for s in summaries)
    for s in summaries:
        t = full[s.id]
        for field in dataclasses.fields(TrajectorySummary):
            assert getattr(s, field.name) == getattr(t, field.name), field.name
        assert type(s.success) is bool and isinstance(s.created_at, datetime)
    with pytest.raises(dataclasses.FrozenInstanceError):
        summaries[0].status = "error"  # type: ignore[misc]


def test_export_jsonl_round_trip(store: TrajectoryStore, tmp_path: Path) -> None:
    rows = corpus()
    for t in rows:
        store.put(t)
    out = tmp_path / "exports" / "train.jsonl"
    out.parent.mkdir()
    out.write_text("stale content\n")

    n = store.export_jsonl(out, evolution="evo-a", split="train")
    expected = store.query(evolution="evo-a", split="train")
    lines = out.read_text(encoding="utf-8").splitlines()
    assert n == len(expected) == len(lines) > 0  # newlines in observations stay escaped
    assert [Trajectory.model_validate_json(line) for line in lines] == expected
    assert all(json.loads(line)["steps"] is not None for line in lines)
    assert list(out.parent.iterdir()) == [out]  # no temp file left behind

    assert store.export_jsonl(out, evolution="nobody") == 0
    assert out.read_text() == ""


def test_concurrent_writes_all_land(store: TrajectoryStore) -> None:
    threads, per_thread = 8, 25
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []
    written: dict[str, Trajectory] = {}
    shared_id = make(evolution="shared").id

    def work(k: int) -> None:
        try:
            mine = [
                make(evolution=f"evo-{k}", generation=k, seed=j, rollout=j, n_steps=j % 3)
                for j in range(per_thread)
            ]
            barrier.wait()
            for t in mine:
                store.put(t)
                store.put(make(evolution="shared", score=k / 10))  # contended row
            assert store.finished_ids(t.id for t in mine) == {t.id for t in mine}
            written.update((t.id, t) for t in mine)
        except BaseException as e:  # surfaced below: a thread's exception is otherwise lost
            errors.append(e)

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=120)
    assert not errors, errors
    assert len(written) == threads * per_thread

    assert store.count() == threads * per_thread + 1
    got = {t.id: t for t in store.query() if t.id != shared_id}
    assert got == written
    shared = store.get(shared_id)
    assert shared is not None and shared.score in {k / 10 for k in range(threads)}


def test_data_survives_reopening(open_backend: Callable[[], TrajectoryStore]) -> None:
    first = open_backend()
    rows = corpus()[:10]
    for t in rows:
        first.put(t)
    first.close()

    second = open_backend()
    assert second.count() == len(rows)
    assert sorted(second.query(), key=lambda t: t.id) == sorted(rows, key=lambda t: t.id)
    extra = make(evolution="after-reopen")
    second.put(extra)
    second.close()

    third = open_backend()
    assert third.get(extra.id) == extra
    assert third.count() == len(rows) + 1


# ---------------------------------------------------------------- SQLite specifics


def test_sqlite_file_layout(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "t.db"
    with SQLiteTrajectoryStore(path) as store:
        store.put(make(n_steps=3))
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert tables == {"trajectories", "schema_version", "diagnoses"}  # steps: only in the JSON column
        columns = {r[1] for r in db.execute("PRAGMA table_info(trajectories)")}
        assert "steps" not in columns and "data" in columns
        indexed = {r[1] for r in db.execute("PRAGMA index_list(trajectories)")}
        assert len(indexed) >= 5
    finally:
        db.close()


def test_sqlite_export_failure_leaves_old_file(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    with SQLiteTrajectoryStore(path) as store:
        for t in corpus()[:5]:
            store.put(t)
        last = store.query()[-1]
        db = sqlite3.connect(path)
        db.execute("UPDATE trajectories SET data = '{not json' WHERE id = ?", (last.id,))
        db.commit()
        db.close()

        out = tmp_path / "out" / "x.jsonl"
        out.parent.mkdir()
        out.write_text("previous export\n")
        with pytest.raises(ValueError):
            store.export_jsonl(out)
        assert out.read_text() == "previous export\n"
        assert list(out.parent.iterdir()) == [out]


def test_sqlite_rejects_other_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    SQLiteTrajectoryStore(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    db.commit()
    db.close()
    with pytest.raises(ConfigError, match="schema version"):
        SQLiteTrajectoryStore(path)


def test_sqlite_rejects_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("x" * 4096)
    with pytest.raises(ConfigError, match="cannot open trajectory store"):
        SQLiteTrajectoryStore(path)
    assert path.read_text() == "x" * 4096


def test_closed_store_refuses_use(tmp_path: Path) -> None:
    store = SQLiteTrajectoryStore(tmp_path / "t.db")
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.put(make())


# ---------------------------------------------------------------- open_store


def test_open_store_paths_and_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = make()
    with closing(open_store(tmp_path / "p.db")) as s:
        assert isinstance(s, TrajectoryStore)
        s.put(t)
    with closing(open_store(f"sqlite:///{tmp_path / 'p.db'}")) as s:  # sqlite:////abs/path
        assert s.get(t.id) == t
    monkeypatch.chdir(tmp_path)
    with closing(open_store("sqlite:///rel/q.db")) as s:
        s.put(t)
    assert (tmp_path / "rel" / "q.db").exists()


@pytest.mark.parametrize(
    "url", ["postgresql://ratchet:s3cret@db.internal/ratchet", "mysql://h/db", "sqlite://x.db"]
)
def test_open_store_rejects_unsupported_urls(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        open_store(url)
    message = str(err.value)
    assert "\n" not in message and "s3cret" not in message
    assert "sqlite:///" in message  # says what to do instead


def test_finished_ids_of_one_policy_version(store: TrajectoryStore) -> None:
    """Resume skips only rollouts the same policy played: another version's rows are redone."""
    old = make(rollout=0, policy_version="v1")
    new = make(rollout=1, policy_version="v2")
    failed = make(rollout=2, policy_version="v2", status="error")
    for t in (old, new, failed):
        store.put(t)
    ids = [old.id, new.id, failed.id]
    assert store.finished_ids(ids, policy_version="v2") == {new.id}
    assert store.finished_ids(ids, policy_version="v1") == {old.id}
    assert store.finished_ids(ids) == {old.id, new.id}


def test_diagnoses_are_stored_beside_trajectories_idempotently(
    open_backend: Callable[[], TrajectoryStore],
) -> None:
    from ratchet.types import Diagnosis

    def d(tid: str, gen: int, mode: str, cause: str = "") -> Diagnosis:
        return Diagnosis(trajectory_id=tid, evolution="e", generation=gen, task_id="s:x:train:1",
                         subset="x", mode=mode, cause=cause)  # type: ignore[arg-type]  # fmt: skip

    store = open_backend()
    store.put_diagnoses([d("a", 0, "stagnation"), d("b", 0, "invalid_action"), d("c", 1, "stagnation")])
    store.put_diagnoses([d("a", 0, "stagnation", cause="looped")])  # a rerun rewrites, never duplicates
    assert [x.trajectory_id for x in store.diagnoses("e")] == ["a", "b", "c"]
    assert [x.trajectory_id for x in store.diagnoses("e", generation=0, mode="stagnation")] == ["a"]
    assert store.diagnoses("other") == []
    store.close()
    reopened = open_backend()
    assert reopened.diagnoses("e", 0)[0].cause == "looped"
    reopened.close()
