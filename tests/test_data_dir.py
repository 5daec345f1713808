"""The data dir as an input: a path with characters URLs treat specially keeps every store
inside it; a damaged or read-only MLflow database and a data dir that cannot be created or
written are one `error:` line, exit 2, with nothing written. Through the real `ratchet`."""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from ratchet.config import load_settings

RATCHET = str(Path(sys.executable).parent / "ratchet")
# what the review used, and every character a URL parser treats specially, plus non-ASCII
ODD_NAMES = ["q?x", "h#sh", "pct%41", "pct%", "sp ace", "ünï-ç", "semi;colon@at:colon&a=b", "new\nline"]
ODD = "q?x #h%41 é"


def clean_env() -> dict[str, str]:
    """The CLI must work from a clean environment: it puts its services' state in the data dir."""
    env = {
        k: v for k, v in os.environ.items() if not k.upper().startswith(("RATCHET_", "PREFECT_", "MLFLOW_"))
    }
    return env | {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "COLUMNS": "200"}


def run(argv: Sequence[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=600)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its bytes (None for a directory): what "nothing written" compares."""
    return {
        str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes())
        for p in sorted(root.rglob("*"))
        if not p.is_symlink()
    }


# --- simulating a read-only file or directory -----------------------------------------------

ROOT = os.geteuid() == 0


def _unshare_works() -> bool:
    try:
        return (
            subprocess.run(["unshare", "-m", "--propagation", "private", "true"], timeout=30).returncode == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


@contextmanager
def read_only(*paths: Path) -> Iterator[list[str]]:
    """Yield an argv prefix under which `paths` are read-only. As root, permission bits stop
    nothing, so the paths are bound read-only in a private mount namespace (`unshare -m`);
    otherwise their modes are dropped to read-only for the duration."""
    if ROOT:
        if not _unshare_works():
            pytest.skip("running as root without `unshare -m`: a read-only path cannot be simulated")
        binds = " && ".join(
            f"mount --bind {shlex.quote(str(p))} {shlex.quote(str(p))} && "
            f"mount -o remount,bind,ro {shlex.quote(str(p))}"
            for p in paths
        )
        yield ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{binds} && exec "$@"', "sh"]
        return
    modes = {p: p.stat().st_mode for p in paths}
    for p in paths:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        yield []
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


# --- a path with odd characters keeps every store inside it ---------------------------------


@pytest.mark.parametrize("name", ODD_NAMES)
def test_the_mlflow_uri_names_the_database_inside_the_data_dir(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # SQLAlchemy (which MLflow hands the URI to) cuts a URL's path at '?' and unquotes '%xx'
    monkeypatch.chdir(tmp_path)
    for data in (tmp_path / name / ".ratchet", Path("x") / name / ".ratchet"):
        s = load_settings({"data_dir": data})
        assert make_url(s.mlflow_uri).database == str((data / "mlflow.db").resolve())
        assert "\n" not in s.mlflow_uri and " " not in s.mlflow_uri  # one word, for `mlflow ui`


def _outside(root: Path, data: Path) -> list[str]:
    """Every path under `root` (directories too) that is neither in `data` nor on the way to it."""
    return sorted(str(p) for p in root.rglob("*") if not p.is_relative_to(data) and p not in data.parents)


@pytest.mark.parametrize("name", ODD_NAMES)
def test_mlflow_makes_no_directory_outside_the_data_dir(name: str, tmp_path: Path):
    """MLflow makes the parent of the database before SQLAlchemy reads the URL, from the URL's
    path as written (still percent-encoded): `x/q%3Fx/.ratchet` appeared beside `x/q?x`."""
    from mlflow.store.db.utils import _make_parent_dirs_if_sqlite

    data = tmp_path / "x" / name / ".ratchet"
    data.mkdir(parents=True)  # the pre-flight makes it first
    _make_parent_dirs_if_sqlite(load_settings({"data_dir": data}).mlflow_uri)
    assert _outside(tmp_path, data) == []


def test_the_cli_makes_no_directory_outside_an_odd_data_dir(tmp_path: Path):
    for name in ("q?x", ODD):  # the review's path, and every special character at once
        data = Path("x") / name / ".ratchet"
        proc = run([RATCHET, "--data-dir", str(data), "adapters", "list"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / data / "mlflow.db").is_file()
        assert _outside(tmp_path, tmp_path / data) == []
        shutil.rmtree(tmp_path / "x")


def test_a_real_mlflow_run_under_an_odd_data_dir_stays_inside_it(tmp_path: Path):
    """The review's repro (`--data-dir 'x/q?x/.ratchet'` made a database file `x/q`), then a
    run with a metric and an artifact through ratchet's own MLflow set-up."""
    data = Path("x") / ODD / ".ratchet"
    proc = run([RATCHET, "--data-dir", str(data), "adapters", "list"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    script = textwrap.dedent(
        f"""
        import mlflow
        from ratchet.config import load_settings
        from ratchet.flows import tracking
        from ratchet.runtime_env import prepare_environment
        from ratchet.training.registry import AdapterRegistry

        settings = load_settings({{"data_dir": {str(data)!r}, "trace_sample_rate": 0}})
        prepare_environment(settings)
        with tracking.generation_run(settings, 0) as run_id:
            mlflow.log_metric("success", 0.5)
            mlflow.log_text("hello", "notes/a.txt")
        assert AdapterRegistry(settings).list() == []
        client = mlflow.tracking.MlflowClient(settings.mlflow_uri)
        assert client.get_run(run_id).data.metrics["success"] == 0.5
        assert mlflow.artifacts.load_text(f"runs:/{{run_id}}/notes/a.txt") == "hello"
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    files = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()]
    inside = str(data) + "/"
    assert f"{inside}mlflow.db" in files
    assert [f for f in files if not f.startswith(inside)] == []  # no `x/q`, no ./mlruns


def test_trajectories_chroma_and_prefect_stay_inside_an_odd_data_dir(tmp_path: Path):
    data = tmp_path / ODD / ".ratchet"
    script = textwrap.dedent(
        f"""
        import json
        from contextlib import closing
        from sqlalchemy.engine import make_url
        from ratchet.config import load_settings
        from ratchet.runtime_env import prepare_environment
        settings = load_settings({{"data_dir": {str(data)!r}}})
        prepare_environment(settings)

        from ratchet.memory.trajectory_store import open_store
        from ratchet.memory.vector_index import VectorIndex
        from tests.factories import traj
        with closing(open_store(settings.trajectories_db)) as store:
            store.put(traj(["take coin"], success=True, tid="t1"))
        VectorIndex(settings.index_dir, "skills").upsert(["a"], ["pick up the coin first"])

        from prefect.settings import get_current_settings
        prefect = get_current_settings()
        url = prefect.server.database.connection_url.get_secret_value()
        print(json.dumps({{"home": str(prefect.home), "db": make_url(url).database}}))
        """
    )
    env = clean_env() | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    prefect = json.loads(proc.stdout.strip().splitlines()[-1])
    assert prefect == {"home": str(data / "prefect"), "db": str(data / "prefect" / "prefect.db")}
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert data / "trajectories.db" in files and any(p.is_relative_to(data / "index") for p in files)
    assert [p for p in files if not p.is_relative_to(data)] == []


# --- a damaged or read-only MLflow database -------------------------------------------------


def _garbage() -> bytes:
    return random.Random(7).randbytes(8192)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(_garbage(), id="random-bytes"),
        pytest.param(b"this is not a database\n", id="text"),
        pytest.param(b"SQLite format 3\x00" + _garbage(), id="sqlite-header-then-garbage"),
    ],
)
def test_a_damaged_mlflow_database_is_one_line(content: bytes, tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "mlflow.db").write_bytes(content)
    before = tree(tmp_path)
    proc = run([RATCHET, "--data-dir", str(data), "adapters", "list"], cwd=tmp_path)
    assert_one_line_error(proc, f"the MLflow database {data / 'mlflow.db'} is damaged", "move it aside")
    assert tree(tmp_path) == before


def _sqlite_db(path: Path) -> None:
    """A valid SQLite file that is not yet an MLflow store: MLflow must write to set it up."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE other (x INTEGER)")
    conn.close()


@pytest.mark.parametrize("what", ["empty-database", "sqlite-database", "data-dir"])
def test_a_read_only_mlflow_database_or_data_dir_is_one_line(what: str, tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    db = data / "mlflow.db"
    if what == "empty-database":
        db.touch()
    else:
        _sqlite_db(db)
    before = tree(tmp_path)
    with read_only(data if what == "data-dir" else db) as prefix:
        proc = run([*prefix, RATCHET, "--data-dir", str(data), "adapters", "list"], cwd=tmp_path)
    if what == "data-dir":
        assert_one_line_error(proc, f"the data dir {data} is read-only")
    else:
        assert_one_line_error(proc, f"the MLflow database {db} is read-only")
    assert tree(tmp_path) == before


# --- a data dir that cannot be created ------------------------------------------------------


@pytest.mark.parametrize("what", ["read-only-parent", "a-file-in-the-way", "the-data-dir-is-a-file"])
def test_a_data_dir_that_cannot_be_created_is_one_line(what: str, tmp_path: Path):
    parent = tmp_path / "parent"
    parent.mkdir()
    prefix: list[str] = []
    if what == "read-only-parent":
        data = parent / "new" / ".ratchet"
    elif what == "a-file-in-the-way":
        (parent / "file").write_text("x")
        data = parent / "file" / ".ratchet"
    else:
        data = parent / "file"
        data.write_text("x")
    before = tree(tmp_path)
    if what == "read-only-parent":
        with read_only(parent) as prefix:
            proc = run([*prefix, RATCHET, "--data-dir", str(data), "adapters", "list"], cwd=tmp_path)
    else:
        proc = run([RATCHET, "--data-dir", str(data), "adapters", "list"], cwd=tmp_path)
    line = assert_one_line_error(proc, f"the data dir {data}")
    assert "--data-dir" in line  # what to do
    assert tree(tmp_path) == before


def test_a_path_holding_a_newline_is_still_one_line(tmp_path: Path):
    data = tmp_path / "bad\nname"
    data.write_text("x")
    proc = run([RATCHET, "--data-dir", str(data), "adapters", "list"], cwd=tmp_path)
    assert_one_line_error(proc, "bad\\nname is a file")
