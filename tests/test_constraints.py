"""Argument constraints: mined from the policy's own successful calls of tools without a
menu, written into the tool's schema before each model call, filed as skills of kind
`constraint`. Against the real engine, what a constraint promises is mechanical (the model
cannot write an argument outside it), so that is what is checked on every call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ratchet.agents.actor import ActorSettings, build_actor
from ratchet.agents.rollout import RolloutSlot, run_rollout
from ratchet.agents.testing import ScriptedChatModel, call
from ratchet.errors import SkillFileError
from ratchet.skills.constraints import (
    ENUM_MAX,
    constrain_args,
    constraint_skill,
    lines,
    mine_constraints,
    numbers,
    shape_of,
    spans,
)
from ratchet.skills.format import load, write_files
from ratchet.suites.base import ActionError, Episode, StepResult, Suite
from ratchet.types import ArgConstraint, ConstraintSpec, Policy, Task, ToolCall, ToolSpec
from tests.factories import traj

CITIES = {"Oslo": "rain, 4 C", "Lima": "sunny, 22 C", "New York": "snow, -2 C", "Cape Town": "windy, 18 C"}
WEATHER = ToolSpec(
    name="get_weather",
    description="Current weather in a city.",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "number"}},
        "required": ["city"],
    },
)


class Desk(Episode):
    """One call of get_weather; success if it names the task's city."""

    def reset(self) -> StepResult:
        return StepResult(f"User: what is the weather in {self.task.spec['city']} over 3 days?")

    def tools(self) -> list[ToolSpec]:
        return [WEATHER]

    def step(self, c: ToolCall) -> StepResult:
        city = c.args.get("city")
        if not isinstance(city, str):
            raise ActionError("get_weather needs a city")
        ok = city.strip().lower() == self.task.spec["city"].lower()
        return StepResult(CITIES.get(city.strip(), f"unknown city {city!r}"), done=True, success=ok)


class DeskSuite(Suite):
    name = "desk-test"
    key_type = str

    def make_task(self, subset, split, seed):  # type: ignore[no-untyped-def]
        return self.new_task(
            subset, split, seed, instruction="Call the right tool.", max_steps=1, spec={"city": seed}
        )

    def split_seeds(self, subset, split, n):  # type: ignore[no-untyped-def]
        return list(CITIES)[:n]

    def episode(self, task: Task) -> Episode:
        return Desk(task)


SUITE = DeskSuite()
CITY = ConstraintSpec(name="c-args", tools={"get_weather": {"city": ArgConstraint(from_context=True)}})


def _won(
    task_id: str, city: str, *, success: bool = True, kind: str = "agent", menu: list[str] | None = None
):  # type: ignore[no-untyped-def]
    """One call of get_weather(city, days=3) on the task of that city, its menu recorded."""
    seen = f"User: what is the weather in {task_id.rsplit(':', 1)[-1]} over 3 days?"
    t = traj(
        [city],
        success=success,
        task=task_id,
        tid=f"t-{task_id}-{city}-{success}-{kind}",
        observations=[seen],
        tool="get_weather",
        arg="city",
        instruction="Call the right tool.",
        kind=kind,
    )
    t.steps[0].tool_call.args["days"] = 3  # type: ignore[union-attr]
    t.steps[0].menu = ["get_weather: *"] if menu is None else menu
    return t


# ----------------------------------------------------------------------------- applying


def test_spans_and_numbers_are_what_the_text_says_words_kept_whole():
    found = spans(["User: what is the weather in New York, today? It's -2.5 C."])
    assert "New York" in found and "weather in New York" in found and "It's" in found
    assert "York today" not in found  # a comma ends a span
    assert numbers(["100 EUR is 90.5 USD, not -2"]) == [100, 90.5, -2]


def test_a_from_context_string_becomes_an_enum_of_what_was_read_and_the_firing_is_named():
    tools, fired = constrain_args([WEATHER], [CITY], ["Call the right tool.", "User: weather in Oslo?"])
    enum = tools[0].parameters["properties"]["city"]["enum"]
    assert "Oslo" in enum and "Lima" not in enum and fired == [CITY.name]
    assert tools[0].parameters["properties"]["days"] == {"type": "number"}  # not constrained: as it was
    assert WEATHER.parameters["properties"]["city"] == {"type": "string", "maxLength": 40}  # not mutated


