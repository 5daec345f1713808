"""Bad settings and damaged state are one line, found before a model server or Prefect starts.

Each test runs the real `ratchet` command on a data dir prepared the way a user (or a
kill, or a disk) would leave it, and asserts: exit code 2, one `error:` line naming the
file and the fix, fast (nothing heavy started), and nothing new written.
"""

from __future__ import annotations

import socket
import sqlite3
import time
from pathlib import Path

import pytest

from ratchet.config import load_settings
from ratchet.memory.trajectory_store import open_store
from tests.factories import traj
from tests.test_cli import assert_one_line_error, ratchet

# Every refusal here happens before the model server (20+ s) or Prefect (10+ s) could start;
# generous for a loaded machine, far below what starting either would cost there.
QUICK_S = 60


def _timed(*args: str, cwd: Path):  # type: ignore[no-untyped-def]
    start = time.monotonic()
    proc = ratchet(*args, cwd=cwd)
    return proc, time.monotonic() - start


def _nothing_started(data: Path) -> None:
    assert not (data / "prefect").exists(), "Prefect's database was created"
    assert not (data / "mlflow.db").exists() and not (data / "models").exists()


def test_an_unknown_key_inside_a_table_is_an_error_not_ignored(tmp_path: Path) -> None:
    (tmp_path / "ratchet.toml").write_text("[model]\nendpont = 'http://127.0.0.1:8000/v1'\n")
    proc = ratchet("explore", cwd=tmp_path)
    assert_one_line_error(proc, "invalid setting model.endpont", "Extra inputs are not permitted")
    (tmp_path / "ratchet.toml").write_text("[finetune.lora]\nrnak = 8\n")
    assert_one_line_error(ratchet("explore", cwd=tmp_path), "invalid setting finetune.lora.rnak")


@pytest.mark.parametrize(
    "args, needle",
    [(["explore", "--train", "0"], "splits.train"), (["evaluate", "--test", "0"], "splits.test")],
)
def test_zero_size_splits_are_refused(tmp_path: Path, args: list[str], needle: str) -> None:
    proc, _ = _timed(*args, cwd=tmp_path)
    assert_one_line_error(proc, f"invalid setting {needle}", "greater than or equal to 1")
    _nothing_started(tmp_path / "data")


def test_a_dev_split_too_small_for_the_gate_is_refused_before_start_up(tmp_path: Path) -> None:
    proc, seconds = _timed("verify", "--dev", "3", cwd=tmp_path)
    assert_one_line_error(proc, "too few tasks for the gate", "splits.dev to at least 5")
    assert seconds < QUICK_S
    _nothing_started(tmp_path / "data")


def test_a_torn_skill_audit_log_is_one_line_for_every_command(tmp_path: Path) -> None:
    audit = tmp_path / "data" / "skills" / "audit.jsonl"
    audit.parent.mkdir(parents=True)
    audit.write_text('{"skill": "a", "from_status": null, "to_status": "candidate", "who": "d", "why"')
    for args in (["skills", "list"], ["skills", "promote", "a", "-r", "x"], ["explore"]):
        proc, seconds = _timed(*args, cwd=tmp_path)
        assert_one_line_error(proc, f"{audit} ends in a torn line 1", "sed -i '1d'")
        assert seconds < QUICK_S
    assert not (tmp_path / "data" / "prefect").exists() and not (tmp_path / "data" / "models").exists()


