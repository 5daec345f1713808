"""The watchdog: a run that makes no progress for `evolve.watchdog_s` is ended, not waited on.

Progress is a beat (`beat`): a rollout finished, a diagnosis or a distill job done, a
training step, a stage started or finished (`flows/progress.py` beats for each). A run with
no beat for the whole limit is stuck (a deadlock in a library, a service that stopped answering); the
watchdog then writes every thread's stack to the data dir's logs, says so in one line, and
ends the run the way a Ctrl-C does (`ratchet.shutdown.stop`): unwound if the main thread
can, else a hard exit that stops the run's services. The stages are resumable, so the same
command again picks up at the stage that was cut.

The default limit (`evolve.watchdog_s`, 15 min) is chosen, not measured, to sit far above the
gaps between beats seen in the logs of runs on a busy 2-core machine (a teacher's long answer,
a LoRA step, a first model load: seconds to a few minutes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ratchet import shutdown

_last = time.monotonic()
_what = "start"


def beat(what: str) -> None:
    """Something finished: the run is moving. Cheap enough to call for every rollout."""
    global _last, _what
    _last, _what = time.monotonic(), what


def idle_s() -> float:
    """Seconds since the last beat."""
    return time.monotonic() - _last


@contextmanager
def watching(limit_s: float, grace_s: float = shutdown.GRACE_S) -> Iterator[None]:
    """Watch the run inside; `limit_s` <= 0 turns the watchdog off."""
    if limit_s <= 0:
        yield
        return
    done = threading.Event()
    beat("the run started")
    thread = threading.Thread(
        target=_watch, args=(limit_s, grace_s, done), name="ratchet-watchdog", daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        done.set()


def _watch(limit_s: float, grace_s: float, done: threading.Event) -> None:
    every = min(30.0, max(0.05, limit_s / 10))
    while not done.wait(every):
        if idle_s() < limit_s:
            continue
        where = shutdown.dump_stacks("stalled")
        stack = f"; every thread's stack is in {where}" if where else ""
        minutes = f"{limit_s / 60:.1f} min" if limit_s >= 60 else f"{limit_s:.0f} s"
        # one line, by whichever way the run ends (the CLI's, or the hard exit's)
        reason = f"the run was stuck: no progress for {minutes} (evolve.watchdog_s) since {_what}{stack}"
        shutdown.stop(reason, shutdown.EXIT_STALLED, grace_s)
        return