def test_numbers_lengths_and_whole_numbers_and_what_is_left_alone():
    spec = ConstraintSpec(
        name="n",
        tools={
            "get_weather": {
                "days": ArgConstraint(from_context=True, integer=True),
                "city": ArgConstraint(max_length=12),
            }
        },
    )
    tools, fired = constrain_args([WEATHER], [spec], ["weather for 3 days, or 2.5"])
    props = tools[0].parameters["properties"]
    assert props["days"] == {"type": "integer", "enum": [3]}  # 2.5 is not whole
    assert props["city"] == {"type": "string", "maxLength": 12}
    assert fired == ["n"]
    # a bound looser than the schema's own is not written; another tool's constraint does nothing
    loose = ConstraintSpec(name="l", tools={"get_weather": {"city": ArgConstraint(max_length=99)}})
    other = ConstraintSpec(name="o", tools={"get_time": {"city": ArgConstraint(from_context=True)}})
    assert constrain_args([WEATHER], [loose, other], ["Oslo"]) == ([WEATHER], [])
    # an enumerated argument is the menu's, the rules' to narrow
    menu = WEATHER.model_copy(
        update={
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Lima"]}}}
        }
    )
    assert constrain_args([menu], [CITY], ["Oslo"]) == ([menu], [])


def test_too_many_values_leave_the_argument_free_rather_than_a_grammar_too_large():
    long_text = " ".join(f"w{i}" for i in range(ENUM_MAX))  # ~4 x ENUM_MAX spans
    assert constrain_args([WEATHER], [CITY], [long_text]) == ([WEATHER], [])


# ------------------------------------------------------------------------------- mining


def test_mined_from_own_train_successes_across_tasks_only():
    wins = [_won("desk-test:a:train:Oslo", "Oslo"), _won("desk-test:a:train:New York", "new york")]
    (mined,) = mine_constraints("desk-test:a", wins)
    spec = mined.spec
    assert list(spec.tools) == ["get_weather"] and spec.name == "a-args"
    # "new york" was copied from "New York": the shape is the text's; lengths differ: no minimum
    city = ArgConstraint(from_context=True, max_length=16, shape="title")
    assert spec.tools["get_weather"] == {"city": city, "days": ArgConstraint(from_context=True, integer=True)}
    assert set(mined.trajectory_ids) == {t.id for t in wins}
    # one task is not a pattern; failures, dev tasks and other families are not evidence
    noise = [
        _won("desk-test:a:train:Lima", "Paris", success=False),
        _won("desk-test:a:dev:Lima", "Lima"),
        _won("desk-test:b:train:Lima", "Lima"),
    ]
    assert mine_constraints("desk-test:a", [wins[0], *noise]) == []
    # one length for every success is a format (a code), kept as the shortest a value may be
    codes = [_won("desk-test:a:train:Oslo", "OSL"), _won("desk-test:a:train:Lima", "LIM")]
    for t in codes:
        t.steps[0].observation = t.steps[0].observation + " (codes OSL, LIM)"
    (fixed,) = mine_constraints("desk-test:a", codes)
    assert fixed.spec.tools["get_weather"]["city"] == ArgConstraint(
        from_context=True, max_length=8, min_length=3, shape="upper"
    )
    # a reference solution is: it shows the argument's shape (its steps record no menu)
    expert = _won("desk-test:a:train:Lima", "Lima", kind="expert")
    expert.steps[0].menu = None
    (both,) = mine_constraints("desk-test:a", [wins[0], expert])
    assert both.spec.tools["get_weather"]["city"].shape == "title" and expert.id in both.trajectory_ids
    # a value the agent never read is not from context
    (guess,) = mine_constraints("desk-test:a", [*wins, _won("desk-test:a:train:Lima", "Peru")])
    assert guess.spec.tools["get_weather"]["city"] == ArgConstraint(max_length=16)
    # an enumerated tool (a menu) is the rules' business, wherever a step listed its values
    menu = ["get_weather: oslo", "get_weather: lima"]
    assert mine_constraints("desk-test:a", [*wins, _won("desk-test:a:train:Oslo", "Oslo", menu=menu)]) == []


