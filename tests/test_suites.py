"""The two shipped suites, for real: TextWorldExpress on a JVM and reasoning-gym generators."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest

from ratchet.errors import EnvironmentMissingError
from ratchet.suites.base import ActionError
from ratchet.suites.reasoning_gym import ReasoningGymSuite, answer_too_costly, calculate
from ratchet.suites.registry import get_suite
from ratchet.suites.textworld_express import MAX_STEPS, TextWorldExpressSuite, java_major_version
from ratchet.types import SPLITS, ToolCall

needs_java = pytest.mark.skipif(
    (java_major_version() or 0) < 17, reason="TextWorldExpress needs Java 17 on PATH"
)


# ---------------------------------------------------------------------------------------
# TextWorldExpress
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def twx() -> Iterator[TextWorldExpressSuite]:
    suite = TextWorldExpressSuite(["coin", "mapreader", "sorting"])
    yield suite
    suite.close()
    assert suite.pool_size == 0


def _act(action: str) -> ToolCall:
    return ToolCall(name="act", args={"action": action})


@pytest.mark.integration
@needs_java
def test_twx_tasks_deterministic_disjoint_and_replayable(twx: TextWorldExpressSuite) -> None:
    by_split = {split: twx.tasks(split, 3) for split in SPLITS}
    assert all(len(tasks) == 9 for tasks in by_split.values())
    assert twx.tasks("train", 3) == by_split["train"]
    seeds = {split: {(t.subset, t.seed) for t in tasks} for split, tasks in by_split.items()}
    assert not seeds["train"] & seeds["dev"]
    assert not seeds["train"] & seeds["test"]
    assert not seeds["dev"] & seeds["test"]
    # TWX's folds, not ad-hoc offsets: dev and test seeds are unknown to the train fold.
    assert not set(twx.fold_seeds("coin", "train")) & set(twx.fold_seeds("coin", "test"))
    for tasks in by_split.values():
        for task in tasks:
            assert twx.load(task.id) == task
            assert task.instruction.startswith("Your task is")
            assert task.max_steps == MAX_STEPS[task.subset]
            assert task.spec["game"] == task.subset and "game_params" in task.spec
    # mapreader descriptions name the target room, so they differ between seeds
    mapreader = [t.instruction for t in by_split["dev"] if t.subset == "mapreader"]
    assert len(set(mapreader)) > 1
    with pytest.raises(ValueError):
        twx.make_task("coin", "test", twx.fold_seeds("coin", "train")[0])


@pytest.mark.integration
@needs_java
def test_twx_expert_path_solves_coin(twx: TextWorldExpressSuite) -> None:
    coin = twx.tasks("train", 3)[:3]
    assert {t.subset for t in coin} == {"coin"}
    # twc's raw gold paths run one move past the win; the expert path must stop at the win
    twc = [twx.make_task("twc", "test", seed) for seed in twx.split_seeds("twc", "test", 2)]
    for task in coin + twc:
        with twx.episode(task) as ep:
            first = ep.reset()
            assert task.instruction and first.observation
            assert first.options.startswith("Valid actions: ")  # shown with the latest observation only
            assert "Valid actions" not in first.observation
            assert not first.done and not first.success
            expert = ep.expert_actions()
            assert expert, "every coin and twc task has a reference path"
            result = None
            for i, call in enumerate(expert):
                assert ep.expert_actions() == expert[i:]
                assert call in ep.valid_actions()
                assert result is None or not result.done
                result = ep.step(call)
            assert result is not None and result.done and result.success
            assert result.score == 1.0
            assert ep.valid_actions() == []


@pytest.mark.integration
@needs_java
def test_twx_reference_path_is_the_shortest_draw_and_the_same_in_every_process(
    twx: TextWorldExpressSuite,
) -> None:
    """TWX draws its gold paths at random (coin: 3 moves or a wander of up to 23); the expert
    and the gold baseline must not depend on the draw, nor on which suite asks."""
    fresh = TextWorldExpressSuite(["coin", "mapreader", "sorting"])  # own JVMs and cache: a new process
    try:
        for task in twx.tasks("train", 3):
            with twx.episode(task) as ep:
                ep.reset()
                ours = [c.args["action"] for c in ep.expert_actions() or []]
                draws = ep.gold_draws(12)
            assert ours and draws
            assert len(ours) <= min(len(d) for d in draws), (task.id, ours, draws)
            with fresh.episode(task) as ep:  # asked for mid-episode: found, then the game put back
                ep.reset()
                ep.step(_act(ours[0]))
                rest = ep.expert_actions() or []
                assert [c.args["action"] for c in rest] == ours[1:]
                results = [ep.step(call) for call in rest]
                assert results[-1].done and results[-1].success
        # mapreader's reading of the map leaves the state as it was, but it is no detour
        task = next(t for t in twx.tasks("train", 1) if t.subset == "mapreader")
        with twx.episode(task) as ep:
            ep.reset()
            assert "read map" in [c.args["action"] for c in ep.expert_actions() or []]
    finally:
        fresh.close()


@pytest.mark.integration
@needs_java
def test_twx_invalid_action_and_tool_schema(twx: TextWorldExpressSuite) -> None:
    task = twx.load("textworld-express:coin:dev:10000")
    with twx.episode(task) as ep:
        ep.reset()
        gold = ep.expert_actions()
        assert gold
        valid = [c.args["action"] for c in ep.valid_actions()]
        assert valid == sorted(valid) and len(valid) >= 2
        (tool,) = ep.tools()
        assert tool.name == "act"
        assert tool.parameters["properties"]["action"]["enum"] == valid
        assert "valid action" in tool.description

        with pytest.raises(ActionError, match="not a valid action"):
            ep.step(_act("fly to the moon"))
        with pytest.raises(ActionError, match="unknown tool"):
            ep.step(ToolCall(name="look", args={}))
        with pytest.raises(ActionError):
            ep.step(ToolCall(name="act", args={}))
        # the episode goes on, in the same state
        assert [c.args["action"] for c in ep.valid_actions()] == valid
        result = ep.step(_act("inventory"))
        assert not result.done
        assert "inventory" in result.observation.lower()
        assert result.options.startswith("Valid actions: ") and "Valid actions" not in result.observation
        # the enum follows the state
        assert ep.tools()[0].parameters["properties"]["action"]["enum"] == [
            c.args["action"] for c in ep.valid_actions()
        ]
        # expert actions are the rest of the gold path, or None once the agent left it
        if gold[0].args["action"] == "inventory":
            assert ep.expert_actions() == gold[1:]
        else:
            assert ep.expert_actions() is None


@pytest.mark.integration
@needs_java
def test_twx_concurrent_episodes_replay_identically(twx: TextWorldExpressSuite) -> None:
    task = twx.load("textworld-express:mapreader:test:20001")
    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    both_hold_one = threading.Barrier(2)  # an episode is fast: make sure the two overlap

    def run(slot: int) -> None:
        try:
            rng = random.Random(7)  # same action choices in both threads
            with twx.episode(task) as ep:
                both_hold_one.wait(timeout=300)
                first = ep.reset()
                trace = [first.observation + first.options]
                for _ in range(8):
                    step = ep.step(ep.random_action(rng))
                    trace.append(step.observation + step.options)
                    if step.done:
                        break
            results[slot] = trace
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert results[0] == results[1], "same task and actions must replay the same observations"
    assert len(results[0]) > 1
    assert twx.pool_size >= 2  # two JVMs were needed at once, and both went back to the pool


@pytest.mark.integration
@needs_java
def test_twx_close_is_idempotent_and_returns_env(twx: TextWorldExpressSuite) -> None:
    task = twx.tasks("dev", 1)[0]
    ep = twx.episode(task)
    ep.reset()
    ep.close()
    ep.close()
    with pytest.raises(RuntimeError):
        ep.step(_act("inventory"))
    before = twx.pool_size
    with twx.episode(task) as again:  # reuses the idle JVM rather than starting one
        again.reset()
    assert twx.pool_size == before


def test_twx_missing_java_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import ratchet.suites.textworld_express as twx_mod

    for found in (None, 11):  # no java on PATH; too old a java
        monkeypatch.setattr(twx_mod, "_java_ok", False)
        monkeypatch.setattr(twx_mod, "java_major_version", lambda java="java", v=found: v)
        suite = TextWorldExpressSuite()  # constructing needs no Java...
        with pytest.raises(EnvironmentMissingError, match="Java 17 is not installed"):
            suite.split_seeds("coin", "train", 1)  # ...the first JVM does
        assert suite.pool_size == 0


def test_registry_builds_both_suites() -> None:
    twx = get_suite("textworld-express:coin,cookingworld")
    assert isinstance(twx, TextWorldExpressSuite) and twx.subsets == ["coin", "cookingworld"]
    assert {"coin", "mapreader", "sorting", "cookingworld"} <= set(twx.available_subsets())
    rg = get_suite("reasoning-gym")
    assert isinstance(rg, ReasoningGymSuite) and rg.subsets == list(rg.default_subsets)


# ---------------------------------------------------------------------------------------
# reasoning-gym
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rg() -> ReasoningGymSuite:
    return ReasoningGymSuite()


def test_rg_tasks_deterministic_disjoint_and_replayable(rg: ReasoningGymSuite) -> None:
    by_split = {split: rg.tasks(split, 4) for split in SPLITS}
    assert rg.tasks("dev", 4) == by_split["dev"]
    seeds = {split: {t.seed for t in tasks} for split, tasks in by_split.items()}
    assert not seeds["train"] & seeds["dev"] and not seeds["dev"] & seeds["test"]
    assert not seeds["train"] & seeds["test"]
    # item i of a generator comes from seed + i: splits must be far apart
    assert min(seeds["dev"]) - max(seeds["train"]) >= 10**5
    for tasks in by_split.values():
        assert {t.subset for t in tasks} == set(rg.default_subsets)
        for task in tasks:
            assert rg.load(task.id) == task
            assert task.max_steps == 6
            assert "answer tool" in task.instruction
            assert task.spec["dataset"] == task.subset
    questions = [t.instruction for t in by_split["train"] if t.subset == "chain_sum"]
    assert len(set(questions)) == len(questions)


def test_rg_available_subsets_are_the_registry(rg: ReasoningGymSuite) -> None:
    names = rg.available_subsets()
    assert len(names) >= 100
    assert set(rg.default_subsets) <= set(names)
    assert "composite" not in names  # cannot be built from its default config


def test_rg_gold_answer_succeeds_and_wrong_fails(rg: ReasoningGymSuite) -> None:
    for task in rg.tasks("test", 2):
        with rg.episode(task) as ep:
            assert ep.reset().observation == task.instruction
            assert ep.valid_actions() == []
            (gold,) = ep.expert_actions()
            result = ep.step(gold)
            assert result.done and result.success and result.score == 1.0
        with rg.episode(task) as ep:
            ep.reset()
            result = ep.step(ToolCall(name="answer", args={"answer": "not the answer 123456789"}))
            assert result.done and not result.success and result.score < 1.0


def test_rg_partial_credit_is_not_success(rg: ReasoningGymSuite) -> None:
    # countdown gives 0.05 to a well-formed expression that does not use exactly its numbers
    task = rg.tasks("dev", 1)[2]
    assert task.subset == "countdown"
    with rg.episode(task) as ep:
        ep.reset()
        numbers = ep.entry["metadata"]["numbers"]
        result = ep.step(
            ToolCall(name="answer", args={"answer": " + ".join(str(n) for n in numbers) + " - 0"})
        )
        assert result.done and not result.success
        assert 0.0 < result.score < 1.0


def test_rg_calculator_and_unknown_tool(rg: ReasoningGymSuite) -> None:
    task = rg.tasks("train", 1)[0]
    with rg.episode(task) as ep:
        ep.reset()
        names = {t.name for t in ep.tools()}
        assert names == {"calculator", "answer"}
        result = ep.step(ToolCall(name="calculator", args={"expression": "2*(3+4)"}))
        assert not result.done and result.observation.endswith("= 14")
        for bad in ["__import__('os')", "2**10**10", "1/0", "x + 1", "2 ^ 3", "", "(" * 50]:
            with pytest.raises(ActionError):
                ep.step(ToolCall(name="calculator", args={"expression": bad}))
        with pytest.raises(ActionError, match="unknown tool"):
            ep.step(ToolCall(name="shell", args={"cmd": "ls"}))
        # still running: the gold answer still counts
        assert ep.step(ep.expert_actions()[0]).success


@pytest.mark.parametrize(
    ("expression", "value"),
    [("2*(3+4)", 14), ("-7 // 2", -4), ("7 % 3", 1), ("2**10", 1024), ("1/4", 0.25), ("+-3", -3)],
)
def test_calculate_values(expression: str, value: float) -> None:
    assert calculate(expression) == value


def test_verifier_hang_guard() -> None:
    # countdown's score_answer runs sympy on the answer: '9**9**9' would never return
    assert answer_too_costly("9**9**9")
    assert answer_too_costly("(9**9999)**9999")
    assert answer_too_costly("123456789!")
    assert not answer_too_costly("12*51 - 37 - 94")
    assert not answer_too_costly("x**2 + 3*x")
    assert not answer_too_costly("2**10")
