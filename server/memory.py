"""The server process's own memory: what it holds resident, and giving freed memory back.

A forward's tensors (a batch's keys and values, a prefill's attention masks) are freed when
it ends, but glibc keeps freed heap pages mapped for the next allocation: after a burst of
long prompts the process stays as large as its largest moment. `release_free_memory` asks
glibc to return them (`malloc_trim`, ~0.1 s for a few GB); the engine calls it when it has
been idle a moment, never between the steps of a busy batch, where the pages would only be
faulted back in (bench/server_memory.py measures both sides).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path

FIELDS = {"VmRSS": "rss_mb", "VmHWM": "peak_rss_mb"}


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None  # glibc only


def release_free_memory() -> bool:
    """Return freed heap pages to the OS; False where the C library cannot (not glibc)."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


def resident_mb(pid: int | str = "self") -> dict[str, int]:
    """A process's resident memory now and at its peak (VmRSS, VmHWM), in MiB (this one's
    by default); empty where /proc is not there."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[FIELDS[key]] = int(value.split()[0]) // 1024  # kB
    return out


def server_pids(*args: str) -> list[int]:
    """The pids of `python -m ratchet.server` processes whose command line has all of `args`
    (e.g. `"--port", "8917"`), for reading a server's memory from outside; empty where /proc
    is not there."""
    want = [a.encode() for a in args]
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone
            continue
        if b"ratchet.server" in argv and all(a in argv for a in want):
            pids.append(int(proc.name))
    return pids
