"""The rule miner: prefer, avoid and no-repeat rules from trajectories and their diagnoses."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from ratchet.diagnosis.attribution import attribute
from ratchet.skills.rule_mining import (
    NAME_MAX,
    NAME_RE,
    _generalize,
    mine_rules,
    rule_name,
)
from ratchet.skills.rules import matches
from ratchet.suites.textworld_express import java_major_version
from ratchet.types import Attribution, Diagnosis, FailureMode, PromptRecord, Trajectory
from tests.factories import traj

FAMILY = "textworld-express:coin"
OPTIONS = "Valid actions: inventory, look around, move north, move south, take coin"


def task(n: int, split: str = "train", family: str = FAMILY) -> str:
    return f"{family}:{split}:{n}"


def diagnosis(failure: Trajectory, successes: list[Trajectory], mode: FailureMode = "budget_exhausted"):
    """A model-free Diagnosis of `failure`, attributed against `successes` as the diagnoser does."""
    a = attribute(failure, successes)
    return Diagnosis(
        trajectory_id=failure.id,
        evolution="e",
        generation=0,
        task_id=failure.task_id,
        subset=failure.subset,
        mode=mode,
        step=a.step if a else None,
        attribution=a,
    )


def made(tid: str, taken: str, alternatives: list[str], mode: FailureMode = "budget_exhausted", n: int = 0):
    """A hand-made diagnosis whose attribution says `taken` where successes did `alternatives`."""
    return Diagnosis(
        trajectory_id=f"{tid}#fail{n}",
        evolution="e",
        generation=0,
        task_id=tid,
        subset=tid.split(":")[1],
        mode=mode,
        step=1,
        attribution=Attribution(step=1, taken=taken, alternatives=alternatives, support=1, references=1),
    )


def coin_task(tid: str) -> tuple[list[Trajectory], list[Diagnosis]]:
    """One coin-like task: a success takes the coin in the second room; a failure walks away."""
    win = traj(["move north", "take coin"], success=True, task=tid)
    loss = traj(["move north", "move south", "move north", "move south"], success=False, task=tid)
    return [win, loss], [diagnosis(loss, [win])]


def coin_tasks(tids: list[str]) -> tuple[list[Trajectory], list[Diagnosis]]:
    trajs, diags = [], []
    for tid in tids:
        t, d = coin_task(tid)
        trajs += t
        diags += d
    return trajs, diags


def test_prefer_rule_from_an_alternative_in_three_tasks() -> None:
    trajs, diags = coin_tasks([task(n) for n in (1, 2, 3)])
    assert {d.attribution.alternatives[0] for d in diags} == {"act: take coin"}  # type: ignore[union-attr]
    [rule] = mine_rules(FAMILY, trajs, diags)
    assert rule.kind == "prefer"
    assert rule.spec.prefer == ("act: take coin",) and not rule.spec.avoid and not rule.spec.no_repeat
    assert rule.name == "coin-prefer-take-coin"
    assert rule.support == 3
    assert set(rule.trajectory_ids) == {t.id for t in trajs}  # the failures and the successes
    assert "3 tasks" in rule.description and "act: move south" in rule.description


def test_two_tasks_are_not_enough() -> None:
    trajs, diags = coin_tasks([task(1), task(2)])
    _, extra = coin_task(task(2))  # another failure of a task already counted is no new task
    extra = [d.model_copy(update={"trajectory_id": "again"}) for d in extra]
    assert mine_rules(FAMILY, trajs, diags + extra) == []
    assert [r.spec.prefer for r in mine_rules(FAMILY, trajs, diags, min_tasks=2)] == [("act: take coin",)]


def test_varying_words_become_a_wildcard_and_a_constant_word_stays() -> None:
    diags = [
        made(task(1), "act: move east", ["act: open door to north"]),
        made(task(2), "act: move east", ["act: open door to west", "act: look around"]),
        made(task(3), "act: inventory", ["act: open door to south"]),
    ]
    [rule] = mine_rules(FAMILY, [], diags)
    assert rule.spec.prefer == ("act: open door to *",)
    assert rule.name == "coin-prefer-open-door-to-any" and rule.support == 3
    inner = [made(task(n), "act: move east", [f"act: open {c} door"]) for n, c in enumerate("abc")]
    assert [r.spec.prefer for r in mine_rules(FAMILY, [], inner)] == [("act: open * door",)]


def test_a_pattern_that_matches_everything_is_never_proposed() -> None:
    # one-word actions that differ in every task: the only generalization would be `act: *`
    diags = [made(task(n), "act: wait", [f"act: {d}"]) for n, d in enumerate(["north", "west", "south"])]
    assert mine_rules(FAMILY, [], diags) == []
    assert _generalize(["act: north", "act: west"]) is None
    assert _generalize(["act: go north", "act: run west"]) is None
    assert _generalize(["act: go north", "act: go west"]) == "act: go *"
    rules = mine_rules(FAMILY, [], diags, min_tasks=1)  # each on its own is exact
    assert sorted(p for r in rules for p in r.spec.prefer) == ["act: north", "act: south", "act: west"]


def test_an_alternative_the_failures_also_take_is_excluded() -> None:
    diags = [made(task(n), "act: move south", ["act: move north"]) for n in (1, 2, 3, 4)]
    # ... while in other tasks failures left the successful paths by moving north themselves
    diags += [made(task(n), "act: move north", ["act: move west"], n=n) for n in (5, 6)]
    assert [r.spec.prefer for r in mine_rules(FAMILY, [], diags)] == []
    # once in four times as many tasks is tolerated (TAKEN_SHARE)
    assert [r.spec.prefer for r in mine_rules(FAMILY, [], diags[:-1])] == [("act: move north",)]


def test_a_wildcard_the_failures_take_falls_back_to_its_exact_action() -> None:
    diags = [made(task(n), "act: look around", ["act: move north"]) for n in (1, 2, 3)]
    diags += [made(task(4), "act: look around", ["act: move west"])]
    diags += [made(task(n), "act: move south", ["act: take coin"], n=n) for n in (5, 6)]
    rules = mine_rules(FAMILY, [], diags)
    assert [r.spec.prefer for r in rules] == [("act: move north",)]  # not `act: move *`


def test_an_action_that_changes_nothing_is_not_preferred() -> None:
    """Successful runs looked around where failures walked off; but looking around shows the
    same observation again, so preferring it whenever it is on the menu would be a loop."""
    trajs, diags = [], []
    for n in (1, 2, 3):
        seen = ["room a", "room b", "room b"]
        win = traj(["move north", "look around", "take coin"], success=True, task=task(n), observations=seen)
        loss = traj(["move north", "move south"], success=False, task=task(n), observations=seen[:2])
        trajs += [win, loss]
        diags.append(diagnosis(loss, [win]))
    # Attribution itself no longer offers the no-op: it names what left the room instead.
    assert {d.attribution.alternatives[0] for d in diags} == {"act: take coin"}  # type: ignore[union-attr]
    # The miner checks on its own, for alternatives from anywhere else (the prefix-tree
    # fallback keeps a no-op when that is all the successes did at that point).
    noop = [
        d.model_copy(
            update={"attribution": made(d.task_id, "act: move south", ["act: look around"]).attribution}
        )
        for d in diags
    ]
    assert mine_rules(FAMILY, trajs, noop) == []


def play(tid: str, actions: list[str], raw: list[str], success: bool) -> Trajectory:
    """A trajectory as the actor stores it: each observation is the environment's text (the last
    tool result, or the first observation) with the options appended."""
    t = traj(
        actions,
        success=success,
        task=tid,
        observations=[f"{r}\n{OPTIONS}" for r in raw[: len(actions)]],
        results=raw[1 : len(actions) + 1],
    )
    prompt = PromptRecord(system="", task="", first_observation=raw[0], window=8)
    return t.model_copy(update={"prompt": prompt})


def test_when_holds_the_constant_words_every_supporting_state_shows() -> None:
    trajs, diags = [], []
    for n, room in enumerate(["pantry", "kitchen", "bedroom"]):
        raw = ["You are in the hall.", f"You are in the {room}. You see a coin.", "You take the coin."]
        win = play(task(n), ["move north", "take coin"], raw, success=True)
        back = ["You are in the hall.", f"You are in the {room}. You see a coin.", "You are in the hall."]
        loss = play(task(n), ["move north", "move south"], back, success=False)
        trajs += [win, loss]
        diags.append(diagnosis(loss, [win]))
    [rule] = mine_rules(FAMILY, trajs, diags)
    assert rule.spec.when == ("coin",)  # 'take' is in no observation; the options are not evidence
    assert "mentions 'coin'" in rule.description
    # a supporting state whose text cannot be told from its options: no condition, same rule
    trajs[1] = trajs[1].model_copy(update={"prompt": None, "steps": trajs[1].steps[1:]})
    [rule] = mine_rules(FAMILY, trajs, diags)
    assert rule.spec.prefer == ("act: take coin",) and rule.spec.when == ()


def test_stagnation_in_three_tasks_yields_the_no_repeat_rule() -> None:
    stuck = [made(task(n), "act: inventory", [], mode="stagnation") for n in (1, 2, 3)]
    stuck = [d.model_copy(update={"attribution": None}) for d in stuck]
    [rule] = mine_rules(FAMILY, [], stuck)
    assert rule.spec.name == "coin-no-repeat" and rule.spec.no_repeat
    assert not rule.spec.prefer and not rule.spec.avoid and not rule.spec.when
    assert rule.support == 3 and len(rule.trajectory_ids) == 3
    twice = stuck[:2] + [stuck[0].model_copy(update={"trajectory_id": "x"})]
    assert mine_rules(FAMILY, [], twice) == []  # three failures, two tasks
    other = [d.model_copy(update={"mode": "budget_exhausted"}) for d in stuck]
    assert mine_rules(FAMILY, [], other) == []


def test_avoid_an_action_no_success_ever_took() -> None:
    trajs, diags = [], []
    for n in (1, 2, 3):
        win = traj(["move north", "take coin"], success=True, task=task(n))
        loss = traj(["move north", "inventory", "inventory"], success=False, task=task(n))
        trajs += [win, loss]
        diags.append(diagnosis(loss, [win]))
    rules = mine_rules(FAMILY, trajs, diags)
    avoid = [r for r in rules if r.kind == "avoid"]
    assert [r.spec.avoid for r in avoid] == [("act: inventory",)]
    assert avoid[0].name == "coin-avoid-inventory" and avoid[0].support == 3
    assert [r.spec.prefer for r in rules if r.kind == "prefer"] == [("act: take coin",)]
    assert not [r for r in mine_rules(FAMILY, [], diags) if r.kind == "avoid"]  # no successes to compare
    once = traj(["inventory", "move north", "take coin"], success=True, task=task(9))
    assert not [r for r in mine_rules(FAMILY, trajs + [once], diags) if r.kind == "avoid"]


def test_dev_and_test_evidence_and_other_families_are_ignored() -> None:
    trajs, diags = coin_tasks([task(1), task(2), task(1, "dev"), task(2, "test")])
    trajs2, diags2 = coin_tasks([task(1, family="textworld-express:mapreader")])
    assert mine_rules(FAMILY, trajs + trajs2, diags + diags2) == []
    assert len(mine_rules(FAMILY, trajs, diags + diags2, min_tasks=2)) == 1
    # the split field of a trajectory counts too: a dev rollout mislabelled with a train id is out
    trajs, diags = coin_tasks([task(n) for n in (1, 2, 3)])
    [rule] = mine_rules(FAMILY, trajs, diags)
    relabelled = [t.model_copy(update={"split": "dev"}) if t.success else t for t in trajs]
    [rule2] = mine_rules(FAMILY, relabelled, diags)
    assert not set(rule2.trajectory_ids) & {t.id for t in trajs if t.success}
    assert rule2.spec == rule.spec


def test_output_is_deterministic_and_ranked_by_support() -> None:
    trajs, diags = coin_tasks([task(n) for n in range(1, 6)])
    diags += [made(task(n), "act: move east", [f"act: open door to {d}"]) for n, d in enumerate("abc")]
    diags += [
        made(task(n), "act: inventory", [], mode="stagnation", n=n).model_copy(update={"attribution": None})
        for n in range(10, 14)
    ]
    first = mine_rules(FAMILY, trajs, diags)
    assert [r.support for r in first] == sorted((r.support for r in first), reverse=True)
    assert [r.name for r in first] == [
        "coin-prefer-take-coin",
        "coin-no-repeat",
        "coin-prefer-open-door-to-any",
    ]
    rng = random.Random(0)
    for _ in range(3):
        t, d = trajs[:], diags[:]
        rng.shuffle(t)
        rng.shuffle(d)
        assert mine_rules(FAMILY, t, d) == first
    assert mine_rules(FAMILY, trajs, diags, top=1) == first[:1]


def test_names_are_valid_slugs() -> None:
    family = "reasoning-gym:propositional_logic"
    names = [
        rule_name(family, "prefer", "act: open door to *"),
        rule_name(family, "avoid", "answer: " + " ".join(["Very-LONG_word"] * 20)),
        rule_name(family, "prefer", "inventory"),
        rule_name(family, "no-repeat"),
        rule_name("x:!!", "prefer", "act: é"),
    ]
    for name in names:
        assert NAME_RE.match(name) and len(name) <= NAME_MAX, name
    assert names[0] == "propositional-logic-prefer-open-door-to-any"
    assert names[3] == "propositional-logic-no-repeat"
    assert rule_name(family, "avoid", "answer: " + "w " * 50) != rule_name(
        family, "avoid", "answer: " + "w " * 51
    )
    # two tools' actions with the same words still give two distinct names
    diags = [made(task(n), "act: wait", ["act: take coin"]) for n in (1, 2, 3)]
    diags += [made(task(n), "act: wait", ["take: coin"], n=9) for n in (4, 5, 6)]
    diags += [made(task(n), "act: wait", ["grab: take coin"], n=9) for n in (7, 8, 9)]
    rules = mine_rules(FAMILY, [], diags)
    assert len(rules) == 3 and len({r.name for r in rules}) == 3
    assert all(NAME_RE.match(r.name) and len(r.name) <= NAME_MAX for r in rules)


def test_min_tasks_must_be_positive() -> None:
    with pytest.raises(ValueError):
        mine_rules(FAMILY, [], [], min_tasks=0)


# ------------------------------------------------------------------ real data (TextWorldExpress, Java)

needs_java = pytest.mark.skipif((java_major_version() or 0) < 17, reason="TextWorldExpress needs Java 17")


def _played(suite, task_, calls, rollout: int, kind: str) -> Trajectory:  # noqa: ANN001
    """Play `calls` (a function of the episode giving the next call or None) as the actor records it."""
    from ratchet.agents.actor import join_options
    from ratchet.types import Step

    with suite.episode(task_) as ep:
        result = ep.reset()
        first, steps = result.observation, []
        for i in range(task_.max_steps):
            call = None if result.done else calls(ep, i)
            if call is None:
                break
            step = Step(index=i, observation=join_options(result.observation, result.options), tool_call=call)
            result = ep.step(call)
            steps.append(step.model_copy(update={"tool_result": result.observation}))
    return Trajectory(
        id=f"{task_.id}#{rollout}",
        evolution="e",
        generation=1,
        task_id=task_.id,
        suite=task_.suite,
        subset=task_.subset,
        split=task_.split,
        rollout=rollout,
        seed=rollout,
        policy_version="p",
        kind=kind,  # type: ignore[arg-type]
        prompt=PromptRecord(system="", task="", first_observation=first, window=8),
        steps=steps,
        done=result.done,
        success=result.success,
        max_steps=task_.max_steps,
    )


@pytest.mark.integration
@needs_java
def test_random_and_gold_play_on_coin_yield_a_take_coin_rule() -> None:
    from ratchet.agents.diagnoser import build_diagnoser, diagnose
    from ratchet.suites.registry import get_suite

    suite = get_suite(FAMILY)
    try:
        trajs = []
        for t in suite.tasks("train", 12):
            plan: list = []

            def gold(ep, i, plan=plan):  # noqa: ANN001
                if i == 0:
                    plan.extend(ep.expert_actions() or [])
                return plan[i] if i < len(plan) else None

            trajs.append(_played(suite, t, gold, -1, "expert"))
            for k in range(5):
                rng = random.Random(f"{t.id}:{k}")
                trajs.append(_played(suite, t, lambda ep, i, rng=rng: ep.random_action(rng), k, "agent"))
    finally:
        suite.close()
    wins: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        if t.success:
            wins[t.task_id].append(t)
    diagnoser = build_diagnoser(None)
    diags = [diagnose(diagnoser, t, wins[t.task_id]) for t in trajs if t.kind == "agent" and not t.success]
    assert diags, "random play failed nowhere"
    rules = mine_rules(FAMILY, trajs, diags)
    prefer = [r for r in rules if r.kind == "prefer"]
    assert any(r.spec.prefer == ("act: take coin",) and r.support >= 3 for r in prefer), rules
    for r in prefer:  # never a rule that would loop on an action always on the menu
        assert not any(matches(p, a) for p in r.spec.prefer for a in ("act: look around", "act: inventory"))


# ------------------------------------------------------------------ tool choice (nothing enumerated)

LOGIC = "reasoning-gym:propositional_logic"


def logic_task(
    n: int,
    first_fail: str = "answer",
    ask: str = "Given the premises P{n} and Q{n}, what can be concluded? Question {n}.",
) -> tuple[list[Trajectory], list[Diagnosis]]:
    """A question a success answers after a calculation, and a failure answers (or calls
    `first_fail`) straight away; both see the question first, then the tool's result."""
    question = ask.format(n=n)
    tid = task(n, family=LOGIC)
    win = traj(
        [f"{n} + {n}", f"x{n}"],
        success=True,
        task=tid,
        tool="calculator",
        arg="expression",
        observations=[question, f"{n} + {n} = {2 * n}"],
        results=[f"{n} + {n} = {2 * n}", "correct"],
    )
    seen = PromptRecord(system="", task="", first_observation=question, window=8)
    win = win.model_copy(
        update={"steps": [win.steps[0], _as(win.steps[1], "answer", "answer")], "prompt": seen}
    )
    loss = traj([f"y{n}"], success=False, task=tid, tool=first_fail, arg=first_fail, observations=[question])
    loss = loss.model_copy(update={"prompt": seen})
    return [win, loss], [diagnosis(loss, [win], mode="wrong_answer")]


