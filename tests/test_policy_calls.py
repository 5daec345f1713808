"""One place applies a policy to a model call (`skills/calls.py`): what each built-in kind
does to a call, in which order, and that a kind registered later changes the calls of
ratchet's actor, the intervention endpoint and the OpenAI wire format alike, with no edit in
any of them. Pure functions: fast."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest

from ratchet.agents.actor import ActorSettings, RolloutContext
from ratchet.agents.prompts import SYSTEM, system_prompt
from ratchet.endpoint.apply import arm_request, system_addition
from ratchet.endpoint.recording import Arm
from ratchet.kinds import CandidateKind, call_steps, register, unregister
from ratchet.skills.calls import apply_policy, apply_request, for_task
from ratchet.skills.kinds import render_exemplars, render_skills
from ratchet.types import (
    ArgConstraint,
    ConstraintSpec,
    ModelCall,
    Policy,
    RuleSpec,
    SkillText,
    ToolSpec,
    Tried,
)

GO = ToolSpec(
    name="go",
    description="move",
    parameters={
        "type": "object",
        "properties": {"where": {"type": "string", "enum": ["north", "south", "east"]}},
        "required": ["where"],
    },
)
CONVERT = ToolSpec(
    name="convert",
    description="convert units",
    parameters={
        "type": "object",
        "properties": {"unit": {"type": "string"}, "value": {"type": "number"}},
        "required": ["unit", "value"],
    },
)
SKILL = SkillText(name="look-first", description="look before you move", body="Look around first.")
DEMO = SkillText(name="demo-1", description="reach the kitchen", body="go: north\ngo: east")
NO_SOUTH = RuleSpec(name="no-south", avoid=["go: south"])
NO_REPEAT = RuleSpec(name="no-repeat", no_repeat=True)
UNIT_READ = ConstraintSpec(name="unit-read", tools={"convert": {"unit": ArgConstraint(from_context=True)}})


def _policy(**kw: Any) -> Policy:
    return Policy(model="base", **kw)


def test_the_built_in_kinds_change_a_call_in_one_order_and_say_what_fired() -> None:
    policy = _policy(
        adapter="champion-2",
        skills=(SKILL,),
        exemplars=(DEMO,),
        rules=(NO_SOUTH, NO_REPEAT),
        constraints=(UNIT_READ,),
    )
    call = ModelCall(
        model="whatever-the-agent-asked",
        system="agent's own",
        tools=(GO, CONVERT),
        observation="You are in the hall.",
        reads=("convert 5 miles to meters", "You are in the hall."),
        tried=(Tried("you are in the hall.", "go: north"),),
    )
    out = apply_policy(policy, call)
    assert out.model == "champion-2"  # the adapter by name
    assert out.additions == (render_skills([SKILL]), render_exemplars([DEMO]))  # skills, then exemplars
    assert out.system_text == f"agent's own\n\n{render_skills([SKILL])}\n\n{render_exemplars([DEMO])}"
    go, convert = out.tools
    assert go.parameters["properties"]["where"]["enum"] == ["east"]  # south avoided, north tried here
    assert set(convert.parameters["properties"]["unit"]["enum"]) >= {"miles", "meters"}  # read, bound
    assert out.fired == ("no-repeat", "no-south", "unit-read")  # rules (by name), then constraints
    assert call.tools == (GO, CONVERT)  # the call in is not changed


def test_a_policy_without_candidates_changes_nothing_but_the_model() -> None:
    call = ModelCall(model="x", system="s", tools=(GO,), observation="o")
    assert apply_policy(_policy(), call) == replace(call, model="base")


def test_for_task_shows_only_the_chosen_skills_and_keeps_the_rest() -> None:
    other = SkillText(name="other", description="d", body="b")
    policy = _policy(skills=(SKILL, other), rules=(NO_SOUTH,))
    view = for_task(policy, (other,), None)
    assert view.skills == (other,) and view.rules == policy.rules
    assert for_task(policy, None, None) is policy


def test_the_openai_body_gets_the_same_change_as_the_call() -> None:
    policy = _policy(adapter="a1", skills=(SKILL,), rules=(NO_SOUTH,))
    body = {
        "model": "gpt-whatever",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hall"}],
        "tools": [{"type": "function", "function": GO.model_dump(), "x-agent-key": 1}],
        "tool_choice": "auto",
        "temperature": 0.7,
    }
    applied = apply_request(policy, body)
    sent = applied.body
    assert sent["model"] == "a1" and sent["tool_choice"] == "auto" and sent["temperature"] == 0.7
    assert sent["messages"][0]["content"] == f"Be brief.\n\n{render_skills([SKILL])}"
    assert sent["tools"][0]["x-agent-key"] == 1  # the agent's own keys kept
    assert sent["tools"][0]["function"]["parameters"]["properties"]["where"]["enum"] == ["north", "east"]
    assert applied.fired == ["no-south"] and applied.menu == ["go: north", "go: south", "go: east"]
    assert body["messages"][0]["content"] == "Be brief."  # the agent's body is not changed


def test_tools_that_are_not_all_plain_functions_pass_through_untouched() -> None:
    body = {
        "messages": [{"role": "user", "content": "hall"}],
        "tools": [{"type": "function", "function": GO.model_dump()}, {"type": "web_search"}],
    }
    applied = apply_request(_policy(rules=(NO_SOUTH,)), body)
    assert applied.body["tools"] == body["tools"] and applied.menu is None and applied.fired == []


# ---- a kind registered later reaches every caller ------------------------------------------
def _rules_said(policy: Policy, call: ModelCall) -> ModelCall:
    """A toy kind's call step: the names of the rules in force, said in the system text."""
    if not policy.rules:
        return call
    return replace(
        call, additions=(*call.additions, "Rules in force: " + ", ".join(r.name for r in policy.rules))
    )


