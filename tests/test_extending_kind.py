"""The worked example of docs/extending.md, "Adding a candidate kind": a toy kind `note` (one
line the prompt shows), added by one registration and one distill source, filed in a real
skill library, applied by `policy_with`, gated, promoted by a decision with the lifecycle's
listener hearing it, and rolled back. No model, no MLflow: fast."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from ratchet.config import load_settings
from ratchet.decisions import apply
from ratchet.flows import distill
from ratchet.flows.agent_versions import skill_template
from ratchet.flows.distill import Evidence, Source
from ratchet.flows.gate import file_verdict
from ratchet.flows.runtime import policy_with
from ratchet.kinds import CandidateKind, UnknownKindError, kind_of, register, unregister
from ratchet.lifecycle import Change, Listener, subscribe
from ratchet.skills.format import Skill
from ratchet.skills.intervention import GateDecision
from ratchet.skills.library import SkillLibrary
from ratchet.types import Policy, SkillText, Trajectory
from tests.factories import traj


# ---- the kind: one module (here, this test module) ---------------------------------------
def add_notes(policy: Policy, notes: Sequence[Skill]) -> Policy:
    """A note is one more line among the policy's prompt skills."""
    lines = tuple(SkillText(name=n.name, description=n.description, body=n.body) for n in notes)
    return policy.model_copy(update={"skills": policy.skills + lines})


def note_template(note: Skill) -> str:
    return f"Note: {note.body}"


NOTE = CandidateKind("note", "skills", add_notes, note_template, description="one line the prompt shows")


# ---- its distill source: what evidence makes a note ----------------------------------------
def draft_notes(ev: Evidence, family: str) -> list[distill.Draft]:
    """A family most of whose train rollouts failed gets a note to slow down."""
    runs = ev.families[family]
    failed = [t for t in runs if not t.success]
    if len(failed) * 2 <= len(runs):
        return []
    note = Skill(
        name=f"{family.split(':')[-1]}-note",
        description=f"a note for {family}",
        body="Read the whole observation before you act.",
        kind="note",
        family=family,
        evolution=ev.settings.evolution,
        generation=ev.generation,
        provenance=[t.id for t in failed],
    )
    return [note]


# ---- ... and one line each in the two registries --------------------------------------------
@pytest.fixture
def note_kind() -> Iterator[CandidateKind]:
    register(NOTE)  # ratchet.kinds.KINDS
    distill.SOURCES.append(Source("note", draft_notes))  # distill's candidate sources
    try:
        yield NOTE
    finally:
        distill.SOURCES.pop()
        unregister("note")


def _failures(n: int, family: str = "textworld-express:coin") -> list[Trajectory]:
    return [traj(["look"], success=False, task=f"{family}:train:{i}", tid=f"t{i}") for i in range(n)]


def test_a_note_goes_from_evidence_to_the_live_policy_and_back(
    note_kind: CandidateKind, tmp_path: Path
) -> None:
    settings = load_settings({"data_dir": tmp_path})
    library = SkillLibrary(settings.skills_dir, settings.index_dir)

    # distill: the source drafts a note from the evidence; it is filed as a candidate
    ev = Evidence(SimpleNamespace(settings=settings), 1, families={"textworld-express:coin": _failures(3)})  # type: ignore[arg-type]
    (note,) = note_kind_source(ev)
    added = library.add(note)
    assert (added.action, library.get(added.name).status) == ("added", "candidate")

    # policy_with: the kind says what a note does to a policy (a gate's candidate arm)
    base = Policy(model="m")
    arm = policy_with(base, [library.get(added.name)])
    assert [s.body for s in arm.skills] == ["Read the whole observation before you act."]
    assert arm.version != base.version
    assert skill_template(library.get(added.name)) == "Note: Read the whole observation before you act."

    # the gate files its verdict; a person's decision promotes it, and the listener hears it
    heard: list[list[Change]] = []
    unsubscribe = subscribe(Listener("test listener", lambda changes: heard.append(list(changes))))
    try:
        accept = GateDecision("accept", "significant net gain", 6, 0, 10, 16, 0.016, 5.0, 1)
        assert file_verdict(library, added.name, accept, {"decision": "accept"}, "verify") == "verified"
        outcome = apply(library, added.name, "promote", who="ann", why="helps")
        assert outcome.changed == [added.name] and outcome.warnings == []
        promoted = heard[-1]
        assert [(c.record.name, c.record.to_status) for c in promoted] == [(added.name, "promoted")]
        assert promoted[0].store.root == library.root
        live = policy_with(base, library.list(status="promoted"))  # what LoopRuntime.live_policy does
        assert live.version == arm.version

        # rollback retires it: the live set is what it was before the note went live
        outcome = apply(library, added.name, "rollback", who="ann", why="regressed")
        assert outcome.changed == [added.name] and library.get(added.name).status == "retired"
        assert [c.record.to_status for c in heard[-1]] == ["retired"]
        assert policy_with(base, library.list(status="promoted")).version == base.version
    finally:
        unsubscribe()