def test_one_success_that_did_not_copy_among_many_still_binds_the_argument():
    """The LangGraph units agent once wrote "meter" for the question's "meters": one such
    success among six or more must not unbind the units of every other call."""
    tasks = ["Oslo", "Lima", "New York", "Cape Town"]
    four = [_won(f"desk-test:a:train:{c}", c) for c in tasks]
    five = [*four, _won("desk-test:a:train:Oslo", "Oslo")]
    miss = [_won("desk-test:a:train:Lima", "Peru"), _won("desk-test:a:train:Oslo", "Chile")]

    def city(trajs):  # type: ignore[no-untyped-def]
        (mined,) = mine_constraints("desk-test:a", trajs)
        return mined.spec.tools["get_weather"]["city"]

    assert not city([*four, miss[0]]).from_context  # 4 copied and 1 not, of 5: too few to tell
    assert city([*five, miss[0]]).from_context  # 5 copied and 1 not, of 6
    assert not city([*five, *miss]).from_context  # two that did not copy: the argument stays free


PREMISES = (  # as reasoning-gym's propositional_logic writes its premises
    "Here is the question:\nGiven:\n1. P\n.2. (Q ∧ P)\n.3. ¬(R ∨ Q)\n"
    ".What can we conclude from the above statements?"
)
ANSWER = ToolSpec(
    name="answer",
    description="Your final answer.",
    parameters={"type": "object", "properties": {"answer": {"type": "string", "maxLength": 200}}},
)


def test_lines_drop_list_markers_and_keep_a_formula_whole():
    assert lines([PREMISES]) == [
        "Here is the question:",
        "Given:",
        "P",
        "(Q ∧ P)",
        "¬(R ∨ Q)",
        ".What can we conclude from the above statements?",
    ]
    assert lines(["- a  b ", "* c", "2) d", "", "3.5 C is warm"]) == ["a b", "c", "d", "3.5 C is warm"]
    assert lines(["-5 degrees", "./configs/a.yaml", "-"]) == ["-5 degrees", "./configs/a.yaml"]


def _answered(n: int, value: str, premises: str = PREMISES):  # type: ignore[no-untyped-def]
    t = traj(
        [value],
        success=True,
        task=f"logic-test:a:train:{n}",
        tid=f"t-{n}-{value}",
        observations=[premises],
        tool="answer",
        arg="answer",
        instruction="Answer the question.",
    )
    t.steps[0].menu = ["answer: *"]
    return t


def test_restated_premises_bind_an_answer_to_the_lines_read():
    """Successful answers that restate a premise (a formula, not words alone) become an
    answer held to the lines of the question; an answer that restated nothing stays free."""
    other = PREMISES.replace("(Q ∧ P)", "(S → Q)")
    (mined,) = mine_constraints("logic-test:a", [_answered(1, "(Q ∧ P)"), _answered(2, "(S → Q)", other)])
    rule = mined.spec.tools["answer"]["answer"]
    assert rule.from_context and rule.whole_line and rule.max_length == 14
    (narrowed,), fired = constrain_args([ANSWER], [mined.spec], ["Answer the question.", other])
    enum = narrowed.parameters["properties"]["answer"]["enum"]
    assert fired == [mined.spec.name] and "(S → Q)" in enum and "P" in enum and "(Q ∧ P)" not in enum
    assert all(len(v) <= 14 for v in enum)  # the question's longer lines are off the menu
    # a derived answer (not a line read) among two: no line constraint, only the length bound
    (free,) = mine_constraints("logic-test:a", [_answered(1, "(Q ∧ P)"), _answered(2, "(Q ∨ S)", other)])
    assert free.spec.tools["answer"]["answer"] == ArgConstraint(max_length=14)
    # a value that is a line and words alone ("P" on its own line): lines, the narrower menu
    (both,) = mine_constraints("logic-test:a", [_answered(1, "P"), _answered(2, "P", other)])
    assert both.spec.tools["answer"]["answer"].whole_line


