"""`ratchet doctor` as a new user runs it on their own agent's configuration: every problem one
line, exit 2, in seconds, and nothing started or written (no data dir, no Prefect, no MLflow, no
model server, no process left behind)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "units"
RATCHET = str(Path(sys.executable).parent / "ratchet")

# Runs the doctor as its child with this process a subreaper: a service the doctor started and
# left running (Prefect's API, MLflow's server, the model server, the endpoint) would be
# reparented here and is listed, then stopped.
WATCH = textwrap.dedent(
    """
    import ctypes, json, os, subprocess, sys
    import psutil
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
    while True:  # reap what ended after its parent did (a zombie ran and is gone)
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    left = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    names = [" ".join(p.cmdline()[:3]) for p in left]
    for p in left:
        p.kill()
    print(json.dumps({"rc": proc.returncode, "out": proc.stdout, "err": proc.stderr, "left": names}))
    """
)

LANGGRAPH = """
[tasks]
file = "tasks.jsonl"
score = "score:score"
max_steps = 4

[agent]
entry = "langgraph_agent:build"
kind = "langgraph"
"""


@pytest.fixture
def user(tmp_path: Path) -> Path:
    """A user's folder: the units example's LangGraph agent, task file and scoring function."""
    for name in ("tasks.jsonl", "score.py", "units.py", "langgraph_agent.py"):
        shutil.copy(EXAMPLE / name, tmp_path / name)
    (tmp_path / "home").mkdir()
    return tmp_path


def doctor(cwd: Path, config: str) -> tuple[subprocess.CompletedProcess[str], list[str], float]:
    (cwd / "ratchet.toml").write_text(textwrap.dedent(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "PREFECT_", "MLFLOW_"))}
    env |= {"HOME": str(cwd / "home"), "COLUMNS": "200"}
    started = time.monotonic()
    watched = subprocess.run(
        [sys.executable, "-c", WATCH, RATCHET, "doctor"], cwd=cwd, env=env, capture_output=True, text=True
    )
    seconds = time.monotonic() - started
    assert watched.returncode == 0, watched.stderr
    out = json.loads(watched.stdout)
    proc = subprocess.CompletedProcess(["ratchet", "doctor"], out["rc"], out["out"], out["err"])
    return proc, out["left"], seconds


def assert_nothing_started(cwd: Path, left: list[str]) -> None:
    assert left == []  # no service, server or JVM outlives the doctor
    assert not (cwd / ".ratchet").exists()  # no data dir: no Prefect home, no MLflow store, no logs
    made = {p.name for p in cwd.iterdir()} - {"__pycache__"}  # Python's, importing the user's modules
    assert made == {"tasks.jsonl", "score.py", "units.py", "langgraph_agent.py", "home", "ratchet.toml"}
    assert list((cwd / "home").iterdir()) == []  # no ~/.prefect, no ~/.mlflow


@pytest.mark.integration  # the doctor checks the installed suites too: Java for TextWorldExpress
@pytest.mark.parametrize(
    ("config", "says"),
    [
        (LANGGRAPH.replace("max_steps = 4", "max_steps = 4\nbogus = 1"), "invalid setting tasks.bogus"),
        (LANGGRAPH.replace('"tasks.jsonl"', '"missing.jsonl"'), "cannot read task file missing.jsonl"),
        (LANGGRAPH.replace("langgraph_agent:build", "my_agent:build"), "cannot load agent 'my_agent:build'"),
        (LANGGRAPH.replace("score:score", "score:nope"), "cannot load scoring function 'score:nope'"),
        (LANGGRAPH + "[splits]\ntest = 51\n", "has 50 test tasks"),  # this file splits 50/50/50
        (LANGGRAPH + "[splits]\ndev = 4\n", "too few tasks for the gate"),
        (LANGGRAPH + "[splits]\ndev = 51\n", "has 50 dev tasks"),  # the gate's split, checked too
        ('data_dir = "score.py"\n' + LANGGRAPH, "the data dir score.py is a file"),
    ],
    ids=["bad-key", "no-tasks", "no-entry", "no-scorer", "big-test", "small-dev", "big-dev", "data-dir"],
)
def test_a_bad_configuration_is_one_line_and_exit_2_with_nothing_started(
    user: Path, config: str, says: str
) -> None:
    proc, left, seconds = doctor(user, config)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("error:") and says in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "ratchet is installed" not in proc.stdout
    assert seconds < 60  # seconds on an idle machine; a run's services would take minutes
    assert_nothing_started(user, left)


@pytest.mark.integration
def test_every_problem_is_its_own_line(user: Path) -> None:
    """A missing task file and a missing entry module: two lines, not the first one only."""
    config = LANGGRAPH.replace('"tasks.jsonl"', '"missing.jsonl"').replace("langgraph_agent", "my_agent")
    proc, left, _ = doctor(user, config)
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(errors) == 2, proc.stderr
    assert "missing.jsonl" in errors[0] and "'my_agent:build'" in errors[1]
    assert left == [] and not (user / ".ratchet").exists()


@pytest.mark.integration
def test_a_good_configuration_prints_the_files_split_counts(user: Path) -> None:
    proc, left, _ = doctor(user, LANGGRAPH + "[splits]\ntrain = 24\ndev = 32\ntest = 50\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "tasks:tasks holds train 50 / dev 50 / test 50 (splits set: train 24 / dev 32 / test 50)"
        in proc.stdout
    )
    assert "passes a run's pre-flight" in proc.stdout
    assert left == [] and not (user / ".ratchet").exists()
