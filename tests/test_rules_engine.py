"""Action rules against the real engine: the embedded model playing TextWorldExpress coin,
with and without rules. What a rule promises is mechanical (the model cannot choose what the
rule took off the menu), so that is what is checked on every step, not a success rate."""

from __future__ import annotations

import pytest

from ratchet.agents.actor import ActorSettings, build_actor
from ratchet.agents.model import chat_model
from ratchet.agents.rollout import RolloutSlot, run_rollout
from ratchet.server.weights import BASE_MODEL_NAME
from ratchet.skills.rules import call_text
from ratchet.suites.registry import get_suite
from ratchet.types import Policy, RuleSpec

pytestmark = pytest.mark.integration

TAKE = RuleSpec(name="coin-prefer-take-coin", prefer=("act: take coin",))
NO_REPEAT = RuleSpec(name="coin-no-repeat", no_repeat=True)


def test_the_embedded_model_plays_within_its_rules(embedded_server: str) -> None:
    suite = get_suite("textworld-express:coin")
    try:
        tasks = suite.tasks("train", 4)
        actor = build_actor(chat_model(embedded_server, BASE_MODEL_NAME))
        settings = ActorSettings(max_steps=12)
        policy = Policy(model=BASE_MODEL_NAME, rules=(TAKE, NO_REPEAT))
        fired = 0
        for i, task in enumerate(tasks):
            t = run_rollout(actor, suite, RolloutSlot("rules", 0, task, i), policy, settings)
            assert t.status == "finished" and t.policy_version == policy.version
            seen: dict[str, set[str]] = {}  # observation -> actions taken from it
            state = " ".join(t.prompt.first_observation.lower().split())
            for step in t.steps:
                assert step.tool_call is not None and step.error is None  # constrained: always playable
                action = call_text(step.tool_call)
                if "take coin" in step.observation.lower().split("\n", 1)[-1]:  # on the menu
                    assert action == "act: take coin" and TAKE.name in step.rules
                elif state in seen and step.rules == [NO_REPEAT.name]:
                    assert action not in seen[state]  # back here: only what it had not tried
                seen.setdefault(state, set()).add(action)
                state = " ".join(step.tool_result.lower().split())
                fired += len(step.rules)
            if t.steps and t.steps[-1].tool_call.args.get("action") == "take coin":
                assert t.success  # in coin, taking the coin is the win
        assert fired > 0  # the rules had something to do on these tasks
    finally:
        suite.close()


def test_a_tool_choice_rule_acts_where_nothing_is_enumerated(embedded_server: str) -> None:
    """reasoning-gym offers `calculator` and `answer` with free-text arguments: a rule picks the
    tool at the question (its `when` words) and lets go once the observation is a result."""
    suite = get_suite("reasoning-gym:chain_sum")
    try:
        tasks = suite.tasks("train", 3)
        when = ("arithmetic", "problem")
        first = RuleSpec(name="chain-sum-prefer-calculator", prefer=("calculator: *",), when=when)
        actor = build_actor(chat_model(embedded_server, BASE_MODEL_NAME))
        policy = Policy(model=BASE_MODEL_NAME, rules=(first,))
        for i, task in enumerate(tasks):
            assert "arithmetic problem" in task.instruction  # the rule's `when` holds at the question
            slot = RolloutSlot("tool-rules", 0, task, i)
            t = run_rollout(actor, suite, slot, policy, ActorSettings(max_steps=3))
            assert t.status == "finished" and t.steps
            assert t.steps[0].tool_call is not None and t.steps[0].tool_call.name == "calculator"
            assert t.steps[0].rules == [first.name]
            for step in t.steps[1:]:  # after a result the question's words are gone: no forcing
                if "problem" not in step.observation.lower():
                    assert step.rules == []
    finally:
        suite.close()


