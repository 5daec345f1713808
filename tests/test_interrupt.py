"""Ctrl-C in the middle of a Prefect stage, the way a user presses it: the real CLI, a real
SIGINT to the ratchet process, then the same command again.

The run must stop (not finish the stage, not start the next), say so in one line (exit 130),
keep every rollout it finished, and the rerun must resume from them: no rollout played twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cli import RATCHET, ratchet

EXPLORE = ("--suite", "textworld-express:coin", "explore", "--train", "3", "-k", "2")  # 6 rollouts


def _finished(db: Path) -> list[tuple[str, int]]:
    """(task, rollout index) of every finished agent rollout stored so far (explore also
    stores the suite's expert path per task, as rollout -1)."""
    from ratchet.memory.trajectory_store import open_store

    if not db.is_file():
        return []
    store = open_store(str(db))
    try:
        return [(t.task_id, t.rollout) for t in store.summaries(status="finished") if t.kind == "agent"]
    finally:
        store.close()


@pytest.mark.integration
# ~2 min of a real explore; CI checks the signal path (below) and resuming (test_flows, test_evolve)
@pytest.mark.slow
def test_ctrl_c_during_explore_stops_in_one_line_and_the_rerun_resumes(
    tmp_path: Path, embedded_server: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "PREFECT_", "MLFLOW_"))}
    args = [RATCHET, "--data-dir", str(tmp_path / "data"), "--endpoint", embedded_server, *EXPLORE]
    # the child must see SIGINT as a terminal's Ctrl-C does: not ignored (a shell's background
    # job would start with SIGINT ignored, and Python then never raises KeyboardInterrupt)
    proc = subprocess.Popen(
        args,
        cwd=tmp_path,
        env={**env, "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    db = tmp_path / "data" / "trajectories.db"
    try:
        while proc.poll() is None and not _finished(db):  # Prefect's start and the first rollout
            time.sleep(0.5)
        assert proc.poll() is None, "explore ended before the first rollout was stored"
        proc.send_signal(signal.SIGINT)
        out, errors = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stopped = _finished(db)
    assert proc.returncode == 130, errors[-3000:]
    assert "interrupted: finished rollouts are stored; run the same command again" in errors
    # rollouts in flight when the store closed end quietly; only Prefect's own crash line remains
    loud = [ln for ln in errors.splitlines() if "ERROR" in ln and "aborted by an interrupt signal" not in ln]
    assert not loud and "Traceback" not in errors, errors[-3000:]
    assert 1 <= len(stopped) < 6, f"the stage ran on after Ctrl-C: {len(stopped)} of 6 rollouts"

    rerun = ratchet("--endpoint", embedded_server, *EXPLORE, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    after = _finished(db)
    assert len(after) == len(set(after)) == 6, after  # every slot once: none replayed, none lost
    assert set(stopped) <= set(after)


_PRESS = """
import os, signal, time
from ratchet.shutdown import stop_on_signals, stopping
stop_on_signals()
try:
    os.kill(os.getpid(), signal.{sig})
    time.sleep(5)
    print("ran on", stopping())
except KeyboardInterrupt:
    print("interrupted", stopping())
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_and_kill_mark_the_process_stopping_before_they_unwind(sig: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PRESS.format(sig=sig)],
        capture_output=True,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert out.stdout.split() == ["interrupted", "True"], out.stderr


def test_a_sigint_the_process_was_started_to_ignore_stays_ignored() -> None:
    """A shell's background job starts with SIGINT ignored: the terminal's Ctrl-C is not for it."""
    out = subprocess.run(
        [sys.executable, "-c", _PRESS.format(sig="SIGINT").replace("time.sleep(5)", "time.sleep(0.2)")],
        capture_output=True,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert out.stdout.split() == ["ran", "on", "False"], out.stderr
