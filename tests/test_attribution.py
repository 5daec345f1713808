"""Contrastive attribution on hand-built trajectories, and once against a real TWX game."""

from __future__ import annotations

import importlib
import random
from types import ModuleType

import pytest

from ratchet.diagnosis.attribution import SuccessTree, action_path, attribute, normalize_action
from ratchet.types import Step, ToolCall, Trajectory


def _traj(
    actions: list[str | None], *, success: bool, task: str = "t:coin:train:0", tid: str | None = None
) -> Trajectory:
    """A trajectory of `act` steps; None is a step without a tool call, '!x' an invalid 'x'.

    The observation before each step is the state a deterministic game would be in: the
    valid actions taken so far (rejected ones change nothing)."""
    steps = []
    done: list[str] = []
    for i, a in enumerate(actions):
        seen = "after: " + " / ".join(done)
        if a is None:
            steps.append(Step(index=i, observation=seen, error="no tool call"))
        elif a.startswith("!"):
            call = ToolCall(name="act", args={"action": a[1:]})
            steps.append(Step(index=i, observation=seen, tool_call=call, error="not a valid action"))
        else:
            steps.append(Step(index=i, observation=seen, tool_call=ToolCall(name="act", args={"action": a})))
            done.append(a)
    return Trajectory(
        id=tid or f"{task}/{'-'.join(map(str, actions))}/{success}",
        evolution="e",
        generation=0,
        task_id=task,
        suite="t",
        subset="coin",
        split="train",
        rollout=0,
        seed=0,
        policy_version="p",
        steps=steps,
        success=success,
    )


def test_normalize_action_and_action_path() -> None:
    t = _traj(["Move  North", None, "!take coin", "take coin"], success=True)
    assert [normalize_action(s) for s in t.steps] == ["act: move north", None, None, "act: take coin"]
    assert action_path(t) == [(0, "act: move north"), (3, "act: take coin")]
    no_args = Step(index=0, observation="", tool_call=ToolCall(name="look"))
    assert normalize_action(no_args) == "look"


def test_divergence_step_with_alternatives_ranked_by_count() -> None:
    successes = [
        _traj(["look", "move north", "take coin"], success=True, tid="a"),
        _traj(["look", "move north", "take coin"], success=True, tid="b"),
        _traj(["look", "move east", "move west", "move north", "take coin"], success=True, tid="c"),
        _traj(["look", "inventory", "move north", "take coin"], success=True, tid="d"),
        _traj(["move north", "take coin"], success=True, tid="e"),
    ]
    failure = _traj(["look", "move south", "move north", "take coin"], success=False)
    a = SuccessTree(successes).attribute(failure)
    assert a is not None
    assert a.step == 1
    assert a.taken == "act: move south"
    # 'move north' twice; 'inventory' and 'move east' once each, ties broken by name
    assert a.alternatives == ["act: move north", "act: inventory", "act: move east"]
    assert a.support == 4  # a-d shared the prefix ['look']; e did not
    assert a.references == 5


def test_divergence_at_first_step_and_deep_in_the_path() -> None:
    tree = SuccessTree([_traj(["a", "b", "c", "d"], success=True)])
    first = tree.attribute(_traj(["x", "b", "c", "d"], success=False))
    assert first is not None and (first.step, first.alternatives, first.support) == (0, ["act: a"], 1)
    last = tree.attribute(_traj(["a", "b", "c", "x"], success=False))
    assert last is not None and (last.step, last.taken, last.alternatives) == (3, "act: x", ["act: d"])


def test_invalid_and_no_call_steps_neither_advance_nor_diverge() -> None:
    # the success's own rejected steps do not become tree nodes
    success = _traj(["look", "!jump", None, "move north", "take coin"], success=True)
    tree = SuccessTree([success])
    assert list(tree.root.children) == ["act: look"]
    assert list(tree.root.children["act: look"].children) == ["act: move north"]

    # the failure's rejected steps are skipped; the divergence keeps the step's own index
    failure = _traj(
        ["look", None, "!fly", "!move north", "move north", None, "!x", "move south"], success=False
    )
    a = tree.attribute(failure)
    assert a is not None
    assert a.step == 7
    assert a.taken == "act: move south"
    assert a.alternatives == ["act: take coin"]

    # a failure whose only deviations were rejected never left the path
    assert tree.attribute(_traj(["look", "!dance", None, "move north"], success=False)) is None


def test_failure_that_never_leaves_a_success_path_is_none() -> None:
    tree = SuccessTree(
        [
            _traj(["look", "move north", "take coin"], success=True),
            _traj(["look", "move east", "take coin"], success=True),
        ]
    )
    assert tree.attribute(_traj(["look", "move north"], success=False)) is None  # stopped short
    assert tree.attribute(_traj(["look", "move east", "take coin"], success=False)) is None
    assert tree.attribute(_traj([], success=False)) is None
    assert tree.attribute(_traj([None, "!x"], success=False)) is None


def test_empty_success_set_is_none() -> None:
    failure = _traj(["look", "move south"], success=False)
    assert SuccessTree().attribute(failure) is None
    assert SuccessTree().size == 0
    assert attribute(failure, []) is None