def _as(step, tool: str, arg: str):  # noqa: ANN001, ANN202
    from ratchet.types import ToolCall

    return step.model_copy(
        update={"tool_call": ToolCall(name=tool, args={arg: step.tool_call.args["expression"]})}
    )


def logic_tasks(ns: list[int], first_fail: str = "answer") -> tuple[list[Trajectory], list[Diagnosis]]:
    trajs, diags = [], []
    for n in ns:
        t, d = logic_task(n, first_fail)
        trajs += t
        diags += d
    return trajs, diags


def test_calculating_before_answering_becomes_a_tool_choice_rule() -> None:
    trajs, diags = logic_tasks([1, 2, 3])
    rules = mine_rules(LOGIC, trajs, diags, min_tasks=2)
    tool = [r for r in rules if r.kind == "prefer-tool"]
    assert len(tool) == 1 and tool[0].spec.prefer == ("calculator: *",) and tool[0].support == 3
    # it acts on the question (words every question has), not on the calculator's result
    assert set(tool[0].spec.when) <= {"given", "premises", "what", "concluded", "question"}
    assert tool[0].spec.when
    from ratchet.skills.rules import constrain_tools
    from ratchet.types import ToolSpec

    free = [
        ToolSpec(
            name=n, description=n, parameters={"type": "object", "properties": {"x": {"type": "string"}}}
        )
        for n in ("calculator", "answer")
    ]
    question = "Given the premises P9 and Q9, what can be concluded? Question 9."
    assert [t.name for t in constrain_tools(free, [tool[0].spec], question)[0]] == ["calculator"]
    assert [t.name for t in constrain_tools(free, [tool[0].spec], "9 + 9 = 18")[0]] == [
        "calculator",
        "answer",
    ]
    assert not [r for r in mine_rules(LOGIC, trajs, diags, min_tasks=4) if r.kind == "prefer-tool"]


