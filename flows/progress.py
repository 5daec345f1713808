"""Progress events from rollouts to whoever is watching (the CLI's Rich bars).

Flow parameters must be serializable, so a callback cannot be passed in; rollouts run in
threads of the same process, so a process-wide listener is enough.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Listener = Callable[[str, int, int], None]  # (stage, done, total)

_listeners: list[Listener] = []
_lock = threading.Lock()


@contextmanager
def listen(listener: Listener) -> Iterator[None]:
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)


def report(stage: str, done: int, total: int) -> None:
    with _lock:
        listeners = list(_listeners)
    for fn in listeners:
        fn(stage, done, total)
