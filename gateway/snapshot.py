"""The live policy as one immutable snapshot, and the one reference to it a swap moves.

A request takes `Live.current` once, at its start, and uses that snapshot for all it does: the
system text, the narrowed tools, the served model (the champion adapter by name) and the
version it names in its header and `system_fingerprint`. A promotion that lands while a
request streams changes nothing of that request; the next one takes the new snapshot. A swap
is one reference assignment under a lock, made only once the new snapshot is whole (its
adapter already loaded on the model server, its skills already embedded), so a request never
sees half of one.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from fastmcp.tools import Tool

from ratchet.types import Policy

log = logging.getLogger("ratchet.gateway")

POLICY_HEADER = "X-Ratchet-Policy"
CHAMPION_HEADER = "X-Ratchet-Champion"


@dataclass(frozen=True)
class Snapshot:
    """What one version of the live policy serves: the policy itself, whether anything is
    promoted (no: the base model alone, said on every answer), the function tools served over
    MCP, and the champion adapter's label."""

    policy: Policy
    champion: bool
    tools: tuple[Tool, ...] = ()
    adapter: str | None = None
    since: float = field(default_factory=time.time)

    @property
    def version(self) -> str:
        return self.policy.version

    def headers(self) -> dict[str, str]:
        """The headers every answer under this snapshot carries."""
        head = {POLICY_HEADER: self.version}
        if not self.champion:
            head[CHAMPION_HEADER] = "none: nothing is promoted, this is the base model"
        return head

    def describe(self) -> str:
        """'adapter v2, 3 skills, 1 rule, 2 tools' (what a person reads in the swap's log line)."""
        p = self.policy
        parts = [self.adapter or "the base model"]
        for n, what in (
            (len(p.skills), "skill"),
            (len(p.rules), "rule"),
            (len(p.constraints), "constraint"),
            (len(p.exemplars), "exemplar set"),
            (len(p.tools), "tool"),
        ):
            if n:
                parts.append(f"{n} {what}{'s' if n != 1 else ''}")
        return ", ".join(parts)


class Live:
    """The one reference requests read. Only `swap` moves it."""

    def __init__(self, first: Snapshot) -> None:
        self._current = first
        self._lock = threading.Lock()
        self.swaps = 0

    @property
    def current(self) -> Snapshot:
        return self._current  # one attribute read: atomic

    def swap(self, new: Snapshot) -> Snapshot | None:
        """Make `new` current unless it is the version already live; returns the snapshot it
        replaced (None: no swap). Logs the old and the new version."""
        with self._lock:
            old = self._current
            if new.version == old.version:
                return None
            self._current = new
            self.swaps += 1
        log.info("policy %s → %s (%s)", old.version, new.version, new.describe())
        return old
