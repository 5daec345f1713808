"""Named fault points: where a test may kill the process (SIGKILL) to prove a run resumes,
or make it hang to prove the watchdog and the signals end it.

Set `RATCHET_FAULT=<point>` (or `<point>:<n>`, the n-th time the point is reached, 1-based)
and the process kills itself there, with no cleanup, exactly like the OOM killer or a
power cut. With `@hang` after it (`stage.started@hang`) the thread that reaches the point
waits forever where no signal handler can run, as a thread did in MLflow's import-lock
deadlock: another thread takes Python's import lock and keeps it, and this one asks for it.
Unset (the normal case) a fault point costs one dictionary lookup.

Every point is listed in `POINTS` with what has happened when it fires; `point()` refuses
a name that is not listed, so a renamed point cannot silently stop being tested.
"""

from __future__ import annotations

import _imp
import os
import signal
import threading
from collections import Counter

FAULT_ENV = "RATCHET_FAULT"

POINTS: dict[str, str] = {
    "stage.started": "an evolve stage is about to run (nothing of it done yet)",
    "stage.finished": "an evolve stage finished, before the evolution journal records it",
    "rollout.stored": "a rollout's trajectory was stored (others of the batch still in flight)",
    "diagnosis.stored": "a failure's diagnosis was stored",
    "skill.added": "a distilled candidate was written to the library",
    "skill.filing": "a new candidate's audit record was written, its folder not yet in place",
    "skill.recorded": "a status change's audit record was written, its SKILL.md not yet rewritten",
    "skill.transition": "a skill's status changed (e.g. verified, not yet promoted)",
    "adapter.trained": "a LoRA adapter was written to disk, not yet registered",
    "adapter.created": "an MLflow model version was created, not yet filed in the lifecycle",
    "adapter.registered": "an adapter version was registered, not yet gated",
    "adapter.recorded": "an adapter's status change was recorded, its MLflow tags and alias not yet",
    "adapter.decided": "an adapter version was verified or rejected, not yet promoted",
}

_lock = threading.Lock()
_hits: Counter[str] = Counter()


def armed() -> tuple[str, int] | None:
    """The point (and hit number) this process should die or hang at, from the environment."""
    spec = os.environ.get(FAULT_ENV, "").strip().removesuffix("@hang")
    if not spec:
        return None
    name, _, nth = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: unknown fault point; known: {', '.join(POINTS)}")
    return name, int(nth or 1)


def point(name: str) -> None:
    """Die here (SIGKILL) if `RATCHET_FAULT` names this point and this is its n-th hit."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}: add it to ratchet.faults.POINTS")
    target = armed()
    if target is None or target[0] != name:
        return
    with _lock:
        _hits[name] += 1
        hit = _hits[name]
    if hit != target[1]:
        return
    if os.environ.get(FAULT_ENV, "").strip().endswith("@hang"):
        _hang(name)
    os.kill(os.getpid(), signal.SIGKILL)


def _hang(name: str) -> None:
    """Wait forever, out of reach of signal handlers and of `KeyboardInterrupt`."""
    held = threading.Event()

    def hold() -> None:
        _imp.acquire_lock()
        held.set()
        threading.Event().wait()  # never released

    threading.Thread(target=hold, name="fault-holds-import-lock", daemon=True).start()
    held.wait()
    os.write(2, f"fault point {name}: hanging here ({FAULT_ENV})\n".encode())  # for a test to wait on
    _imp.acquire_lock()  # in C, without a timeout: only the end of the process ends this