def test_a_listed_path_passed_on_binds_the_argument_to_the_listed_lines():
    """A search lists files one per line and a success opens one of them: a path is not words
    alone (no span holds it), a whole line is."""

    def opened(n: int, listing: list[str], chosen: str):  # type: ignore[no-untyped-def]
        t = traj(
            [chosen],
            success=True,
            task=f"files-test:a:train:{n}",
            tid=f"f-{n}",
            observations=["Found:\n" + "\n".join(f"- {p}" for p in listing)],
            tool="open_file",
            arg="path",
            instruction="Open the report.",
        )
        t.steps[0].menu = ["open_file: *"]
        return t

    wins = [
        opened(1, ["/srv/a/notes.txt", "/srv/a/report-2024.pdf"], "/srv/a/report-2024.pdf"),
        opened(2, ["/srv/b/report-q3.pdf", "/srv/b/todo.md"], "/srv/b/report-q3.pdf"),
    ]
    (mined,) = mine_constraints("files-test:a", wins)
    assert mined.spec.tools["open_file"]["path"].whole_line
    tool = ToolSpec(
        name="open_file",
        description="Open a file.",
        parameters={"type": "object", "properties": {"path": {"type": "string"}}},
    )
    (narrowed,), _ = constrain_args([tool], [mined.spec], ["Found:\n- /srv/c/x.pdf\n- /srv/c/y.txt"])
    assert narrowed.parameters["properties"]["path"]["enum"] == ["Found:", "/srv/c/x.pdf", "/srv/c/y.txt"]


def test_a_constraint_skill_round_trips_and_an_edit_is_refused(tmp_path: Path):
    wins = [_won("desk-test:a:train:Oslo", "Oslo"), _won("desk-test:a:train:Lima", "Lima")]
    skill = constraint_skill("desk-test:a", mine_constraints("desk-test:a", wins)[0], "e", 1)
    write_files(skill, tmp_path / skill.name)
    back = load(tmp_path / skill.name)
    assert back == skill and back.constraint_spec().name == skill.name
    path = tmp_path / skill.name / "scripts" / "constraint.json"
    data = json.loads(path.read_text())
    data["tools"]["get_weather"]["city"]["from_context"] = False
    path.write_text(json.dumps(data))
    with pytest.raises(SkillFileError, match="changed after it was written"):
        load(tmp_path / skill.name)
    path.write_text("{not json")
    with pytest.raises(SkillFileError, match="constraint file unreadable"):
        load(tmp_path / skill.name)


def test_a_constraint_filed_before_whole_line_existed_keeps_its_content_hash():
    """A library's constraint skills are pinned by content hash: a field added later must
    not change the hash of those filed without it (they would load as edited)."""
    from ratchet.skills.format import skill_hash

    spec = ConstraintSpec(
        name="a-args",
        tools={"get_weather": {"city": ArgConstraint(from_context=True, max_length=16, shape="title")}},
    )
    assert skill_hash("a-args", "d", "b", None, constraint=spec) == "9bd0e800e95069d5"  # as filed before
    lined = ConstraintSpec(name="a-args", tools={"answer": {"answer": ArgConstraint(whole_line=True)}})
    assert lined.model_dump(mode="json")["tools"]["answer"]["answer"]["whole_line"] is True
    assert ConstraintSpec.model_validate(lined.model_dump(mode="json")) == lined


def test_constraints_change_the_policy_version_and_their_absence_keeps_it():
    base = Policy(model="m")
    assert Policy(model="m", constraints=()).version == base.version
    assert Policy(model="m", constraints=(CITY,)).version != base.version


# ------------------------------------------------------------------------------- playing


def test_the_actor_offers_the_constrained_schema_and_records_the_firing():
    llm = ScriptedChatModel(script=[call("get_weather", city="Oslo")])
    task = SUITE.make_task("a", "train", "Oslo")
    policy = Policy(model="m", constraints=(CITY,))
    t = run_rollout(build_actor(llm), SUITE, RolloutSlot("e", 0, task, 0), policy, ActorSettings(max_steps=1))
    assert t.success and t.steps[0].rules == [CITY.name]
    enum = llm.calls[0]["tools"][0]["function"]["parameters"]["properties"]["city"]["enum"]
    assert "Oslo" in enum and "weather in Oslo" in enum


