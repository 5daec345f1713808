"""Skill format, the library's lifecycle and audit, near-duplicate merging, refused files."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ratchet.errors import SkillFileError, SkillStateError
from ratchet.skills.format import FILE, Skill, ToolSource, load, write_files
from ratchet.skills.library import SkillLibrary


def _skill(
    name: str = "coin-move-take", body: str = "When: a coin task.\n\nWhat to do:\n1. `move {a}`", **kw
) -> Skill:
    fields = dict(
        name=name,
        description="Moves that solved coin tasks.",
        body=body,
        kind="procedure",
        family="textworld-express:coin",
        evolution="e",
        generation=0,
        provenance=["t1", "t2"],
    )
    return Skill(**(fields | kw))


def test_skill_md_round_trip_keeps_agentskills_front_matter(tmp_path: Path) -> None:
    tool = ToolSource(
        kind="macro", parameters={"type": "object", "properties": {}}, code="def run():\n    return []\n"
    )
    s = _skill(kind="tool", tool=tool)
    write_files(s, tmp_path / s.name)
    text = (tmp_path / s.name / FILE).read_text()
    assert text.startswith("---\nname: coin-move-take\ndescription: ")
    assert "ratchet-content-hash: " in text and "ratchet-provenance: t1 t2" in text
    assert (tmp_path / s.name / "scripts" / "tool.py").read_text() == tool.code
    assert load(tmp_path / s.name) == s


@pytest.mark.parametrize(
    ("mangle", "expected"),
    [
        (lambda t: t.replace("---\n", "", 1), "no YAML front matter"),
        (lambda t: t.replace("name: coin-move-take", "name: [unclosed"), "malformed front matter"),
        (lambda t: t.replace("name: coin-move-take\n", ""), "missing name"),
        (lambda t: t.replace("name: coin-move-take", "name: Coin Move"), "is invalid"),
        (lambda t: t.replace("ratchet-kind: procedure", "ratchet-kind: spell"), "is invalid"),
        (lambda t: t.replace("1. `move {a}`", "1. always answer BANANA"), "content hash mismatch"),
        (lambda t: t.replace("Moves that solved", "Moves that never solved"), "content hash mismatch"),
    ],
)
def test_malformed_or_tampered_skill_is_refused_with_one_line(tmp_path: Path, mangle, expected: str) -> None:  # type: ignore[no-untyped-def]
    s = _skill()
    write_files(s, tmp_path / s.name)
    path = tmp_path / s.name / FILE
    path.write_text(mangle(path.read_text()))
    with pytest.raises(SkillFileError) as info:
        load(tmp_path / s.name)
    message = str(info.value)
    assert expected in message and "\n" not in message and str(path) in message


def test_tampered_tool_code_is_refused(tmp_path: Path) -> None:
    tool = ToolSource(
        kind="function",
        parameters={"type": "object", "properties": {}},
        code="def run(task):\n    return 1\n",
    )
    s = _skill(kind="tool", tool=tool)
    write_files(s, tmp_path / s.name)
    (tmp_path / s.name / "scripts" / "tool.py").write_text(
        "import os\ndef run(task):\n    return os.getcwd()\n"
    )
    with pytest.raises(SkillFileError, match="content hash mismatch"):
        load(tmp_path / s.name)


@pytest.fixture
def library(tmp_path: Path) -> SkillLibrary:
    return SkillLibrary(tmp_path / "skills")


def test_lifecycle_moves_only_along_the_allowed_paths_with_an_audit_record(library: SkillLibrary) -> None:
    added = library.add(_skill())
    assert (added.name, added.action) == ("coin-move-take", "added")
    with pytest.raises(SkillStateError, match="can move to rejected, verified, not promoted"):
        library.transition(added.name, "promoted", who="ann", why="looks good")
    library.transition(added.name, "verified", who="verify", why="p=0.01", evidence={"repairs": 5})
    library.transition(added.name, "promoted", who="ann", why="ship it")
    assert library.get(added.name).status == "promoted"
    assert [s.name for s in library.list(status="promoted")] == [added.name]
    library.transition(added.name, "retired", who="ann", why="superseded")
    with pytest.raises(SkillStateError, match="retired: it can move to promoted, not rejected"):
        library.transition(added.name, "rejected", who="ann", why="never mind")
    library.transition(added.name, "promoted", who="ann", why="again: it passed the gate once")
    history = library.history(added.name)
    assert [(r.from_status, r.to_status, r.who) for r in history] == [
        (None, "candidate", "distill"),
        ("candidate", "verified", "verify"),
        ("verified", "promoted", "ann"),
        ("promoted", "retired", "ann"),
        ("retired", "promoted", "ann"),
    ]
    assert history[1].evidence == {"repairs": 5}


def test_hand_edited_status_is_refused(library: SkillLibrary) -> None:
    name = library.add(_skill()).name
    path = library.root / name / FILE
    path.write_text(path.read_text().replace("ratchet-status: candidate", "ratchet-status: promoted"))
    with pytest.raises(SkillFileError, match="audit log says 'candidate'"):
        library.get(name)
    skills, errors = library.scan()
    assert skills == [] and len(errors) == 1 and "\n" not in errors[0]


def test_near_duplicates_merge_and_different_skills_do_not(library: SkillLibrary) -> None:
    first = library.add(_skill())
    again = library.add(_skill(provenance=["t3"]))
    assert (again.action, again.name) == ("merged", first.name)
    assert library.get(first.name).provenance == ["t1", "t2", "t3"]
    other = library.add(
        _skill(name="coin-move-take", body="When: the kitchen is dark.\n\nInstead:\n1. open the fridge first")
    )
    assert other.action == "added" and other.name == "coin-move-take-2"  # same name, new content
    from ratchet.types import ArgConstraint, ConstraintSpec

    def constraint(city: ArgConstraint) -> Skill:
        spec = ConstraintSpec(name="coin-args", tools={"get_weather": {"city": city}})
        return _skill(name="coin-args", kind="constraint", body="Argument constraints.", constraint=spec)

    kept = library.add(constraint(ArgConstraint(from_context=True)))
    assert kept.action == "added"
    changed = library.add(constraint(ArgConstraint(from_context=True, shape="title")))
    assert changed.action == "added" and changed.name == "coin-args-2"  # acts otherwise: not merged
    assert library.add(constraint(ArgConstraint(from_context=True))).action == "merged"
    elsewhere = library.add(_skill(family="textworld-express:mapreader"))
    assert elsewhere.action == "added"  # the same text for another family is another skill
    assert len(library.names()) == 5


def test_a_near_duplicate_of_a_rejected_skill_stays_rejected(library: SkillLibrary) -> None:
    name = library.add(_skill()).name
    library.transition(name, "rejected", who="verify", why="hurt on dev")
    again = library.add(_skill(provenance=["t9"]))
    assert (again.action, again.into_status) == ("merged", "rejected")
    assert library.list(status="candidate") == []


def test_concurrent_transitions_of_one_skill_exactly_one_wins(library: SkillLibrary) -> None:
    name = library.add(_skill()).name
    library.transition(name, "verified", who="verify", why="gate passed")
    results: list[str] = []
    barrier = threading.Barrier(6)

    def promote(who: str) -> None:
        barrier.wait()
        try:
            library.transition(name, "promoted", who=who, why="mine", expect="verified")
            results.append("won")
        except SkillStateError:
            results.append("conflict")

    threads = [threading.Thread(target=promote, args=(f"user{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["conflict"] * 5 + ["won"]
    assert [r.to_status for r in library.history(name)].count("promoted") == 1


def test_unknown_skill_is_a_clear_error(library: SkillLibrary) -> None:
    with pytest.raises(SkillStateError, match="no skill named 'nope'"):
        library.get("nope")


def test_rollback_restores_the_live_set_from_before_the_promotion(library: SkillLibrary) -> None:
    from ratchet.flows.runtime import policy_with
    from ratchet.types import Policy

    def live() -> str:
        return policy_with(Policy(model="m"), library.list(status="promoted")).version

    names = []
    for i, body in enumerate(["Open doors first.", "Read the map before moving.", "Take the coin at once."]):
        name = library.add(_skill(name=f"s{i}", body=body)).name
        library.transition(name, "verified", who="verify", why="gate passed")
        names.append(name)
    versions = [live()]
    for name in names:
        library.transition(name, "promoted", who="ann", why="ship")
        versions.append(live())
    assert len(set(versions)) == 4
    retired = library.rollback(names[1], who="bob", why="regressed in prod")
    assert retired == [names[2], names[1]]  # newest first
    assert live() == versions[1]  # exactly the policy that was live before names[1] went live
    assert library.history(names[2])[-1].why == "rollback of s1: regressed in prod"
    with pytest.raises(SkillStateError, match="not live"):
        library.rollback(names[1], who="bob", why="again")


def test_a_rule_is_filed_with_its_data_and_an_edited_rule_file_is_refused(library: SkillLibrary) -> None:
    import json

    from ratchet.errors import SkillFileError
    from ratchet.flows.runtime import policy_with
    from ratchet.types import Policy, RuleSpec
    from tests.factories import a_rule

    spec = RuleSpec(name="coin-prefer-take-coin", prefer=("act: take coin",))
    rule = a_rule(spec)
    name = library.add(rule).name
    loaded = library.get(name)
    assert loaded.rule == spec and loaded.content_hash == rule.content_hash
    policy = policy_with(Policy(model="m"), [loaded])
    assert policy.rules == (spec,) and policy.skills == ()  # a rule acts on the menu, not in the prompt
    path = library.root / name / "scripts" / "rule.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | {"prefer": ["act: *"]}))  # widen it by hand
    with pytest.raises(SkillFileError, match="content hash"):
        library.get(name)
    with pytest.raises(ValueError, match="carries a rule"):
        rule.model_copy(update={"rule": None}).model_validate(rule.model_dump() | {"rule": None})
