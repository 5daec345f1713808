"""How a run ends when told to (Ctrl-C, SIGTERM) or when the watchdog finds it stalled:
within seconds, writing nothing half-done, and taking its services with it.

The first Ctrl-C or SIGTERM marks the process as stopping and raises KeyboardInterrupt in
the main thread: `with` blocks stop the model server, stores close, exit handlers stop
Prefect's API server, and the CLI prints one line (exit 130). That needs the main thread to
run Python. A thread stuck in C (a lock it waits for forever: the MLflow import-lock deadlock
was one) never runs a signal handler, so a watcher thread hears the signals too, through
Python's wakeup fd, which the C-level handler writes to whatever the main thread is doing:

* a second signal, or `GRACE_S` after the first with the process still alive, is a hard
  exit: every thread's stack to the data dir's logs, one line on stderr, every service the
  run listed stopped (`ratchet.services`), then `os._exit`. Nothing is half-written by it:
  trajectories, diagnoses and candidates are written in transactions, the journal and state
  files by atomic rename, and a resumed run redoes only the stage that was cut, exactly as
  after a SIGKILL.

The hard-exit path imports nothing and writes with plain `os` calls: the thread that is
stuck may hold Python's import lock.
"""

from __future__ import annotations

import _thread
import atexit
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from ratchet import services

GRACE_S = 20.0  # after the first signal, how long the run may take to unwind on its own
EXIT_SIGNAL = 130  # what the CLI's one line uses for an interrupt
EXIT_STALLED = 75  # EX_TEMPFAIL: run the same command again

# Set before KeyboardInterrupt unwinds the main thread. Worker threads (Prefect's task
# runner) go on until their task ends; the runtime's stores and model server close under
# them, so a task checks this and stops quietly instead of failing loudly.
STOPPING = threading.Event()

_logs_dir = ""  # where a hard exit writes every thread's stack ('' = nowhere)
_lock = threading.Lock()
_signals = 0
_exiting = False
_raised = False  # the main thread was sent its KeyboardInterrupt
_self_sent = 0  # interrupts `stop` sent the main thread, which the watcher hears as signals
_why: tuple[str, int] | None = None  # what `stop` ended the run for, and the exit code


def stopping() -> bool:
    """True once the process was told to stop (Ctrl-C or SIGTERM): start nothing new."""
    return STOPPING.is_set()


def set_logs_dir(path: str) -> None:
    """Where a hard exit leaves its stack dump (the data dir's logs)."""
    global _logs_dir
    _logs_dir = path


def run_main(main: Callable[[], object], grace_s: float = GRACE_S) -> None:
    """Run an entry point (the CLI) under the signal handlers. A run that was told to stop
    leaves by `leave`: when the main thread has unwound, another thread may still hold a lock
    the interpreter's own finalization needs (the import lock, in the hang this is for), and
    Python would wait for it forever after our threads are frozen."""
    stop_on_signals(grace_s)
    try:
        main()
    except SystemExit as exc:
        if not stopping():
            raise
        leave(exc.code if isinstance(exc.code, int) else 1)
    except KeyboardInterrupt:
        if not stopping():
            raise
        reason, code = _why or ("interrupted", EXIT_SIGNAL)
        say(f"{reason}; run the same command again to resume")
        leave(code)
    if stopping():
        leave(0)


def leave(code: int) -> None:
    """End a process that was told to stop: exit handlers (Prefect's server, MLflow's queues)
    run while the grace timer still can cut them short, then whatever services are still
    listed are stopped, and the process ends without the interpreter's finalization."""
    try:
        atexit._run_exitfuncs()
    finally:
        services.stop_all()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)


def stop_on_signals(grace_s: float = GRACE_S) -> None:
    """Install the handlers (main thread, before other threads start): for entry points, the
    CLI and the benchmarks. A SIGINT the process was started to ignore (a shell's background
    job) stays ignored."""
    signal.signal(signal.SIGTERM, _interrupt)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _interrupt)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd, grace_s), name="ratchet-signals", daemon=True).start()


def _interrupt(signum: int, frame: object) -> None:
    """The main thread's handler: the first signal (or the watchdog's `stop`) unwinds it;
    later ones are the watcher's."""
    global _raised
    STOPPING.set()
    if _raised:
        return
    _raised = True
    raise KeyboardInterrupt


def _watch(read_fd: int, grace_s: float) -> None:
    """Hear every SIGINT/SIGTERM even while the main thread is stuck."""
    while True:
        try:
            got = os.read(read_fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not got:
            return
        heard = [b for b in got if b in (signal.SIGINT, signal.SIGTERM)]
        if heard:
            _heard(len(heard), grace_s)


def _heard(n: int, grace_s: float) -> None:
    global _signals, _self_sent
    with _lock:
        ours = min(n, _self_sent)  # `stop`'s interrupt_main is heard here too: not a person's
        _self_sent -= ours
        n -= ours
        if not n:
            return
        first = _signals == 0
        _signals += n
        again = _signals > 1 or _why is not None  # a signal while a stop is under way: now
    STOPPING.set()
    if again:
        hard_exit("a second signal", EXIT_SIGNAL)
    elif first:
        _later(grace_s, "a signal", EXIT_SIGNAL)


def stop(reason: str, code: int, grace_s: float = GRACE_S) -> None:
    """End the run from another thread (the watchdog): unwind the main thread if it can,
    else a hard exit after `grace_s`."""
    global _why, _self_sent
    with _lock:
        _why = (reason, code)
        _self_sent += 1
    STOPPING.set()
    # KeyboardInterrupt, as soon as the main thread runs Python. As SIGTERM: its handler is
    # always ours, while SIGINT stays ignored in a process started to ignore it (a shell's
    # background job), and `interrupt_main` does nothing for an ignored signal.
    _thread.interrupt_main(signal.SIGTERM)
    _later(grace_s, reason, code)


def _later(grace_s: float, reason: str, code: int) -> None:
    def wait() -> None:
        time.sleep(grace_s)
        hard_exit(f"{reason}; the run did not stop within {grace_s:.0f} s", code)

    threading.Thread(target=wait, name="ratchet-grace", daemon=True).start()


def why() -> tuple[str, int] | None:
    """Why `stop` ended the run, and its exit code (None: a person's signal, or not stopped):
    the CLI's line for a main thread that did unwind."""
    return _why


def say(line: str) -> None:
    """One line on stderr, written the way the hard-exit path can (no import, no lock)."""
    try:
        os.write(2, (line + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def hard_exit(reason: str, code: int) -> None:
    """Stack dump, one line, services stopped, exit: for a process that cannot unwind."""
    global _exiting
    with _lock:
        if _exiting:
            return
        _exiting = True
    where = dump_stacks("stopped")
    tail = f"; every thread's stack is in {where}" if where else ""
    say(f"stopped ({reason}){tail}; run the same command again to resume")
    services.stop_all()
    os._exit(code)


def dump_stacks(what: str) -> str:
    """Every thread's stack into `<logs>/<what>-<time>.txt`; the path ('' if not written)."""
    if not _logs_dir:
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        return ""
    path = os.path.join(_logs_dir, f"{what}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt")
    try:
        os.makedirs(_logs_dir, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return ""
    try:
        faulthandler.dump_traceback(file=fd, all_threads=True)
    finally:
        os.close(fd)
    return path