@pytest.mark.integration
def test_the_embedded_model_only_ever_writes_a_city_it_read(embedded_server: str) -> None:
    from ratchet.agents.model import chat_model
    from ratchet.server.weights import BASE_MODEL_NAME

    actor = build_actor(chat_model(embedded_server, BASE_MODEL_NAME))
    policy = Policy(model=BASE_MODEL_NAME, constraints=(CITY,))
    for i, city in enumerate(CITIES):
        task = SUITE.make_task("a", "test", city)
        t = run_rollout(actor, SUITE, RolloutSlot("e", 0, task, i), policy, ActorSettings(max_steps=1))
        assert t.status == "finished" and t.steps[0].tool_call is not None, t.error
        written = t.steps[0].tool_call.args["city"]
        read = spans([task.instruction, t.steps[0].observation])
        assert written in read and t.steps[0].rules == [CITY.name]


@pytest.mark.integration
def test_the_embedded_model_answers_a_logic_task_only_with_a_line_it_read(embedded_server: str) -> None:
    """The real reasoning-gym suite and the embedded model: under a whole-line constraint on
    the answer, every answer it writes is a line of the question (a premise, its number
    dropped), whatever it would have written free (the base model writes "1. P")."""
    from ratchet.agents.model import chat_model
    from ratchet.server.weights import BASE_MODEL_NAME
    from ratchet.suites.reasoning_gym import SPLIT_BASES, ReasoningGymSuite

    suite = ReasoningGymSuite(subsets=["propositional_logic"])
    lined = ConstraintSpec(
        name="logic-args", tools={"answer": {"answer": ArgConstraint(from_context=True, whole_line=True)}}
    )
    actor = build_actor(chat_model(embedded_server, BASE_MODEL_NAME))
    policy = Policy(model=BASE_MODEL_NAME, constraints=(lined,))
    answered = 0
    for i in range(3):
        task = suite.make_task("propositional_logic", "test", SPLIT_BASES["test"] + i)
        t = run_rollout(actor, suite, RolloutSlot("e", 0, task, i), policy, ActorSettings(max_steps=2))
        assert t.status == "finished", t.error
        for pos, step in enumerate(t.steps):
            if step.tool_call is not None and step.tool_call.name == "answer":
                read = lines([task.instruction, *(s.observation for s in t.steps[: pos + 1])])
                assert step.tool_call.args["answer"] in read and "logic-args" in step.rules
                answered += 1
    assert answered, "the model never answered: nothing was checked"


def test_values_outside_the_schemas_own_length_bounds_are_not_offered():
    short = WEATHER.model_copy(
        update={"parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}}}
    )
    tools, _ = constrain_args([short], [CITY], ["weather in Oslo or New York"])
    enum = tools[0].parameters["properties"]["city"]["enum"]
    assert "Oslo" in enum and "New York" not in enum and all(len(v) <= 4 for v in enum)


def test_shapes_and_lengths_of_successes_narrow_a_from_context_enum():
    assert shape_of(["EUR", "USD"]) == "upper" and shape_of(["Oslo", "New York"]) == "title"
    assert shape_of(["Oslo", "new york"]) is None and shape_of(["R2D2"]) is None
    code = ArgConstraint(from_context=True, min_length=3, shape="upper")
    city = ArgConstraint(from_context=True, min_length=4, shape="title")
    money = ToolSpec(
        name="convert",
        description="",
        parameters={
            "type": "object",
            "properties": {"source": {"type": "string"}, "city": {"type": "string"}},
        },
    )
    spec = ConstraintSpec(name="m", tools={"convert": {"source": code, "city": city}})
    tools, _ = constrain_args([money], [spec], ["I have 150 EUR: how many JPY is that in New York?"])
    props = tools[0].parameters["properties"]
    assert props["source"]["enum"] == ["EUR", "JPY"]  # not "I", not "150", not "how"
    assert props["city"]["enum"] == ["New York", "York"]  # capitalized words, 4 characters or more