def test_a_tool_asked_for_in_two_phrasings_gets_a_rule_per_phrasing() -> None:
    """No word is in every question, so one rule would act everywhere (dropped); each
    phrasing shared by enough tasks gets its own `when`, and acts on its own questions only."""
    trajs, diags = logic_tasks([1, 2])
    for n in (3, 4):
        t, d = logic_task(n, ask="Which conclusion follows from facts P{n} and Q{n}?")
        trajs, diags = trajs + t, diags + d
    tool = [r for r in mine_rules(LOGIC, trajs, diags, min_tasks=2) if r.kind == "prefer-tool"]
    assert sorted(r.support for r in tool) == [2, 2] and len({r.name for r in tool}) == 2
    whens = sorted(set(r.spec.when) for r in tool)
    assert {"conclusion", "follows"} <= whens[0] | whens[1] and {"given", "premises"} <= whens[0] | whens[1]
    assert not set(whens[0]) & set(whens[1])  # each phrasing's words only
    one = logic_tasks([1, 2])  # a lone task in the second phrasing is not a group
    t, d = logic_task(3, ask="Which conclusion follows from facts P{n} and Q{n}?")
    alone = [r for r in mine_rules(LOGIC, one[0] + t, one[1] + d, min_tasks=2) if r.kind == "prefer-tool"]
    assert len(alone) == 1 and "facts" not in alone[0].spec.when and alone[0].support == 2


