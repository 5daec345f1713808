"""The candidate lifecycle, once for every kind: skills, tools and guardrails (SKILL.md
folders) and LoRA adapters (MLflow model versions) all move along the same states:

    candidate ─(gate passes)→ verified ─(auto, or a person)→ promoted ─(retire / rollback)→ retired
        │                         └─(a person, or the set check)→ rejected          │
        └─(gate fails, or a person)→ rejected             retired ─(a person)→ promoted

A `Lifecycle` is the store behind one kind: an append-only audit log (`audit.jsonl`) that is
the truth about every candidate's status, and an exclusive `flock` (`.lock`) under which every
change is made. A change is one fsynced record (who, when, why, evidence, content hash) that
says where the candidate came from and where it went; whatever else shows the status (a
SKILL.md's `ratchet-status`, an MLflow tag, the `champion` alias, a vector index) is a mirror
written after the record, so a process killed between the two leaves the log right and the
mirror stale, and the next reader believes the log. A mirror that fails is a warning, never
an error: the change happened (`Warn`; `ratchet.decisions.apply` retries the kind's mirrors
after every decision). A record is never rewritten; a damaged log is one line that says how
to recover (`ratchet.files.read_jsonl`).

The log is read as a history, and an impossible one is refused whole. Every line must follow
from the one before it for the same name: the first files it (nothing → candidate), each next
one starts where the last ended (`from_status` is the previous `to_status`) and makes a move
`TRANSITIONS` allows, or is an *amendment* (from_status = to_status: the status stays, the
content hash is re-pinned, e.g. when a merge joins a near-duplicate's provenance). A line that
breaks this (hand-appended `rejected → promoted`, a promotion of a name never filed, a second
filing) was not written by ratchet; the whole log is then one `StateFileError` naming the line
and how to recover, like a damaged line. Refusing the whole log rather than quarantining the
one candidate is deliberate: it loses nothing (no line is skipped or rewritten), and every
reader (the live set, the champion, the dashboard's replays) goes through `read_log`, so none
can be talked into "live" by a line it did not check. What it cannot stop: someone who can
write the data dir can append a *complete* forged history (filed → verified → promoted with
the right hashes); the data dir is trusted storage, records are not signed.

What a record says is checked once, before anything is written (`check_input`): names are
1-100 characters from letters, digits, '.', '_', '-' (never a path); who and why are non-empty
UTF-8 text (no lone surrogates: undecodable command-line bytes arrive as those), without
control or bidi characters (why may hold newlines and tabs), at most 100 / 2,000 characters.
A refusal is one `InvalidInputError` line that never echoes the raw input.

Only `retired → promoted` is a way back: a retired candidate passed the gate once (nothing
reaches `promoted` without going through `verified`), so a person may make it live again.
Which promoted candidates are *live* is the kind's rule: every promoted skill is live
(additive), while only the newest promoted adapter is (exclusive: the `champion`). A rollback
is the same for both (`Lifecycle.rollback`, each kind passing its own checks and its
transition with its mirrors): it retires the named promotion and every later one still
promoted, so what is live afterwards is exactly what was live just before the named one went
live.

Every record is an event. Whoever keeps a copy of the lifecycle outside the kind's own store
(MLflow's agent versions: `ratchet.flows.agent_versions.follow`) subscribes once
(`subscribe`), and is told of each record after it is on disk, with the store it was written
to (`Change`). A listener that fails is a warning, never an error, as a mirror is (`Warn`;
the line `mirror_failed` writes). Inside a `batch` (a decision, a stage's verdicts, a rollback)
listeners hear nothing until the outermost batch ends, then every change of it at once, so a
listener that rewrites a whole copy (MLflow's) does it once, not once per record.
"""

from __future__ import annotations

import logging
import re
import shlex
import threading
import unicodedata
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from ratchet.errors import CandidateStateError, RatchetError, StateFileError
from ratchet.files import append_line, exclusive, read_jsonl_numbered

log = logging.getLogger(__name__)

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
NAME_MAX, WHO_MAX, WHY_MAX = 100, 100, 2000
NAME_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*\Z")  # \Z: "$" would let a trailing newline in
# shown as text they reorder or hide what follows them (a reason that reads backwards)
BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")

Warn = Callable[[str], None]  # told of each mirror that failed after a record (one line each)
RETRY = "it is retried by the next decision"


def log_warning(line: str) -> None:
    """Where a mirror's failure goes when no one asked to hear it (a stage): the log."""
    log.warning("%s", line)


def mirror_failed(what: str, exc: BaseException, retry: str = RETRY) -> str:
    """The one warning line for a mirror (or a listener) that failed after its record."""
    lines = str(exc).strip().splitlines()
    reason = lines[0] if lines else type(exc).__name__
    return f"the {what} failed: {reason}; {retry}"


class InvalidInputError(RatchetError):
    """A name, who or why a record cannot hold; nothing was written. (Not a state conflict:
    the HTTP API answers it 422, not 409.)"""