def _no_apply(policy: Policy, candidates: Sequence[Any]) -> Policy:
    return policy


SAID = CandidateKind("rules-said", "skills", _no_apply, lambda c: "", on_call=_rules_said)


@pytest.fixture
def said_kind() -> Iterator[CandidateKind]:
    register(SAID)
    try:
        yield SAID
    finally:
        unregister("rules-said")


class _Episode:
    """Just enough of an episode for the actor's call: its task and its tools."""

    task = type("T", (), {"instruction": "reach the kitchen"})()

    def tools(self) -> list[ToolSpec]:
        return [GO]


def _actor_call(policy: Policy) -> ModelCall:
    ctx = RolloutContext(
        episode=_Episode(), policy=policy, settings=ActorSettings(max_steps=3), observation="hall"
    )  # type: ignore[arg-type]
    return ctx.call()


def test_a_kind_registered_later_changes_the_actor_the_endpoint_and_the_wire_format(
    said_kind: CandidateKind,
) -> None:
    assert _rules_said in call_steps()
    policy = _policy(rules=(NO_SOUTH,))
    said = "Rules in force: no-south"
    assert _actor_call(policy).system_text == f"{SYSTEM}\n\n{said}"
    body = {
        "messages": [{"role": "user", "content": "hall"}],
        "tools": [{"type": "function", "function": GO.model_dump()}],
    }
    sent, fired, _ = arm_request(body, Arm(policy), 0, [])
    assert sent["messages"][0] == {"role": "system", "content": said} and fired == ["no-south"]
    assert system_addition(Arm(policy)) == said
    assert apply_request(policy, body).body["messages"][0]["content"] == said


def test_without_the_kind_no_caller_says_it() -> None:
    policy = _policy(rules=(NO_SOUTH,))
    assert _actor_call(policy).system_text == SYSTEM
    assert system_addition(Arm(policy)) == ""


def test_the_actors_system_prompt_is_the_policy_applied_to_its_own_text() -> None:
    policy = _policy(skills=(SKILL,), exemplars=(DEMO,))
    assert _actor_call(policy).system_text == system_prompt([SKILL], [DEMO])
    assert system_prompt([], []) == SYSTEM