def answered_at_once(n: int, ask: str) -> Trajectory:
    """A success that answers the question straight away (another tool than the calculator,
    at the question itself): where a calculator rule must not act."""
    question = ask.format(n=n)
    win = traj(
        [f"x{n}"],
        success=True,
        task=task(n, family=LOGIC),
        tool="answer",
        arg="answer",
        observations=[question],
        results=["correct"],
    )
    seen = PromptRecord(system="", task="", first_observation=question, window=8)
    return win.model_copy(update={"prompt": seen})


def test_a_phrasing_word_other_requests_share_is_not_a_rule_s_when() -> None:
    """Time-zone requests in three phrasings, weather requests that successes answer with
    another tool. 'what' is in more of the failing requests than 'zone' (5 against 4), but
    it is also in every weather request: a rule on 'what' would force the time-zone tool on
    them. The split takes the words only the time-zone requests have."""
    cities = ["Oslo", "Lima", "Rome", "Cairo", "Perth", "Quito", "Dublin", "Athens", "Tokyo", "Seoul"]
    asks = {
        "What is the UTC offset of {c}?": [1, 2, 3],
        "What time zone does {c} use?": [4, 5],
        "Which time zone is {c} in?": [6, 7],
    }
    trajs, diags = [], []
    for ask, ns in asks.items():
        for n in ns:
            t, d = logic_task(n, ask=ask.replace("{c}", cities[n]))
            trajs, diags = trajs + t, diags + d
    weather = [answered_at_once(n, f"What is the weather in {cities[n]} right now?") for n in (8, 9)]
    tool = [r for r in mine_rules(LOGIC, trajs + weather, diags, min_tasks=2) if r.kind == "prefer-tool"]
    assert sorted(sorted(r.spec.when) for r in tool) == [["offset", "what"], ["time", "zone"]], tool
    assert sorted(r.support for r in tool) == [3, 4]
    from ratchet.skills.rules import constrain_tools
    from ratchet.types import ToolSpec

    free = [
        ToolSpec(
            name=n, description=n, parameters={"type": "object", "properties": {"x": {"type": "string"}}}
        )
        for n in ("calculator", "answer")
    ]
    specs = [r.spec for r in tool]
    assert [t.name for t in constrain_tools(free, specs, "What is the weather in Oslo right now?")[0]] == [
        "calculator",
        "answer",
    ]
    for ask in asks:
        forced = constrain_tools(free, specs, ask.replace("{c}", "Hanoi"))[0]
        assert [t.name for t in forced] == ["calculator"]
    # without the weather successes nothing tells 'what' apart, and it is chosen as before
    alone = mine_rules(LOGIC, trajs, diags, min_tasks=2)
    assert any(r.spec.when == ("what",) for r in alone if r.kind == "prefer-tool")


