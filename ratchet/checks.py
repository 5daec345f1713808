"""A pre-flight's checks, run one way by a run and another by `ratchet doctor`.

A run stops at the first problem (one line, exit 2, nothing started); the doctor goes on
after one, so that a user fixing a new configuration sees every problem at once. Both run
the same checks (`flows/preflight.py`) through a `Checks`, which also keeps what a
check found worth saying (a task file's split counts) for the doctor to print.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ratchet.errors import RatchetError, one_line


@dataclass
class Checks:
    """Runs checks: `stop_at_first` raises the first problem (a run's pre-flight); otherwise
    each problem is kept as one line and the next check runs (the doctor)."""

    stop_at_first: bool = True
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def run(self, check: Callable[[], object]) -> bool:
        """Run `check`; True when it passed. A check that returns text has said something
        worth showing (kept in `notes`)."""
        try:
            said = check()
        except RatchetError as exc:
            if self.stop_at_first:
                raise
            self.problems.append(str(exc))
            return False
        except Exception as exc:  # a plug-in's or a user's module's own bug: still one line
            if self.stop_at_first:
                raise
            self.problems.append(f"{type(exc).__name__}: {one_line(' '.join(str(exc).split()))}")
            return False
        if isinstance(said, str) and said:
            self.notes.append(said)
        return True