def shown(value: str, limit: int = 32) -> str:
    """`value` safe to print in one ASCII line: escaped and cut, never the raw input."""
    return ascii(value[:limit]) + ("..." if len(value) > limit else "")


def check_name(name: Any, what: str = "candidate") -> str:
    """A name a record may hold: 1-100 letters, digits, '.', '_', '-' (so never a path)."""
    if not isinstance(name, str) or len(name) > NAME_MAX or not NAME_RE.match(name):
        size = f"{len(name)} characters" if isinstance(name, str) else type(name).__name__
        raise InvalidInputError(
            f"{shown(str(name))} ({size}) is not a valid {what} name",
            f"a name is 1-{NAME_MAX} characters of letters, digits, '.', '_' and '-'",
        )
    return name


def check_text(value: Any, field: str, limit: int, newlines: bool = False) -> str:
    """Text a record may hold (`who`, `why`): non-empty UTF-8 text, at most `limit`
    characters, no control or bidi characters (newlines and tabs too, if `newlines`)."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{field} must be text, not {type(value).__name__}")
    for i, c in enumerate(value, 1):
        if 0xD800 <= ord(c) <= 0xDFFF:
            raise InvalidInputError(
                f"{field} is not valid UTF-8 text (character {i} is a byte that does not decode)",
                "type it again as UTF-8 text",
            )
    for i, c in enumerate(value, 1):
        if (unicodedata.category(c) == "Cc" and not (newlines and c in "\n\t")) or c in BIDI:
            raise InvalidInputError(
                f"{field} holds a control character (U+{ord(c):04X} at character {i})",
                "write it as plain text",
            )
    if not value.strip():
        raise InvalidInputError(f"{field} is empty", "say who decides and why")
    if len(value) > limit:
        raise InvalidInputError(f"{field} is longer than {limit} characters ({len(value)})", "shorten it")
    return value


def check_input(name: Any, who: Any, why: Any, what: str = "candidate") -> None:
    """Everything a record takes from outside, checked before anything is read or written:
    the one place the CLI, the HTTP API, the `promote` flow and the stages are checked."""
    check_name(name, what)
    check_text(who, "who", WHO_MAX)
    check_text(why, "reason", WHY_MAX, newlines=True)


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

    @property
    def is_amendment(self) -> bool:
        """A record that re-pins the content hash and leaves the status where it was."""
        return self.from_status == self.to_status


def latest_evidence(records: Iterable[Record]) -> dict[str, dict[str, Any]]:
    """name -> the evidence of its latest gate decision (the gate's records carry its
    `decision`; a person's do not)."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        if "decision" in r.evidence:
            out[r.name] = r.evidence
    return out


def read_log(root: Path, what: str) -> list[Record]:
    """The audit log under `root`, read strictly (a damaged line or an impossible history is
    one StateFileError); creates nothing (a preflight may call it)."""
    numbered = read_jsonl_numbered(root / AUDIT, Record, what)
    check_history(numbered, root / AUDIT, what)
    return [r for _, r in numbered]


def check_history(numbered: Iterable[tuple[int, Record]], path: Path, what: str) -> None:
    """Refuse a log in which some line does not follow from the one before it for its name
    (module docstring): one line that names it and how to recover."""
    at: dict[str, tuple[int, Status]] = {}  # name -> (line, status) of its latest record
    for number, r in numbered:
        name, frm, to = ascii(r.name), r.from_status, r.to_status
        seen = at.get(r.name)
        problem = ""
        if seen is None and (frm is not None or to != "candidate"):
            problem = f"moves {name} {frm or 'nowhere'} → {to}, but {name} was never filed"
        elif seen is not None and frm is None:
            problem = f"files {name} again (filed again after line {seen[0]}); a name is filed once"
        elif seen is not None and frm != seen[1]:
            problem = f"moves {name} {frm} → {to}, but {name} is {seen[1]} there (line {seen[0]})"
        elif seen is not None and to != frm and to not in TRANSITIONS[seen[1]]:
            problem = f"moves {name} {frm} → {to}, which the lifecycle does not allow"
        if problem:
            quoted = shlex.quote(str(path))  # the command must give a shell back this very path
            raise StateFileError(
                f"{what} {path} line {number} {problem}",
                f"ratchet did not write that line and nothing is live on its word: restore the file "
                f"from a backup, or delete the line if it was added by hand (sed -i '{number}d' {quoted})",
            )
        at[r.name] = (number, to)


def promoted_order(records: list[Record]) -> list[str]:
    """The candidates `records` leave promoted, in the order they (last) went live
    (an amendment is no move: it does not make a candidate go live again)."""
    order: dict[str, None] = {}
    for r in records:
        if r.is_amendment:
            continue
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
        check_input(name, who, why, self.what)
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
        check_input(name, who, why, self.what)
        with self.locked():
            last = self._latest(name)
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

    def _latest(self, name: str) -> Record:
        """The last record of `name` (call under the lock), or one line: there is none."""
        last = self.last().get(name)
        if last is None:
            raise self.error(
                f"no {self.what} named {name!r}", f"see `{self.listing}`" if self.listing else ""
            )
        return last

    def amend(
        self, name: str, who: str, why: str, content_hash: str, evidence: dict[str, Any] | None = None
    ) -> Record:
        """Re-pin what `name` is without moving its status (a merge joined a near-duplicate's
        provenance into it): a record whose from_status and to_status are both its status."""
        check_input(name, who, why, self.what)
        with self.locked():
            last = self._latest(name)
            record = Record(
                name=name,
                from_status=last.to_status,
                to_status=last.to_status,
                who=who,
                why=why,
                content_hash=content_hash,
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

    def rollback(
        self,
        name: str,
        who: str,
        why: str,
        retire: Retire,
        check: Callable[[list[str]], object] | None = None,
        key: Callable[[str], str] = str,
        warn: Warn | None = None,
    ) -> list[str]:
        """Undo the promotion of `name` and of every candidate promoted after it, newest first,
        so what is live is exactly what was live just before `name` went live; returns them.

        The kind says what must hold before the first record (`check`, given what will be
        retired: a skill's files, the adapter that is champion again) and retires each one
        through its own `retire` (its transition, which writes its mirrors); `key` is how the
        kind spells a name in its log (an adapter version "03" is "3"). Listeners hear the whole
        rollback at once (`batch`)."""
        why = f"rollback of {name}: {why}"
        check_input(name, who, why, self.what)
        with batch(warn), self.locked():
            undone = self.rollback_set(key(name))
            if check is not None:
                check(undone)
            for n in undone:
                retire(n, "retired", who=who, why=why, expect="promoted")
        return undone

    def _append(self, record: Record) -> None:
        """Callers have just read the whole log under the lock (`last()`), which refuses a
        damaged line, so nothing is ever appended behind one (it would glue onto it). The
        listeners are told once it is on disk (now, or when the current batch ends)."""
        append_line(self.root / AUDIT, record.model_dump_json())
        _recorded(Change(self, record))


class Retire(Protocol):
    """A kind's transition, as a rollback calls it for each candidate it retires."""

    def __call__(self, name: str, to: Status, *, who: str, why: str, expect: Status | None) -> object: ...


# -- listeners: every record, told to whoever keeps a copy outside the kind


@dataclass(frozen=True)
class Change:
    """One record on disk, and the store it was written to."""

    store: Lifecycle
    record: Record


@dataclass(frozen=True)
class Listener:
    """A copy of the lifecycle kept outside the kinds (MLflow's agent versions). `notify` is
    given the changes of one batch (or one record outside a batch), oldest first; if it
    raises, the failure is one warning line naming `what` and saying when it is retried."""

    what: str
    notify: Callable[[Sequence[Change]], object]
    retry: str = RETRY


_listeners: dict[Hashable, Listener] = {}
_listeners_lock = threading.Lock()
_batch = threading.local()  # .changes: the changes held back by the current batch; .warn


def subscribe(listener: Listener, key: Hashable | None = None) -> Callable[[], None]:
    """Tell `listener` of every record from now on, in this process; returns the call that
    unsubscribes it. Subscribing again under the same `key` replaces the earlier listener, so
    a setup that runs many times (every CLI command, every stage) subscribes once."""
    key = object() if key is None else key
    with _listeners_lock:
        _listeners[key] = listener

    def unsubscribe() -> None:
        with _listeners_lock:
            if _listeners.get(key) is listener:
                del _listeners[key]

    return unsubscribe


@contextmanager
def batch(warn: Warn | None = None) -> Iterator[None]:
    """Hold back the listeners until the block ends, then tell each of them every change of
    it at once; a listener that fails goes to `warn` (default: the log). A batch inside a batch
    joins it: the outermost one tells, and its `warn` hears. Changes of a block that raised are
    still told (they are on disk), unless it was interrupted (Ctrl-C, a kill)."""
    if getattr(_batch, "changes", None) is not None:
        yield
        return
    _batch.changes, _batch.warn = [], warn or log_warning
    try:
        yield
    except Exception:
        _tell_held()
        raise
    except BaseException:
        _batch.changes = None
        raise
    else:
        _tell_held()


def _tell_held() -> None:
    changes, warn = _batch.changes, _batch.warn
    _batch.changes = None
    if changes:
        _tell(changes, warn)


def _recorded(change: Change) -> None:
    held = getattr(_batch, "changes", None)
    if held is not None:
        held.append(change)
    else:
        _tell([change], log_warning)


def _tell(changes: Sequence[Change], warn: Warn) -> None:
    """Each listener, once, of these changes; a failure is a warning (the records stand)."""
    with _listeners_lock:
        listeners = list(_listeners.values())
    for listener in listeners:
        try:
            listener.notify(changes)
        except Exception as exc:  # noqa: BLE001 - a copy never undoes or fails a record
            warn(mirror_failed(listener.what, exc, listener.retry))