def note_kind_source(ev: Evidence) -> list[Skill]:
    """The drafts distill's registered sources make for the evidence's families (the note's among them)."""
    (src,) = [s for s in distill.SOURCES if s.name == "note"]
    return [d for family in sorted(ev.families) for d in src.draft(ev, family) if isinstance(d, Skill)]


def test_a_listener_that_fails_is_a_warning_of_the_decision(note_kind: CandidateKind, tmp_path: Path) -> None:
    settings = load_settings({"data_dir": tmp_path})
    library = SkillLibrary(settings.skills_dir, settings.index_dir)
    ev = Evidence(SimpleNamespace(settings=settings), 1, families={"textworld-express:coin": _failures(2)})  # type: ignore[arg-type]
    (note,) = note_kind_source(ev)
    name = library.add(note).name
    library.transition(name, "verified", who="verify", why="gate passed")

    def down(changes: Sequence[Change]) -> None:
        raise ConnectionError("connection refused")

    unsubscribe = subscribe(Listener("copy", down))
    try:
        outcome = apply(library, name, "promote", who="ann", why="helps")
    finally:
        unsubscribe()
    assert library.get(name).status == "promoted"  # the decision stands
    assert outcome.warnings == ["the copy failed: connection refused; it is retried by the next decision"]


def test_an_unknown_kind_is_one_clear_line(note_kind: CandidateKind) -> None:
    assert kind_of("note") is NOTE
    with pytest.raises(UnknownKindError, match="no candidate kind named 'memo' is registered"):
        kind_of("memo")
    with pytest.raises(ValidationError, match="not a registered kind of the skill library"):
        Skill(name="x", description="x", body="x", kind="memo", family="f:s", evolution="e", generation=0)
    with pytest.raises(ValueError, match="different candidate kind named 'note'"):
        register(CandidateKind("note", "skills", add_notes, str))
    with pytest.raises(ValueError, match="not a registered kind of the skill library"):  # another store's
        Skill(name="x", description="x", body="x", kind="adapter", family="f:s", evolution="e", generation=0)


def test_skills_list_takes_a_registered_kind_and_refuses_another_in_one_line(
    note_kind: CandidateKind, tmp_path: Path
) -> None:
    """The CLI's --kind reads the registry: a kind a module registered is listed by name, an
    unknown one is one line naming the registered ones, and nothing is created."""
    from typer.testing import CliRunner

    from ratchet.cli.main import app

    def skills_list(kind: str):  # noqa: ANN202
        data = str(tmp_path / "data")
        return CliRunner().invoke(app, ["--data-dir", data, "skills", "list", "--kind", kind])

    refused = skills_list("rulez")
    lines = [ln for ln in refused.stderr.splitlines() if ln.strip()]
    assert refused.exit_code == 2 and len(lines) == 1, refused.output
    choices = lines[0].split("choose from")[1]
    assert "'rulez'" in lines[0] and "rule" in choices and "note" in choices
    assert not (tmp_path / "data").exists()
    assert skills_list("note").exit_code == 0
