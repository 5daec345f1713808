"""The one candidate lifecycle store (`ratchet.lifecycle`) and `ratchet.decisions`, on their
own: the state machine, stale views, rollback, old log layouts, the lock across processes."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
from pathlib import Path

import pytest

from ratchet.decisions import AVAILABLE, decide
from ratchet.errors import CandidateStateError, StateFileError
from ratchet.files import read_jsonl
from ratchet.lifecycle import (
    AUDIT,
    STATUSES,
    TRANSITIONS,
    WHY_MAX,
    InvalidInputError,
    Lifecycle,
    Record,
    check_history,
    check_text,
    latest_evidence,
    read_log,
)


@pytest.fixture
def store(tmp_path: Path) -> Lifecycle:
    return Lifecycle(tmp_path, "thing", listing="ratchet things list")


class Kind:
    """The smallest kind: the store itself, as `decide` sees a kind."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.lifecycle = lifecycle

    def transition(self, name, to, who, why, evidence=None, expect=None, warn=None):  # type: ignore[no-untyped-def]
        return self.lifecycle.transition(name, to, who, why, evidence=evidence, expect=expect)

    def rollback(self, name: str, who: str, why: str, warn=None) -> list[str]:  # type: ignore[no-untyped-def]
        undone = self.lifecycle.rollback_set(name)
        for n in undone:
            self.lifecycle.transition(n, "retired", who, why, expect="promoted")
        return undone

    def mirror(self, warn) -> None:  # type: ignore[no-untyped-def]
        """This kind has no mirrors."""


def _at(store: Lifecycle, name: str, status: str) -> None:
    """File `name` and walk it to `status` along the shortest allowed path."""
    store.file(name, "t", "filed", content_hash="h-" + name)
    path = {
        "candidate": [],
        "verified": ["verified"],
        "rejected": ["rejected"],
        "promoted": ["verified", "promoted"],
        "retired": ["verified", "promoted", "retired"],
    }[status]
    for to in path:
        store.transition(name, to, "t", "walk")  # type: ignore[arg-type]


@pytest.mark.parametrize("start", STATUSES)
@pytest.mark.parametrize("to", STATUSES)
def test_every_move_the_table_does_not_allow_is_refused_and_leaves_no_record(
    store: Lifecycle, start: str, to: str
) -> None:
    _at(store, "x", start)
    before = store.records()
    if to in TRANSITIONS[start]:
        record = store.transition("x", to, "ann", "allowed")  # type: ignore[arg-type]
        assert (record.from_status, record.to_status, record.content_hash) == (start, to, "h-x")
        assert store.status("x") == to
    else:
        with pytest.raises(CandidateStateError, match=f"thing 'x' is {start}"):
            store.transition("x", to, "ann", "not allowed")  # type: ignore[arg-type]
        assert store.records() == before


def test_nothing_reaches_promoted_without_the_gate() -> None:
    """Every path from candidate to promoted passes through verified."""
    reach = {"candidate"}
    frontier = ["candidate"]
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()]:
            if nxt not in reach and nxt != "verified":
                reach.add(nxt)
                frontier.append(nxt)
    assert "promoted" not in reach


def test_a_stale_view_is_refused(store: Lifecycle) -> None:
    _at(store, "x", "verified")
    store.transition("x", "rejected", "bob", "no")
    with pytest.raises(CandidateStateError, match="is rejected, not verified .someone else changed it."):
        decide(Kind(store), "x", "promote", "ann", "yes", expect="verified")


def test_unknown_and_refiled_names(store: Lifecycle) -> None:
    with pytest.raises(CandidateStateError, match="no thing named 'y'. see `ratchet things list`"):
        store.transition("y", "verified", "ann", "?")
    _at(store, "y", "rejected")
    with pytest.raises(CandidateStateError, match="filed already"):
        store.file("y", "t", "again")  # a name is never reused, not even a rejected one


