"""The services a run starts, written down so that none outlives it.

A run starts processes of its own: the embedded model server, Prefect's API server. A normal
end stops them (`with` blocks, exit handlers). Two ends skip that: a hard exit (a second
Ctrl-C, a run the watchdog found stalled, `ratchet.shutdown`) and a SIGKILL of the run. So
while a service runs, it is listed in `<data dir>/run/services-<run pid>.json`:

* a hard exit stops every listed service before the process goes (`stop_all`);
* the next start in the same data dir stops what a killed run left and says so (`reap`).

A listed process is stopped only if it is still the same process: its start time (from
/proc) must match, so a pid the kernel gave to something else since is left alone. Each run
writes only its own file, so two ratchet processes on one data dir never race on one.

Everything on the hard-exit path is imported at module import and uses plain `os` calls: it
may run while another thread holds Python's import lock forever (the hang this exists for).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RUN_DIR = "run"
STOP_WAIT_S = 5.0  # SIGTERM, then this long, then SIGKILL


@dataclass(frozen=True)
class Service:
    """One process a run started."""

    name: str  # "the embedded model server"
    pid: int
    group: bool  # the process leads its own process group: stop the group
    started: str  # /proc/<pid>/stat start time: the same process, not a reused pid


_lock = threading.Lock()
_services: dict[int, Service] = {}
_file: str = ""  # this process's list ('' before `use`)


def _stat(pid: int) -> list[bytes]:
    """The fields of /proc/<pid>/stat after the name ([] if there is no such process): the
    name (field 2) may hold spaces and ')', the fields after its last ')' are plain."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return []
    return stat[stat.rfind(b")") + 2 :].split()


def start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' if there is no such process)."""
    fields = _stat(pid)
    return fields[19].decode() if len(fields) > 19 else ""


def use(data_dir: Path) -> list[str]:
    """List this process's services under `data_dir` from now on; first stop what a killed
    run left there. Returns one line per service stopped, for the caller to print."""
    global _file
    run_dir = data_dir / RUN_DIR
    stopped = reap(run_dir)
    with _lock:
        _file = str(run_dir / f"services-{os.getpid()}.json")
        _write()
    return stopped


def register(name: str, pid: int) -> None:
    """`pid` is a service this run started: stop it if the run ends without doing so."""
    try:
        group = os.getpgid(pid) == pid
    except OSError:
        return  # already gone
    with _lock:
        _services[pid] = Service(name, pid, group, start_time(pid))
        _write()


def unregister(pid: int) -> None:
    """The service was stopped the normal way."""
    with _lock:
        if _services.pop(pid, None) is not None:
            _write()


def _write() -> None:
    if not _file:
        return
    if not _services:
        _unlink(Path(_file))
        return
    run_dir = os.path.dirname(_file)
    try:
        os.makedirs(run_dir, exist_ok=True)
        services = [asdict(s) for s in _services.values()]
        me = os.getpid()
        data = json.dumps({"owner": me, "owner_started": start_time(me), "services": services})
        tmp = f"{_file}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, data.encode())
        finally:
            os.close(fd)
        os.replace(tmp, _file)
    except OSError:
        pass  # a list we cannot write costs only the cleanup after a kill


def stop(service: Service) -> bool:
    """Stop one service (SIGTERM, then SIGKILL after STOP_WAIT_S); False if it was not
    running any more (or is another process now)."""
    if not service.started or start_time(service.pid) != service.started:
        return False
    send = os.killpg if service.group else os.kill
    try:
        send(service.pid, signal.SIGTERM)
    except OSError:
        return False
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline and _alive(service):
        time.sleep(0.05)
    if _alive(service):
        try:
            send(service.pid, signal.SIGKILL)
        except OSError:
            pass
    return True


def _alive(service: Service) -> bool:
    try:  # our own child: reap it, or it stays a zombie that /proc still lists
        if os.waitpid(service.pid, os.WNOHANG)[0] == service.pid:
            return False
    except ChildProcessError:
        pass
    except OSError:
        return False
    return start_time(service.pid) == service.started and _state(service.pid) != "Z"


def _state(pid: int) -> str:
    fields = _stat(pid)
    return fields[0].decode() if fields else ""


def stop_all() -> None:
    """Stop every service this process listed (the hard exit)."""
    with _lock:
        services = list(_services.values())
    for s in services:
        stop(s)
    with _lock:
        _services.clear()
        _write()


def reap(run_dir: Path) -> list[str]:
    """Stop the services of runs that were killed (their process is gone) and drop their
    lists; one line per service stopped."""
    lines: list[str] = []
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return lines
    for name in names:
        if not (name.startswith("services-") and name.endswith(".json")):
            continue
        path = run_dir / name
        try:
            listed = json.loads(path.read_text())
            owner, owner_started = int(listed["owner"]), str(listed.get("owner_started", ""))
            services = [Service(**s) for s in listed["services"]]
        except (OSError, ValueError, TypeError, KeyError):
            _unlink(path)  # unreadable: nothing in it can be trusted to be ours
            continue
        if owner_started and start_time(owner) == owner_started:
            continue  # that run (or this one) is alive: its services are its own
        for s in services:
            if stop(s):
                lines.append(f"stopped {s.name} (pid {s.pid}) that a killed run (pid {owner}) left running")
        _unlink(path)
    return lines


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
