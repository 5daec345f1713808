"""Progress events from the loop to whoever is watching: the CLI's Rich bars on a terminal,
one plain line per stage start and end in a log.

Flow parameters must be serializable, so a callback cannot be passed in; rollouts and stages
run in threads of the same process, so a process-wide listener is enough.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from ratchet import watchdog

Listener = Callable[[str, int, int], None]  # (stage, done, total): rollouts as they finish


@dataclass(frozen=True)
class StageEvent:
    """A stage of a generation started or finished; `summary` is its journal summary."""

    generation: int
    stage: str
    phase: Literal["started", "finished"]
    summary: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def line(self) -> str:
        """One plain line for a log: 'gen 1 explore finished in 2.3 min: n=8 successes=3 …'."""
        head = f"gen {self.generation} {self.stage} {self.phase}"
        if self.phase == "started":
            return head
        counts = " ".join(f"{k}={_short(v)}" for k, v in self.summary.items() if _countable(v))
        return f"{head} in {self.seconds / 60:.1f} min" + (f": {counts}" if counts else "")


def _countable(value: Any) -> bool:
    """What a log line shows of a summary: numbers, short words, names (lists of strings)."""
    if isinstance(value, bool | int | float):
        return True
    if isinstance(value, str):
        return len(value) <= 40
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    text = ",".join(value) or "-" if isinstance(value, list) else str(value)
    return "_".join(text.split())  # one line, one token: names come from models and plug-ins


StageListener = Callable[[StageEvent], None]

_listeners: list[Listener] = []
_stage_listeners: list[StageListener] = []
_lock = threading.Lock()


@contextmanager
def listen(listener: Listener, on_stage: StageListener | None = None) -> Iterator[None]:
    """Call `listener` for every finished rollout and `on_stage` for every stage event."""
    with _lock:
        _listeners.append(listener)
        if on_stage is not None:
            _stage_listeners.append(on_stage)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)
            if on_stage is not None:
                _stage_listeners.remove(on_stage)


def report(stage: str, done: int, total: int) -> None:
    watchdog.beat(f"{stage} {done}/{total}")
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        fn(stage, done, total)


def report_stage(event: StageEvent) -> None:
    watchdog.beat(f"gen {event.generation} {event.stage} {event.phase}")
    with _lock:
        listeners = list(_stage_listeners)
    for fn in listeners:
        fn(event)