def _damaged_store(data: Path) -> Path:
    db = data / "trajectories.db"
    store = open_store(db)
    for i in range(60):
        store.put(traj(["move north"] * 10, success=i % 2 == 0, tid=f"t{i}", observations=["x" * 400] * 10))
    store.close()
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    raw = bytearray(db.read_bytes())
    page = 4096
    assert len(raw) > 8 * page
    raw[3 * page : 6 * page] = b"\xde\xad\xbe\xef" * (3 * page // 4)  # three pages of table data
    db.write_bytes(bytes(raw))
    return db


def test_a_damaged_trajectory_database_is_one_line_with_the_recovery(tmp_path: Path) -> None:
    db = _damaged_store(tmp_path / "data")
    for args in (["trajectories", "list"], ["trajectories", "export", str(tmp_path / "out.jsonl")]):
        proc = ratchet(*args, cwd=tmp_path)
        assert_one_line_error(proc, f"the trajectory database {db} is damaged", ".recover")
    assert not (tmp_path / "out.jsonl").exists()
    proc, seconds = _timed("explore", cwd=tmp_path)  # found by the preflight, not mid-run
    assert_one_line_error(proc, "is damaged", ".recover")
    assert seconds < QUICK_S
    _nothing_started(tmp_path / "data")


def test_an_unreadable_journal_is_refused_before_start_up(tmp_path: Path) -> None:
    journal = load_settings({"data_dir": tmp_path / "data"}).evolve_journal
    journal.parent.mkdir(parents=True)
    journal.write_text('{"stages": [{"generation": 0, "sta')
    proc, seconds = _timed("evolve", cwd=tmp_path)
    assert_one_line_error(proc, f"the evolution journal {journal} is unreadable", "move it away")
    assert seconds < QUICK_S
    assert journal.read_text() == '{"stages": [{"generation": 0, "sta'  # never rewritten
    _nothing_started(tmp_path / "data")


def test_a_changed_champion_adapter_is_refused_before_start_up(tmp_path: Path) -> None:
    from ratchet.training.registry import AdapterRegistry
    from tests.test_adapter_registry import _passed

    registry = AdapterRegistry(load_settings({"data_dir": tmp_path / "data"}))
    version = _passed(registry, tmp_path, 1)
    registry.transition(str(version), "promoted", who="ann", why="ship")
    path = registry.checked_path(registry.get(version))
    (path / "adapter_model.safetensors").write_bytes(b"swapped")
    proc, seconds = _timed("evaluate", cwd=tmp_path)
    assert_one_line_error(proc, f"adapter version {version}", "the files changed", "roll back")
    assert seconds < QUICK_S
    assert not (tmp_path / "data" / "prefect").exists() and not (tmp_path / "data" / "models").exists()


@pytest.mark.parametrize(
    "command, fix", [("api", "pass --port"), ("dashboard", "dashboard.port"), ("serve", "pass --port")]
)
def test_a_taken_port_names_the_setting_that_moves_this_server(
    tmp_path: Path, command: str, fix: str
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = ratchet(command, "--port", str(port), cwd=tmp_path)
    assert_one_line_error(proc, f"port {port}", "already in use", fix)
    assert "model.port" not in proc.stderr


# ---------------------------------------------------------------- state files an attacker shapes


def test_the_atomic_write_never_follows_a_link_planted_at_its_temporary_path(tmp_path: Path) -> None:
    from ratchet.files import write_text_atomic

    victim = tmp_path / "outside" / "victim.txt"
    victim.parent.mkdir()
    victim.write_text("precious")
    journal = load_settings({"data_dir": tmp_path / "data"}).evolve_journal
    journal.parent.mkdir(parents=True)
    for planted in (f".{journal.name}.tmp", f".{journal.name}.tmp.tmp"):  # the old name, and a guess
        (journal.parent / planted).symlink_to(victim)
    (journal.parent / ".dangling.tmp").symlink_to(tmp_path / "outside" / "created-by-the-write")
    write_text_atomic(journal, '{"stages": []}')
    write_text_atomic(journal.parent / "dangling", "x")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "outside" / "created-by-the-write").exists()
    assert journal.read_text() == '{"stages": []}' and not journal.is_symlink()
    leftovers = {p.name for p in journal.parent.iterdir()} - {journal.name, "dangling"}
    assert leftovers == {f".{journal.name}.tmp", f".{journal.name}.tmp.tmp", ".dangling.tmp"}  # never written


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    from ratchet.files import write_text_atomic

    target = tmp_path / "state.json"
    target.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(target, "\udcff")  # a lone surrogate cannot be written
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_journal_nested_deep_is_one_line_before_start_up(tmp_path: Path) -> None:
    journal = load_settings({"data_dir": tmp_path / "data"}).evolve_journal
    journal.parent.mkdir(parents=True)
    body = '{"evolution": "default", "stages": [{"generation": 0, "stage": "evaluate", "summary": '
    journal.write_text(body + "[" * 100_000 + "]" * 100_000 + "}]}")
    proc, seconds = _timed("evolve", cwd=tmp_path)
    assert_one_line_error(
        proc, f"the evolution journal {journal} is unreadable", "nested too deep", "move it"
    )
    assert seconds < QUICK_S
    _nothing_started(tmp_path / "data")


@pytest.mark.parametrize("depth", [100_000, 2_000, 500])
def test_loading_a_deep_journal_in_process_is_a_state_file_error(tmp_path: Path, depth: int) -> None:
    from ratchet.errors import StateFileError
    from ratchet.flows.journal import Journal

    settings = load_settings({"data_dir": tmp_path})
    settings.evolve_journal.parent.mkdir(parents=True)
    summary = "[" * depth + "]" * depth
    settings.evolve_journal.write_text(
        f'{{"stages": [{{"generation": 0, "stage": "x", "summary": {{"a": {summary}}}, '
        '"wall_seconds": 1, "finished_at": "t"}]}'
    )
    with pytest.raises(StateFileError, match="nested too deep"):
        Journal.load(settings)


@pytest.mark.parametrize("which", ["journal", "trajectories.db", "audit log"])
def test_a_state_file_that_is_a_directory_fails_the_preflight_in_one_line(tmp_path: Path, which: str) -> None:
    from ratchet.errors import StateFileError
    from ratchet.flows.runtime import check_state_files

    settings = load_settings({"data_dir": tmp_path / "data"})
    path = {
        "journal": settings.evolve_journal,
        "trajectories.db": settings.trajectories_db,
        "audit log": settings.skills_dir / "audit.jsonl",
    }[which]
    path.mkdir(parents=True)
    with pytest.raises(StateFileError) as err:
        check_state_files(settings)
    assert f"{path} is not a regular file" in str(err.value) and "\n" not in str(err.value)


def test_a_journal_that_is_a_directory_is_refused_by_the_cli_before_start_up(tmp_path: Path) -> None:
    journal = load_settings({"data_dir": tmp_path / "data"}).evolve_journal
    journal.mkdir(parents=True)
    proc, seconds = _timed("evolve", cwd=tmp_path)
    assert_one_line_error(proc, f"{journal} is not a regular file", "move it")
    assert seconds < QUICK_S
    _nothing_started(tmp_path / "data")
