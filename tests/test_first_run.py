"""A first run in a new data dir, on a machine whose cores are busy, the way it once failed.

Prefect's ephemeral API server migrates a new database before it answers (10 s quiet, 23 s
on a busy 2-core machine) and Prefect gives it 20 s: the first flow of a new data dir
crashed with "Timed out while attempting to connect to ephemeral Prefect API server".
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.test_cli import assert_one_line_error, ratchet


@contextmanager
def busy_cores(per_core: int = 1) -> Iterator[None]:
    """Keep every core busy (`per_core` spinning processes each) for the block's duration."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(per_core * (os.cpu_count() or 2))
    ]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


@pytest.mark.integration
def test_the_first_flow_in_a_new_data_dir_runs_while_every_core_is_busy(
    tmp_path: Path, embedded_server: str
) -> None:
    with busy_cores():
        proc = ratchet(
            "--endpoint",
            embedded_server,
            "--suite",
            "reasoning-gym:chain_sum",
            "evaluate",
            "--test",
            "1",
            cwd=tmp_path,
            env={"RATCHET_MAX_STEPS": "1"},  # what is tested is the start-up; one step is enough
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Timed out" not in proc.stderr
    assert "evaluate" in proc.stdout
    assert (tmp_path / "data" / "prefect" / "prefect.db").is_file()  # the new Prefect database


def test_a_prefect_server_that_never_answers_is_one_line(tmp_path: Path) -> None:
    # A limit of 1 s makes any real start too slow: the failure path, without waiting 10 min.
    env = {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1"}
    proc = ratchet("--suite", "reasoning-gym:chain_sum", "evaluate", "--test", "1", cwd=tmp_path, env=env)
    assert_one_line_error(proc, "Prefect's API server did not start within 1 s", "PREFECT_API_URL")
    assert not (tmp_path / "data" / "models").exists()  # no model server was started for nothing