def test_rollback_retires_the_promotion_and_every_later_one_newest_first(store: Lifecycle) -> None:
    for name in "abcd":
        _at(store, name, "promoted")
    decide(Kind(store), "c", "retire", "ann", "by hand")  # already not live: not undone again
    assert store.promoted() == ["a", "b", "d"]
    assert decide(Kind(store), "b", "rollback", "ann", "regressed") == ["d", "b"]
    assert store.promoted() == ["a"]
    decide(Kind(store), "d", "promote", "ann", "back")  # retired -> promoted: it goes live last
    assert store.promoted() == ["a", "d"]
    with pytest.raises(CandidateStateError, match="'b' is not live"):
        decide(Kind(store), "b", "rollback", "ann", "again")


def test_the_buttons_are_exactly_the_moves_the_lifecycle_allows() -> None:
    assert AVAILABLE == {
        "candidate": ["reject"],
        "verified": ["promote", "reject"],
        "promoted": ["retire"],
        "retired": ["promote"],
        "rejected": [],
    }


def test_latest_evidence_is_the_gates_not_a_persons(store: Lifecycle) -> None:
    store.file("x", "t", "filed")
    store.transition("x", "verified", "gate", "p=0.01", evidence={"decision": "accept", "p_value": 0.01})
    store.transition("x", "promoted", "ann", "ship", evidence={"note": "mine"})
    assert store.evidence("x") == {"decision": "accept", "p_value": 0.01}
    assert latest_evidence(store.records()) == {"x": {"decision": "accept", "p_value": 0.01}}


def test_a_line_in_a_layout_ratchet_never_writes_is_one_clear_error(tmp_path: Path) -> None:
    """A record without `name` (e.g. a hand-written `skill`/`version` line) is refused with the
    file and line, never read as some other candidate."""
    line = {"skill": "s", "from_status": None, "to_status": "candidate", "who": "d", "why": "w"}
    (tmp_path / AUDIT).write_text(json.dumps(line) + "\n")
    with pytest.raises(StateFileError) as err:
        Lifecycle(tmp_path, "thing").records()
    assert str(tmp_path / AUDIT) in str(err.value) and "line 1" in str(err.value)


def test_a_damaged_log_is_refused_not_appended_to(store: Lifecycle) -> None:
    _at(store, "x", "verified")
    log = store.root / AUDIT
    log.write_bytes(log.read_bytes() + b'{"name": "x", "from_st')  # a kill mid-append
    with pytest.raises(StateFileError, match="torn line 3"):
        store.transition("x", "promoted", "ann", "ship")
    assert log.read_bytes().endswith(b'"from_st')  # nothing glued on behind it


def test_the_lock_is_reentrant_in_one_thread(store: Lifecycle) -> None:
    store.file("x", "t", "filed")
    with store.locked(), store.locked():  # a kind holds it around its own checks and the change
        store.transition("x", "verified", "gate", "ok")
    assert store.status("x") == "verified"