def test_no_tool_choice_rule_where_the_failures_used_the_tool_as_well() -> None:
    trajs, diags = logic_tasks([1, 2, 3], first_fail="calculator")  # they calculated too, and failed
    assert not [r for r in mine_rules(LOGIC, trajs, diags, min_tasks=2) if r.kind == "prefer-tool"]


def test_a_tool_no_success_ever_called_is_avoided_whole() -> None:
    trajs, diags = logic_tasks([1, 2, 3], first_fail="search")
    avoid = [r for r in mine_rules(LOGIC, trajs, diags, min_tasks=2) if r.kind == "avoid"]
    assert [r.spec.avoid for r in avoid] == [("search: *",)]  # the tool, not three one-off calls
    assert avoid[0].support == 3 and avoid[0].name == "propositional-logic-avoid-search"


def test_a_wrong_argument_to_the_right_tool_is_no_evidence_against_choosing_it() -> None:
    """Tasks 1-3: failures answered where successes calculated first (the tool choice).
    Tasks 4-6: failures calculated with a wrong expression where successes calculated the
    right one. Before, those counted as 'failures called the calculator too' and dropped
    the rule; they say nothing about which tool to call."""
    trajs, diags = logic_tasks([1, 2, 3])
    wrong, wrong_diags = logic_tasks([4, 5, 6], first_fail="calculator")
    assert all(d.attribution.taken.startswith("calculator") for d in wrong_diags)  # type: ignore[union-attr]
    rules = mine_rules(LOGIC, trajs + wrong, diags + wrong_diags, min_tasks=2)
    tool = [r for r in rules if r.kind == "prefer-tool"]
    assert len(tool) == 1 and tool[0].spec.prefer == ("calculator: *",) and tool[0].support == 3
