"""The candidate lifecycle, once for every kind: skills, tools and guardrails (SKILL.md
folders) and LoRA adapters (MLflow model versions) all move along the same states:

    candidate ─(gate passes)→ verified ─(auto, or a person)→ promoted ─(retire / rollback)→ retired
        │                         └─(a person, or the set check)→ rejected          │
        └─(gate fails, or a person)→ rejected             retired ─(a person)→ promoted

A `Lifecycle` is the store behind one kind: an append-only audit log (`audit.jsonl`) that is
the truth about every candidate's status, and an exclusive `flock` (`.lock`) under which every
change is made. A change is one fsynced record (who, when, why, evidence, content hash) that
says where the candidate came from and where it went; whatever else shows the status (a
SKILL.md's `ratchet-status`, an MLflow tag, the `champion` alias) is a mirror written after the
record, so a process killed between the two leaves the log right and the mirror stale, and the
next reader believes the log. A record is never rewritten; a damaged log is one line that says
how to recover (`ratchet.files.read_jsonl`).

Only `retired → promoted` is a way back: a retired candidate passed the gate once (nothing
reaches `promoted` without going through `verified`), so a person may make it live again.
Which promoted candidates are *live* is the kind's rule: every promoted skill is live
(additive), while only the newest promoted adapter is (exclusive: the `champion`). A rollback
is the same for both: it retires the named promotion and every later one still promoted, so
what is live afterwards is exactly what was live just before the named one went live.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from ratchet.errors import CandidateStateError
from ratchet.files import append_line, exclusive, read_jsonl

Status = Literal["candidate", "verified", "promoted", "retired", "rejected"]
STATUSES: tuple[Status, ...] = ("candidate", "verified", "promoted", "retired", "rejected")
TRANSITIONS: dict[str, frozenset[str]] = {
    "candidate": frozenset({"verified", "rejected"}),
    "verified": frozenset({"promoted", "rejected"}),
    "promoted": frozenset({"retired"}),
    "retired": frozenset({"promoted"}),
    "rejected": frozenset(),
}
AUDIT = "audit.jsonl"


class Record(BaseModel):
    """One line of a lifecycle's audit log: a candidate's status change."""

    name: str
    from_status: Status | None  # None: the candidate was filed
    to_status: Status
    who: str
    why: str
    at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    content_hash: str = ""  # what was decided on: a SKILL.md's hash, an adapter's sha256
    evidence: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _earlier_layouts(cls, data: Any) -> Any:
        """Read logs written before the kinds shared one store: skill records named the
        candidate `skill`; adapter records said `version`, `from` ("" when filed) and `to`."""
        if not isinstance(data, dict) or "name" in data:
            return data
        data = dict(data)
        if "skill" in data:
            data["name"] = data.pop("skill")
        elif "version" in data:
            data["name"] = str(data.pop("version"))
            data["from_status"] = data.pop("from", None) or None
            data["to_status"] = data.pop("to")
        return data


def latest_evidence(records: Iterable[Record]) -> dict[str, dict[str, Any]]:
    """name -> the evidence of its latest gate decision (the gate's records carry its
    `decision`; a person's do not)."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if "decision" in r.evidence:
            out[r.name] = r.evidence
    return out


def read_log(root: Path, what: str) -> list[Record]:
    """The audit log under `root`, read strictly; creates nothing (a preflight may call it)."""
    return read_jsonl(root / AUDIT, Record, what)


def promoted_order(records: list[Record]) -> list[str]:
    """The candidates `records` leave promoted, in the order they (last) went live."""
    order: dict[str, None] = {}
    for r in records:
        order.pop(r.name, None)
        if r.to_status == "promoted":
            order[r.name] = None
    return list(order)


class Lifecycle:
    """The lifecycle store of one kind of candidate under `root`.

    `what` names the candidates in messages ("skill", "adapter version") and `listing` is the
    command that lists them; `error` is the kind's `CandidateStateError`, so callers can tell
    whose state refused a change. The lock is re-entrant within a thread, so a kind can hold
    it across its own checks and the change.
    """

    def __init__(
        self,
        root: Path,
        what: str,
        error: type[CandidateStateError] = CandidateStateError,
        listing: str = "",
    ) -> None:
        self.root = Path(root)
        self.what = what
        self.error = error
        self.listing = listing  # the command that lists them, for messages
        self._held = threading.local()

    # -- reading

    def records(self, name: str | None = None) -> list[Record]:
        """Every status change, oldest first (of `name` only, if given)."""
        return [
            r for r in read_log(self.root, f"the {self.what} audit log") if name is None or r.name == name
        ]

    def last(self) -> dict[str, Record]:
        """name -> its latest record: the status every candidate has now."""
        return {r.name: r for r in self.records()}

    def status(self, name: str) -> Status | None:
        """`name`'s status, or None if it was never filed."""
        record = self.last().get(name)
        return None if record is None else record.to_status

    def evidence(self, name: str) -> dict[str, Any]:
        """The evidence of `name`'s latest gate decision ({} if it was never gated)."""
        return latest_evidence(self.records(name)).get(name, {})

    def promoted(self) -> list[str]:
        """The candidates promoted now, in the order they (last) went live, oldest first."""
        return promoted_order(self.records())

    # -- writing

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the store's lock (re-entrant in this thread): one writer at a time, across
        threads and processes."""
        if getattr(self._held, "depth", 0):
            self._held.depth += 1
            try:
                yield
            finally:
                self._held.depth -= 1
            return
        with exclusive(self.root / ".lock"):
            self._held.depth = 1
            try:
                yield
            finally:
                self._held.depth = 0

    def file(self, name: str, who: str, why: str, content_hash: str = "") -> Record:
        """Record a new candidate. Names are never reused: a filed name is taken for good."""
        with self.locked():
            if name in self.last():
                raise self.error(f"{self.what} {name!r} is filed already")
            record = Record(
                name=name,
                from_status=None,
                to_status="candidate",
                who=who,
                why=why,
                content_hash=content_hash,
            )
            self._append(record)
        return record

    def transition(
        self,
        name: str,
        to: Status,
        who: str,
        why: str,
        evidence: dict[str, Any] | None = None,
        expect: Status | None = None,
        content_hash: str | None = None,
    ) -> Record:
        """Move `name` to `to`, if the lifecycle allows it from where the log says it is.
        `expect` guards against acting on a stale view: a person who saw 'verified' must not
        promote what someone else rejected a moment ago. The record is on disk on return."""
        with self.locked():
            last = self.last().get(name)
            if last is None:
                raise self.error(
                    f"no {self.what} named {name!r}", f"see `{self.listing}`" if self.listing else ""
                )
            now = last.to_status
            if expect is not None and now != expect:
                raise self.error(
                    f"{self.what} {name!r} is {now}, not {expect} (someone else changed it)",
                    "reload and decide again",
                )
            if to not in TRANSITIONS[now]:
                allowed = ", ".join(sorted(TRANSITIONS[now])) or "nothing"
                raise self.error(f"{self.what} {name!r} is {now}: it can move to {allowed}, not {to}")
            record = Record(
                name=name,
                from_status=now,
                to_status=to,
                who=who,
                why=why,
                content_hash=last.content_hash if content_hash is None else content_hash,
                evidence=evidence or {},
            )
            self._append(record)
        return record

    def rollback_set(self, name: str) -> list[str]:
        """What a rollback of `name` retires, newest first: `name` and every candidate promoted
        after it that is still promoted."""
        live = self.promoted()
        if name not in live:
            raise self.error(f"{self.what} {name!r} is not live", "rollback undoes a promotion")
        return list(reversed(live[live.index(name) :]))

    def _append(self, record: Record) -> None:
        """Callers have just read the whole log under the lock (`last()`), which refuses a
        damaged line, so nothing is ever appended behind one (it would glue onto it)."""
        append_line(self.root / AUDIT, record.model_dump_json())
