"""The loop never hangs, and a run that does is ended, not waited on.

* MLflow's lock-order deadlock between a gate evaluation (the loop's thread) and the trace
  exporter (MLflow's thread), forced in a child process, then stressed.
* The watchdog: a stage made to stall (a fault point that waits forever where no signal
  handler runs, as the deadlocked thread did) is ended with every thread's stack in the logs.
* SIGTERM and SIGINT end a stuck run within seconds, a second signal at once, and the
  services a run started end with it, also after a SIGKILL (the next start stops them).

Everything runs in real child processes: a deadlock in pytest's own process would wedge it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ratchet import services
from tests.test_cli import RATCHET

ROOT = Path(__file__).resolve().parents[1]


def _probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.mlflow_threads_probe", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "PREFECT_", "MLFLOW_"))},
    )


# --------------------------------------------------------------------------- the deadlock


def test_a_gate_evaluation_cannot_deadlock_against_the_trace_exporter(tmp_path: Path) -> None:
    """The stack dump of the hang, made to happen: the loop's thread in a post-import hook
    (MLflow's hook lock held) while the exporter's thread holds Python's import lock and
    asks for the hook lock. Before the fix this child never finished."""
    done = _probe("order", str(tmp_path / "data"))
    assert done.returncode == 0 and "OK" in done.stderr, done.stderr[-4000:]


HOOK_HOLDER = r"""
import sys, threading, time
from pathlib import Path

if sys.argv[2] == "guarded":
    import ratchet.flows.mlflow_imports  # noqa: F401 - what every flow that uses MLflow imports
from mlflow.utils import import_hooks

mods = Path(sys.argv[1])
(mods / "under_hook.py").write_text("import time, in_thread_b_wait\ntime.sleep(1.0)\nimport then_more\n")
(mods / "in_thread_b_wait.py").write_text("")
(mods / "then_more.py").write_text("")
(mods / "prefects_lazy_import.py").write_text("")
sys.path.insert(0, str(mods))
import_hooks.register_post_import_hook(lambda m: None, "a_hooked_module")  # its finder on meta_path


def hook_holder():  # MLflow running a post-import hook that imports (its evaluator registry's)
    with import_hooks._post_import_hooks_lock:
        import under_hook  # noqa: F401


def other_thread():  # Prefect's events thread loading a module for the first time
    time.sleep(0.3)
    import prefects_lazy_import  # noqa: F401


threads = [threading.Thread(target=f, daemon=True) for f in (hook_holder, other_thread)]
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=20)
print("DEADLOCK" if any(t.is_alive() for t in threads) else "OK", flush=True)
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_an_import_in_another_thread_cannot_deadlock_against_an_mlflow_hook(
    tmp_path: Path, guarded: bool
) -> None:
    """MLflow holds its hook lock while a hook imports; a thread importing an unhooked module
    for the first time takes Python's import lock, then asked MLflow's finder, which waited for
    the hook lock: each held what the other waited for (a benchmark's evolve hung there at its
    first stage). Guarded (`flows/mlflow_imports.py`), the finder answers for an unhooked module
    without the lock. Unguarded, the same child deadlocks: the test shows the order is forced."""
    argv = [sys.executable, "-c", HOOK_HOLDER, str(tmp_path), "guarded" if guarded else "bare"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == ("OK" if guarded else "DEADLOCK"), done.stderr[-3000:]


# ~1-3 min on 2 busy cores; CI runs the forced order above. Run it in a loop with the cores
# loaded (bench/RESULTS.md has the rounds): `pytest -m slow tests/test_hang.py -k many`
@pytest.mark.slow
def test_many_gate_evaluations_while_traces_export_never_hang(tmp_path: Path) -> None:
    """Ten gate evaluations on the loop's thread while traces finish and export on MLflow's
    threads and another thread keeps importing a missing module (what the exporter's notebook
    check did on every trace)."""
    done = _probe("stress", str(tmp_path / "data"), "10")
    assert done.returncode == 0 and "OK" in done.stderr, done.stderr[-4000:]


def test_the_exporter_offers_no_trace_to_a_notebook(tmp_path: Path) -> None:
    from mlflow.tracing.display.display_handler import IPythonTraceDisplayHandler

    from ratchet.config import load_settings
    from ratchet.flows import tracking

    was = IPythonTraceDisplayHandler.disabled
    try:
        IPythonTraceDisplayHandler.disabled = False
        tracking.setup(load_settings({"data_dir": str(tmp_path / "data")}))
        assert IPythonTraceDisplayHandler.disabled
    finally:
        IPythonTraceDisplayHandler.disabled = was


# --------------------------------------------------------------------------- a stuck process

# A run in miniature: the signal handlers, a service it started (its own session, as the
# model server), the watchdog, one beat, then a stage that hangs at a fault point.
_STUCK = """
import os, subprocess, sys, time
from pathlib import Path
from ratchet import faults, services, shutdown, watchdog
data, limit_s, grace_s = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])

def run():
    shutdown.set_logs_dir(str(data / "logs"))
    services.use(data)
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    services.register("a service", child.pid)
    print(child.pid, flush=True)
    with watchdog.watching(limit_s, grace_s=grace_s):
        watchdog.beat("explore 1/8")
        print("stalling", flush=True)
        faults.point("stage.started")
    print("never here", flush=True)

shutdown.run_main(run, grace_s=grace_s)
"""


def _stuck(tmp_path: Path, limit_s: float, grace_s: float) -> tuple[subprocess.Popen[str], int]:
    env = dict(os.environ, RATCHET_FAULT="stage.started@hang")
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK, str(tmp_path / "data"), str(limit_s), str(grace_s)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's Ctrl-C
    )
    assert proc.stdout is not None and proc.stderr is not None
    child = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "stalling"
    assert "hanging here" in proc.stderr.readline()
    time.sleep(0.5)  # from the line to the lock it waits on: microseconds; a busy machine, more
    return proc, child