def test_a_macro_bound_to_the_menu_only_ever_makes_a_playable_first_move(embedded_server: str) -> None:
    """A distilled macro (move {a}, then take coin) played by the real model through the MCP
    toolbox and the sandbox: its `a` is bound to each step's valid moves, so every call's first
    action is valid where it was made. A rule makes the macro the whole menu, so it is called."""
    from ratchet.agents.toolsmith import MacroJob, build_toolsmith
    from ratchet.flows.distill import to_skill
    from ratchet.skills.mining import ActionTemplate, Pattern
    from ratchet.skills.screen import Screen
    from ratchet.skills.toolbox import Toolbox

    moves = (ActionTemplate("act", {"action": "move {a}"}), ActionTemplate("act", {"action": "take coin"}))
    pattern = Pattern("textworld-express:coin", moves, ("a",), ({"a": "north"},), 2, 2, ("t",))
    made = build_toolsmith(None).invoke(
        {"job": MacroJob("coin-macro-move-take", pattern), "screen": Screen()}
    )
    skill = to_skill(made, "e", 0)
    assert skill is not None
    only = RuleSpec(name="only-the-macro", prefer=("coin-macro-move-take: *",))
    policy = Policy(model=BASE_MODEL_NAME, tools=(skill.tool_spec(),), rules=(only,))
    suite = get_suite("textworld-express:coin")
    try:
        actor = build_actor(chat_model(embedded_server, BASE_MODEL_NAME))
        calls = 0
        for i, task in enumerate(suite.tasks("train", 3)):
            slot = RolloutSlot("bound-macro", 0, task, i)
            t = run_rollout(
                actor, suite, slot, policy, ActorSettings(max_steps=4), tool_runner=Toolbox([skill])
            )
            assert t.status == "finished"
            for step in t.steps:
                if step.tool_call is None or step.tool_call.name != skill.name:
                    continue  # no move on the menu: the macro was not offered
                calls += 1
                menu = step.observation.lower().rsplit("valid actions:", 1)[-1]
                assert f"move {step.tool_call.args['a']}" in menu  # playable where it was called
                assert step.error is None  # a refused first action would be the tool's error
        assert calls > 0
    finally:
        suite.close()


def test_no_repeat_keeps_the_embedded_model_out_of_a_two_move_macros_loop(embedded_server: str) -> None:
    """A two-move macro (move {a}, move {b}) the rules make the whole menu: its `a` bound to the
    step's moves, `b` an enum, so the menu lists each combination and `no_repeat` takes a
    repeated one off. The real model, through the MCP toolbox and the sandbox, never calls
    the same combination twice from the same state; before, a call that walked there and
    back was made again from where it led until the budget ran out."""
    from ratchet.agents.toolsmith import MacroJob, build_toolsmith
    from ratchet.flows.distill import to_skill
    from ratchet.skills.mining import ActionTemplate, Pattern
    from ratchet.skills.screen import Screen
    from ratchet.skills.toolbox import Toolbox

    moves = (ActionTemplate("act", {"action": "move {a}"}), ActionTemplate("act", {"action": "move {b}"}))
    seen = ({"a": "east", "b": "west"}, {"a": "west", "b": "east"}, {"a": "north", "b": "south"})
    pattern = Pattern("textworld-express:coin", moves, ("a", "b"), seen, 2, 3, ("t",))
    made = build_toolsmith(None).invoke(
        {"job": MacroJob("coin-macro-move-move", pattern), "screen": Screen()}
    )
    skill = to_skill(made, "e", 0)
    assert skill is not None
    only = RuleSpec(name="a-only-the-macro", prefer=("coin-macro-move-move: *",))
    policy = Policy(model=BASE_MODEL_NAME, tools=(skill.tool_spec(),), rules=(only, NO_REPEAT))
    suite = get_suite("textworld-express:coin")
    try:
        actor = build_actor(chat_model(embedded_server, BASE_MODEL_NAME))
        calls = narrowed = 0
        for i, task in enumerate(suite.tasks("train", 3)):
            slot = RolloutSlot("grid-macro", 0, task, i)
            t = run_rollout(
                actor, suite, slot, policy, ActorSettings(max_steps=12), tool_runner=Toolbox([skill])
            )
            assert t.status == "finished"
            taken: set[tuple[str, str]] = set()
            state = " ".join(t.prompt.first_observation.lower().split())
            for step in t.steps:
                if step.tool_call is not None and step.tool_call.name == skill.name:
                    calls += 1
                    assert any(e.startswith(f"{skill.name}: ") and ", " in e for e in step.menu or ())
                    assert (state, call_text(step.tool_call)) not in taken
                    narrowed += NO_REPEAT.name in step.rules
                if step.tool_call is not None:
                    taken.add((state, call_text(step.tool_call)))
                state = " ".join((step.tool_result or "").lower().split())
        assert calls > 0 and narrowed > 0  # the macro was played, and a repeat was taken away
    finally:
        suite.close()
