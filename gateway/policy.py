"""The named evolution's live policy, read from its stores, and the watch that follows it.

`load_snapshot` reads what is live the way every stage does (`flows/runtime.py`): the champion
adapter (hash-checked, and loaded on the model server by name before anything names it), the
promoted skills of the data dir, each changing the policy as its kind says. The function tools
among them are served over MCP beside it.

`AuditWatch` notices a decision made by any process: every promotion, rejection, retirement
and rollback of a skill or an adapter appends one line to its store's audit log
(`ratchet.lifecycle`), the truth about what is live. Polling their size and modification time
costs a `stat` each; a change reloads the policy and swaps it in (`Live.swap`). A reload that
fails (an adapter whose files changed, a damaged log) leaves the last good version serving,
says why once in the log and on `/health`, and is tried again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from ratchet.config import Settings
from ratchet.errors import one_line
from ratchet.flows.runtime import load_champion_adapter, model_policy, policy_with
from ratchet.gateway.request import Chooser
from ratchet.gateway.snapshot import Live, Snapshot
from ratchet.lifecycle import AUDIT
from ratchet.skills.library import SkillLibrary
from ratchet.skills.toolbox import SandboxTool
from ratchet.training.registry import ADAPTER

log = logging.getLogger("ratchet.gateway")

Signature = tuple[tuple[int, int, int] | None, ...]


def audit_logs(settings: Settings) -> list[Path]:
    """The audit logs whose lines decide what is live: the skills' and the adapters'."""
    return [settings.skills_dir / AUDIT, settings.adapters_dir / AUDIT]


def load_snapshot(settings: Settings, upstream: str, chooser: Chooser | None = None) -> Snapshot:
    """The live policy now, with its adapter served by `upstream` and its skills embedded
    (`chooser`), ready to swap in."""
    library = SkillLibrary(settings.skills_dir, settings.index_dir)  # reads only: no MLflow mirror
    adapter = load_champion_adapter(settings, upstream)
    promoted = library.list(status="promoted")
    policy = policy_with(model_policy(settings, adapter), promoted)
    d = settings.distill
    tools = tuple(
        SandboxTool.from_skill(s, d.tool_timeout_s, d.tool_memory_mb)
        for s in promoted
        if s.tool is not None and s.tool.kind == "function"  # macros are moves in ratchet's suites
    )
    if chooser is not None:
        chooser.warm(policy)
    return Snapshot(
        policy,
        champion=bool(promoted) or adapter is not None,
        tools=tools,
        adapter=None if adapter is None else ADAPTER.label(adapter.name),
    )


def signature(paths: Sequence[Path]) -> Signature:
    """What a `stat` tells of each file: (inode, size, mtime in ns), None where there is none."""
    out: list[tuple[int, int, int] | None] = []
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            out.append(None)
            continue
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class AuditWatch:
    """A daemon thread that calls `reload` whenever one of `paths` changes (polled every
    `poll_s`), and again every `retry_s` while the last reload failed."""

    def __init__(
        self,
        paths: Sequence[Path],
        reload: Callable[[], object],
        poll_s: float = 0.5,
        retry_s: float = 5.0,
        seen: Signature | None = None,
    ) -> None:
        self.paths, self.reload, self.poll_s, self.retry_s = list(paths), reload, poll_s, retry_s
        self.error: str | None = None  # why the last reload failed (None: it did not)
        self._stop = threading.Event()
        self._seen = signature(self.paths) if seen is None else seen  # what the live policy was read at
        self._thread = threading.Thread(target=self._run, name="gateway-audit-watch", daemon=True)

    def start(self) -> AuditWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def _run(self) -> None:
        wait = self.poll_s
        while not self._stop.wait(wait):
            now = signature(self.paths)
            if now == self._seen and self.error is None:
                continue
            try:
                self.reload()
            except Exception as exc:  # noqa: BLE001 - the last good version keeps serving
                error = one_line(f"{type(exc).__name__}: {exc}")[:500]
                if error != self.error:
                    log.warning("the live policy could not be reloaded (%s): the last one serves", error)
                self.error, wait = error, self.retry_s
                continue
            if self.error is not None:
                log.info("the live policy was reloaded after %s", self.error)
            # `now` was read before the reload: a change made during it is seen at the next look
            self._seen, self.error, wait = now, None, self.poll_s


def reloader(
    settings: Settings, upstream: str, live: Live, chooser: Chooser
) -> Callable[[], Snapshot | None]:
    """What `AuditWatch` (and `/admin/reload`) calls: the live policy read again and swapped in
    if it changed; one reload at a time (two would load the same adapter at once)."""
    lock = threading.Lock()

    def reload() -> Snapshot | None:
        with lock:
            return live.swap(load_snapshot(settings, upstream, chooser))

    return reload


def has_champion(settings: Settings) -> bool:
    """Whether anything of the evolution is promoted (read only: nothing is loaded anywhere)."""
    from ratchet.training.registry import AdapterRegistry

    library = SkillLibrary(settings.skills_dir, settings.index_dir)
    return bool(library.list(status="promoted")) or AdapterRegistry(settings).champion() is not None