def _gone(pid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        if not services.start_time(pid) or _zombie(pid):
            return True
        time.sleep(0.1)
    return False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def _stacks(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "data" / "logs").glob("*.txt"))


def _end(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def test_the_watchdog_ends_a_stalled_stage_with_every_threads_stack(tmp_path: Path) -> None:
    proc, child = _stuck(tmp_path, limit_s=2, grace_s=2)
    code, err = _end(proc, timeout=120)
    assert code == 75, err  # EX_TEMPFAIL: run it again
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "the run was stuck: no progress for 2 s (evolve.watchdog_s) since explore 1/8" in lines[0]
    assert "run the same command again to resume" in lines[0]
    dumps = _stacks(tmp_path)
    assert dumps, "no stack dump in the logs"
    text = "\n".join(p.read_text() for p in dumps)
    assert "_hang" in text and "point" in text, text  # where the stage was stuck
    assert _gone(child), "the service the run started outlived it"
    assert not list((tmp_path / "data" / "run").glob("services-*.json"))


_BUSY = """
import sys, time
from ratchet import shutdown, watchdog

def run():
    shutdown.set_logs_dir(sys.argv[1])
    with watchdog.watching(1.0, grace_s=600):
        watchdog.beat("distill 2/5")
        while True:
            time.sleep(0.05)  # Python, not stuck in C: a stall the main thread can unwind from

shutdown.run_main(run, grace_s=600)
"""


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_the_watchdog_unwinds_a_stalled_run_that_can_unwind(tmp_path: Path, sigint: str) -> None:
    """No hard exit needed: the main thread gets its KeyboardInterrupt and leaves in one line,
    also in a process started with SIGINT ignored (`nohup ... &`, a CI runner's background job)."""
    args = [sys.executable, "-c", _BUSY, str(tmp_path / "logs")]
    handler = signal.SIG_IGN if sigint == "ignored" else signal.SIG_DFL
    done = subprocess.run(
        args,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, handler),
    )
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 75, done.stderr
    assert len(lines) == 1 and "no progress for 1 s (evolve.watchdog_s) since distill 2/5" in lines[0], lines
    assert "did not stop within" not in done.stderr
    assert list((tmp_path / "logs").glob("stalled-*.txt"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_stuck_run_within_its_grace_and_stops_its_services(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """The main thread cannot run the handler (it waits in C): the watcher thread hears the
    signal through the wakeup fd and exits hard once the grace is over."""
    proc, child = _stuck(tmp_path, limit_s=0, grace_s=3)  # watchdog off
    started = time.monotonic()
    proc.send_signal(sig)
    code, err = _end(proc, timeout=60)
    assert code == 130, err
    assert time.monotonic() - started < 45  # grace 3 s; generous for a loaded machine
    assert "the run did not stop within 3 s" in err and "run the same command again" in err, err
    assert _stacks(tmp_path)
    assert _gone(child)


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    proc, child = _stuck(tmp_path, limit_s=0, grace_s=600)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    code, err = _end(proc, timeout=60)  # far inside the 600 s grace
    assert code == 130 and "a second signal" in err, err
    assert _gone(child)


_RESPONSIVE = """
import sys, time
from ratchet import shutdown
shutdown.stop_on_signals(grace_s=600)
try:
    print("ready", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("unwound", shutdown.stopping(), flush=True)
"""


def test_a_run_that_can_unwind_does_so_on_the_first_signal() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _RESPONSIVE],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert out.strip() == "unwound True" and proc.returncode == 0


# --------------------------------------------------------------------------- what a killed run left


def _listed(run_dir: Path, owner: int, owner_started: str, pid: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    service = {"name": "Prefect's API server", "pid": pid, "group": True, "started": services.start_time(pid)}
    (run_dir / f"services-{owner}.json").write_text(
        json.dumps({"owner": owner, "owner_started": owner_started, "services": [service]})
    )


def test_the_next_start_stops_what_a_killed_run_left_and_says_so(tmp_path: Path) -> None:
    left = subprocess.Popen(["sleep", "600"], start_new_session=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        _listed(tmp_path / "run", dead.pid, "12345", left.pid)
        lines = services.use(tmp_path)
        assert lines == [
            f"stopped Prefect's API server (pid {left.pid}) that a killed run (pid {dead.pid}) left running"
        ]
        assert _gone(left.pid)
        assert not (tmp_path / "run" / f"services-{dead.pid}.json").exists()
    finally:
        left.kill()
        left.wait()
        services.use(tmp_path / "elsewhere")


def test_a_live_runs_services_and_a_reused_pid_are_left_alone(tmp_path: Path) -> None:
    mine = subprocess.Popen(["sleep", "600"], start_new_session=True)
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        # a run that is alive (this test process) owns `mine`
        _listed(tmp_path / "run", os.getpid(), services.start_time(os.getpid()), mine.pid)
        assert services.use(tmp_path) == []
        assert services.start_time(mine.pid)
        # a dead run's entry whose pid now belongs to another process (start time differs)
        run_dir = tmp_path / "run2"
        run_dir.mkdir()
        entry = {"name": "x", "pid": other.pid, "group": True, "started": "1"}
        (run_dir / "services-999999.json").write_text(
            json.dumps({"owner": 999999, "owner_started": "1", "services": [entry]})
        )
        assert services.reap(run_dir) == []
        assert services.start_time(other.pid)
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()
        services.use(tmp_path / "elsewhere")


def test_a_damaged_services_list_is_dropped_not_trusted(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "services-1.json").write_text('{"owner": 1, "services": [{"pid": "x"')
    assert services.reap(run_dir) == []
    assert not list(run_dir.iterdir())


# --------------------------------------------------------------------------- the real CLI


def _cli(tmp_path: Path, endpoint: str, **env: str) -> subprocess.Popen[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "PREFECT_", "MLFLOW_"))}
    args = [RATCHET, "--data-dir", str(tmp_path / "data"), "--endpoint", endpoint, "evolve", "--test", "2"]
    return subprocess.Popen(
        args,
        cwd=tmp_path,
        env={**clean, "COLUMNS": "200", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _hung(proc: subprocess.Popen[str]) -> None:
    """Wait until the run hangs at its fault point (it says so on stderr)."""
    assert proc.stderr is not None
    for line in proc.stderr:
        if "hanging here" in line:
            return
    raise AssertionError(f"the run ended before it hung (exit {proc.wait()})")


def _prefect_pid(tmp_path: Path, proc: subprocess.Popen[str], within_s: float = 600) -> int:
    """The Prefect API server the run listed, once it has (the run then hangs at its first stage)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and proc.poll() is None:
        for f in (tmp_path / "data" / "run").glob("services-*.json"):
            try:
                listed = json.loads(f.read_text())["services"]
            except (OSError, ValueError):
                continue
            for s in listed:
                if s["name"] == "Prefect's API server":
                    return int(s["pid"])
        time.sleep(0.5)
    raise AssertionError(f"the run listed no Prefect server (exit {proc.poll()})")


@pytest.mark.integration
def test_sigterm_ends_a_stuck_evolve_and_its_prefect_server(tmp_path: Path, embedded_server: str) -> None:
    proc = _cli(tmp_path, embedded_server, RATCHET_FAULT="stage.started@hang")
    prefect = _prefect_pid(tmp_path, proc)
    _hung(proc)
    proc.send_signal(signal.SIGTERM)
    code, err = _end(proc, timeout=120)
    assert code == 130, err[-3000:]
    assert "run the same command again to resume" in err, err[-3000:]
    # the hung thread holds the import lock in C: the run unwinds where the thread that hung
    # is not the main one (as Prefect ran the stage), else it exits hard at the grace's end
    assert "the run did not stop within 20 s" in err or "interrupted" in err, err[-3000:]
    assert _gone(prefect), "Prefect's API server outlived the run"


@pytest.mark.integration
@pytest.mark.slow  # ~1 min; CI ends a stalled stage in a small process (the watchdog test above)
def test_the_watchdog_ends_a_stuck_evolve(tmp_path: Path, embedded_server: str) -> None:
    proc = _cli(tmp_path, embedded_server, RATCHET_FAULT="stage.started@hang", RATCHET_EVOLVE__WATCHDOG_S="5")
    prefect = _prefect_pid(tmp_path, proc)
    code, err = _end(proc, timeout=300)
    assert code == 75, err[-3000:]
    assert "the run was stuck: no progress for 5 s (evolve.watchdog_s)" in err, err[-3000:]
    assert _stacks(tmp_path) and _gone(prefect)


@pytest.mark.integration
@pytest.mark.slow  # ~1.5 min; CI: the same cleanup from a planted list (above) and the SIGTERM run
def test_after_a_sigkill_the_next_start_stops_the_prefect_server_it_left(
    tmp_path: Path, embedded_server: str
) -> None:
    proc = _cli(tmp_path, embedded_server, RATCHET_FAULT="stage.started@hang")
    prefect = _prefect_pid(tmp_path, proc)
    _hung(proc)
    proc.kill()
    proc.wait()
    try:
        assert services.start_time(prefect), "nothing was left to clean up"
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("RATCHET_", "PREFECT_", "MLFLOW_"))}
        nxt = subprocess.run(
            [RATCHET, "--data-dir", str(tmp_path / "data"), "skills", "list"],
            cwd=tmp_path,
            env=clean,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert (
            f"stopped Prefect's API server (pid {prefect}) that a killed run (pid {proc.pid})" in nxt.stderr
        )
        assert _gone(prefect)
    finally:
        if services.start_time(prefect):
            os.kill(prefect, signal.SIGKILL)