def test_support_counts_successes_sharing_the_prefix() -> None:
    successes = [
        _traj(["a", "b", "c"], success=True, tid="1"),
        _traj(["a", "b", "d"], success=True, tid="2"),
        _traj(["a", "e"], success=True, tid="3"),
        _traj(["f"], success=True, tid="4"),
    ]
    tree = SuccessTree(successes)
    assert tree.size == tree.root.count == 4
    at_c = tree.attribute(_traj(["a", "b", "x"], success=False))
    assert at_c is not None and (at_c.step, at_c.support, at_c.references) == (2, 2, 4)
    assert at_c.alternatives == ["act: c", "act: d"]
    at_b = tree.attribute(_traj(["a", "x"], success=False))
    assert at_b is not None and (at_b.step, at_b.support) == (1, 3)
    assert at_b.alternatives == ["act: b", "act: e"]  # b: 2 successes, e: 1
    at_root = tree.attribute(_traj(["x"], success=False))
    assert at_root is not None and (at_root.step, at_root.support) == (0, 4)
    assert at_root.alternatives == ["act: a", "act: f"]


def _seen(observations_and_actions: list[tuple[str, str]], *, success: bool, tid: str) -> Trajectory:
    """A trajectory of `act` steps with the observation each step saw given explicitly."""
    steps = [
        Step(index=i, observation=seen, tool_call=ToolCall(name="act", args={"action": a}))
        for i, (seen, a) in enumerate(observations_and_actions)
    ]
    return _traj([], success=success, tid=tid).model_copy(update={"steps": steps})


def test_an_action_that_left_the_state_unchanged_is_not_an_alternative() -> None:
    # The success looked around in the pantry (same observation after it), then took the coin.
    # Ranked by name, 'look around' would come first, and a prefer rule mined from the first
    # alternative would prefer a no-op.
    success = _seen([("pantry", "look around"), ("pantry", "take coin")], success=True, tid="s")
    failure = _seen([("pantry", "look around"), ("pantry", "move south")], success=False, tid="f")
    a = attribute(failure, [success])
    assert a is not None and (a.step, a.taken) == (1, "act: move south")
    assert a.alternatives == ["act: take coin"]
    # Taking the no-op is not a divergence either: it is something a success did there.
    assert attribute(_seen([("pantry", "look around")], success=False, tid="g"), [success]) is None
    # In the prefix tree, where the successes' only move at that point stayed put, it is kept:
    # a failure whose states no success saw (here every observation differs) falls back to it.
    stay = _seen([("hall", "look around"), ("hall", "take coin")], success=True, tid="t")
    b = attribute(_seen([("cellar", "move west")], success=False, tid="h"), [stay])
    assert b is not None and (b.step, b.alternatives) == (0, ["act: look around"])


def test_attribute_ignores_successes_of_other_tasks() -> None:
    failure = _traj(["look", "move south"], success=False, task="t:coin:train:1")
    same = _traj(["look", "move north"], success=True, task="t:coin:train:1", tid="same")
    other = [
        _traj(["look", "move south", "take coin"], success=True, task="t:coin:train:2", tid="o1"),
        _traj(["move west"], success=True, task="t:coin:train:3", tid="o2"),
    ]
    assert attribute(failure, other) is None  # no success of its own task
    a = attribute(failure, [*other, same])
    assert a is not None
    assert (a.step, a.alternatives, a.support, a.references) == (1, ["act: move north"], 1, 1)


# ---------------------------------------------------------------------------------------
# A real TextWorldExpress game (starts a JVM)
# ---------------------------------------------------------------------------------------


def _bench() -> ModuleType:
    """bench/attribution.py: its `play` and `gold_paths` are what is tested."""
    return importlib.import_module("bench.attribution")


@pytest.mark.integration
def test_mutated_twx_coin_gold_path_is_attributed_to_the_injected_step() -> None:
    from ratchet.suites.textworld_express import TextWorldExpressSuite, java_major_version

    if (java_major_version() or 0) < 17:
        pytest.skip("TextWorldExpress needs Java 17 on PATH")
    bench = _bench()
    suite = TextWorldExpressSuite(["coin"])
    try:
        rng = random.Random(0)
        for task in suite.tasks("train", 5):
            with suite.episode(task) as ep:
                path = bench.gold_paths(ep, 1)[0]
                success, _, done = bench.play(ep, task, path, "gold")
                if not (done and success.success):
                    continue  # the replay must win as the draw did; skip a task where it does not
                assert [s.tool_call.args["action"] for s in success.steps] == path
                assert all(s.error is None for s in success.steps)
                for i in range(len(path)):
                    failure, injected, _ = bench.play(ep, task, path, "mutant", mutate_at=i, rng=rng)
                    if injected is None or failure.success:
                        continue  # no alternative, or a harmless change (e.g. 'inventory')
                    assert injected != path[i]
                    assert failure.steps[i].tool_call.args["action"] == injected
                    assert [s.index for s in failure.steps] == list(range(len(failure.steps)))
                    a = attribute(failure, [success])
                    assert a is not None
                    assert a.step == i
                    assert a.taken == f"act: {injected}"
                    assert a.alternatives == [f"act: {path[i]}"]
                    assert (a.support, a.references) == (1, 1)
                    return
        pytest.fail("no mutation of a coin gold path failed")
    finally:
        suite.close()