def _promote(root: str, who: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    try:
        Lifecycle(Path(root), "thing").transition("x", "promoted", who, "race", expect="verified")
        queue.put("won")
    except CandidateStateError as exc:
        queue.put(str(exc))


def test_processes_racing_to_promote_one_wins(store: Lifecycle) -> None:
    _at(store, "x", "verified")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_promote, args=(str(store.root), f"p{i}", queue)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    outcomes = [queue.get(timeout=5) for _ in procs]
    assert outcomes.count("won") == 1
    assert all("is promoted, not verified" in o for o in outcomes if o != "won")
    assert [r.to_status for r in store.records()].count("promoted") == 1


def test_a_record_round_trips(store: Lifecycle) -> None:
    store.file("x", "t", "filed", content_hash="abc")
    (line,) = (store.root / AUDIT).read_text().splitlines()
    assert Record.model_validate_json(line).content_hash == "abc"


# -- the log is read as a history: every line must follow from the one before


def _forge(store: Lifecycle, name: str, from_status: str | None, to_status: str) -> int:
    """Append a record by hand (an attacker, or a bad restore); returns its line number."""
    line = {"name": name, "from_status": from_status, "to_status": to_status, "who": "mallory",
            "why": "trust me", "at": "2026-01-01T00:00:00Z", "content_hash": "h-" + name,
            "evidence": {}}  # fmt: skip
    log = store.root / AUDIT
    with log.open("a") as f:
        f.write(json.dumps(line) + "\n")
    return len(log.read_text().splitlines())


@pytest.mark.parametrize(
    ("start", "forged_from", "what"),
    [
        (None, None, "never filed"),  # a name this log never filed goes straight to promoted
        (None, "verified", "never filed"),  # ... or claims to come from verified
        ("candidate", "candidate", "candidate → promoted"),  # skipping the gate
        ("rejected", "rejected", "rejected → promoted"),  # a rejection undone by hand
        ("rejected", "verified", "is rejected"),  # the record lies about where it came from
    ],
)
def test_an_impossible_history_is_refused_whole_not_taken_as_live(
    store: Lifecycle, start: str | None, forged_from: str | None, what: str
) -> None:
    _at(store, "honest", "promoted")
    if start is not None:
        _at(store, "x", start)
    number = _forge(store, "x", forged_from, "promoted")
    log = store.root / AUDIT
    before = log.read_bytes()
    for read in (
        store.promoted,
        store.last,
        lambda: store.status("honest"),
        lambda: read_log(store.root, "t"),
    ):
        with pytest.raises(StateFileError) as info:
            read()
        message = str(info.value)
        assert f"line {number}" in message and what in message and "\n" not in message
        assert f"sed -i '{number}d'" in message and "restore" in message
    with pytest.raises(StateFileError):  # and nothing is appended behind it
        store.transition("honest", "retired", "ann", "cleanup")
    assert log.read_bytes() == before  # never rewritten by ratchet
    subprocess.run(["sed", "-i", f"{number}d", str(log)], check=True)  # the fix the message gives
    assert store.promoted() == ["honest"]


def test_a_second_filing_of_a_name_is_an_impossible_history(store: Lifecycle) -> None:
    _at(store, "x", "rejected")
    number = _forge(store, "x", None, "candidate")  # re-filed to wash the rejection away
    with pytest.raises(StateFileError, match=f"line {number}.*filed again"):
        store.records()


def test_every_history_ratchet_writes_reads_back(store: Lifecycle) -> None:
    for status in STATUSES:
        _at(store, f"x-{status}", status)
    store.amend("x-promoted", "distill", "merged a near-duplicate", content_hash="h2", evidence={"k": 1})
    assert store.status("x-promoted") == "promoted" and store.records("x-promoted")[-1].content_hash == "h2"


def test_an_amendment_changes_the_pin_not_the_order_things_went_live(store: Lifecycle) -> None:
    for name in "ab":
        _at(store, name, "promoted")
    store.amend("a", "distill", "merged", content_hash="h-a2")
    assert store.promoted() == ["a", "b"]  # 'a' did not go live again
    assert decide(Kind(store), "b", "rollback", "ann", "undo b") == ["b"]


def test_the_committed_audit_logs_are_possible_histories() -> None:
    """Audit logs kept with the benchmark results must stay readable under the history check."""
    root = Path(__file__).resolve().parents[1] / "bench" / "results"
    logs = sorted(root.glob("*_audit.jsonl"))
    assert logs
    for log in logs:
        records = read_jsonl(log, Record, "a committed audit log")
        assert check_history([(i, r) for i, r in enumerate(records, 1)], log, "a committed audit log") is None


# -- what a record may say: one check, before anything is written


@pytest.mark.parametrize(
    ("name", "who", "why", "needle"),
    [
        ("a" * 5000, "ann", "ok", "name"),
        ("../../etc", "ann", "ok", "name"),
        ("x\n", "ann", "ok", "name"),
        ("x", "ann\udcff", "ok", "not valid UTF-8"),  # undecodable argv bytes arrive as lone surrogates
        ("x", "ann", "bad \udcff\udcfe", "not valid UTF-8"),
        ("x", "ann", "\x1b[2J\x1b[Hall good", "control character"),  # clears a reader's terminal
        ("x", "ann\nbob", "ok", "control character"),
        ("x", "ann", "ok \u202egnp.exe", "control character"),  # bidi override: shows text reversed
        ("x", "", "ok", "empty"),
        ("x", "ann", "   ", "empty"),
        ("x", "a" * 101, "ok", "longer than 100"),
        ("x", "ann", "w" * (WHY_MAX + 1), f"longer than {WHY_MAX}"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    store: Lifecycle, name: str, who: str, why: str, needle: str
) -> None:
    _at(store, "x", "verified")
    before = (store.root / AUDIT).read_bytes()
    for attempt in (
        lambda: decide(Kind(store), name, "promote", who, why),
        lambda: store.transition(name, "promoted", who, why),
        lambda: store.file(name, who, why),
    ):
        with pytest.raises(InvalidInputError) as info:
            attempt()
        assert needle in str(info.value) and "\n" not in str(info.value)
        assert len(str(info.value)) < 400 and str(info.value).isascii()  # never echoes the raw input
    assert (store.root / AUDIT).read_bytes() == before


def test_a_multi_line_reason_is_text() -> None:
    check_text("first line\n\tsecond line — ü", "reason", WHY_MAX, newlines=True)


def test_listeners_hear_each_record_once_it_is_on_disk_and_a_batch_at_its_end(store: Lifecycle) -> None:
    from ratchet.lifecycle import Listener, batch, subscribe

    heard: list[list[tuple[str, str, bool]]] = []

    def listen(changes) -> None:  # type: ignore[no-untyped-def]
        on_disk = {(r.name, r.to_status) for r in store.records()}
        heard.append(
            [
                (c.record.name, c.record.to_status, (c.record.name, c.record.to_status) in on_disk)
                for c in changes
            ]
        )
        assert all(c.store is store for c in changes)

    unsubscribe = subscribe(Listener("test", listen))
    try:
        _at(store, "a", "verified")  # outside a batch: one call per record
        assert heard == [[("a", "candidate", True)], [("a", "verified", True)]]
        heard.clear()
        with batch():
            _at(store, "b", "promoted")
            with batch():  # joins the outer batch
                store.transition("a", "promoted", "t", "go")
            assert heard == []
        assert heard == [
            [
                ("b", "candidate", True),
                ("b", "verified", True),
                ("b", "promoted", True),
                ("a", "promoted", True),
            ]
        ]
        heard.clear()
        assert decide(Kind(store), "b", "rollback", "ann", "regressed") == ["a", "b"]  # a decision: one batch
        assert heard == [[("a", "retired", True), ("b", "retired", True)]]
    finally:
        unsubscribe()
    store.file("c", "t", "filed")
    assert len(heard) == 1  # unsubscribed


def test_the_same_key_subscribes_once_and_a_failing_listener_is_a_warning(store: Lifecycle) -> None:
    from ratchet.lifecycle import Listener, batch, subscribe

    calls: list[str] = []
    first = subscribe(Listener("one", lambda changes: calls.append("first")), key="k")
    second = subscribe(Listener("one", lambda changes: calls.append("second")), key="k")  # replaces it

    def down(changes) -> None:  # type: ignore[no-untyped-def]
        raise OSError("disk full\nmore detail")

    third = subscribe(Listener("copy", down, retry="it is retried later"))
    warnings: list[str] = []
    try:
        with batch(warnings.append):
            store.file("a", "t", "filed")
    finally:
        first(), second(), third()
    assert calls == ["second"]
    assert warnings == ["the copy failed: disk full; it is retried later"]
    assert store.status("a") == "candidate"  # the record stands
