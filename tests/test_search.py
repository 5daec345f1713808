"""Search explore: the replay back to a stored state, the branch from it, the archive's choice
of where to branch, and what is refused (`agents/search.py`, `agents/actor.py:replay_steps`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from langchain_core.messages import ToolMessage

from ratchet.agents.actor import ActorSettings, build_actor
from ratchet.agents.rollout import RolloutSlot, Start, run_rollout
from ratchet.agents.search import SEARCH_ROLLOUT, Archive, search_slots
from ratchet.agents.testing import ScriptedChatModel, call
from ratchet.errors import ConfigError
from ratchet.flows.runtime import check_search
from ratchet.suites.base import Episode, StepResult
from ratchet.types import Policy, Task, ToolCall, Trajectory
from tests.test_actor import SUITE, Counter, CounterSuite

POLICY = Policy(model="m")


class Scored(Counter):
    """The counter game rewarding only its goal, as a score delta does: no progress signal
    before it, as on a suite that offers none (the plain game rewards every action alike)."""

    def step(self, c: ToolCall) -> StepResult:
        result = super().step(c)
        result.reward = 1.0 if result.success else 0.0
        return result


class ScoredSuite(CounterSuite):
    def episode(self, task: Task) -> Episode:
        return Scored(task)


GAME = ScoredSuite()


def played(actions: list[str], rollout: int = 0, max_steps: int = 5) -> Trajectory:
    """A stored trajectory of the counter game (up: +1, down: -1, 2 wins), really played."""
    task = GAME.make_task("c", "train", 0)
    llm = ScriptedChatModel(script=[call("act", action=a) for a in actions])
    slot = RolloutSlot("evo", 0, task, rollout)
    return run_rollout(build_actor(llm), GAME, slot, POLICY, ActorSettings(max_steps=max_steps))


def searched(start: Start, script: list, max_steps: int = 5) -> tuple[Trajectory, ScriptedChatModel]:
    llm = ScriptedChatModel(script=script)
    slot = RolloutSlot("evo", 0, GAME.make_task("c", "train", 0), SEARCH_ROLLOUT, start=start)
    return run_rollout(build_actor(llm), GAME, slot, POLICY, ActorSettings(max_steps=max_steps, seed=3)), llm


def test_a_searched_rollout_replays_its_way_back_without_the_model_then_branches():
    parent = played(["down", "down", "up", "down", "down"])  # never reaches 2
    start = Start(parent=parent.id, prefix=tuple(parent.steps[:2]), away=frozenset({"act: down"}))
    traj, llm = searched(start, [call("act", action="up")] * 3)
    assert [s.source for s in traj.steps] == ["replay", "replay", "search", "model", "model"]
    # the replay saw and got exactly what the parent did; the branch took what it had not
    assert [s.observation for s in traj.steps[:2]] == [s.observation for s in parent.steps[:2]]
    assert [s.tool_result for s in traj.steps[:2]] == [s.tool_result for s in parent.steps[:2]]
    assert traj.steps[2].tool_call.args == {"action": "up"}
    assert traj.branch is not None and (traj.branch.parent, traj.branch.step) == (parent.id, 2)
    # the model was asked only after the branch, with the replayed steps in its history
    assert len(llm.calls) == 2
    history = [m for m in llm.calls[0]["messages"] if isinstance(m, ToolMessage)]
    assert [m.content.split("\n")[0] for m in history] == ["value -1", "value -2", "value -1"]
    # the budget counts the replayed actions: the same 5 as its parent had
    assert traj.budget_used == 5 and not traj.success


def test_a_replay_that_does_not_reproduce_the_stored_step_is_an_error_naming_the_step():
    parent = played(["up", "down", "down"], max_steps=3)
    forged = parent.steps[1].model_copy(update={"tool_result": "value 7"})
    start = Start(parent=parent.id, prefix=(parent.steps[0], forged), away=frozenset())
    traj, llm = searched(start, [call("act", action="up")] * 5)
    assert traj.status == "error" and "ReplayDiverged" in traj.error and "step 1" in traj.error
    assert llm.calls == []  # nothing was played past the divergence
    other = parent.steps[0].model_copy(update={"observation": "value 3"})  # not where the episode starts
    traj, _ = searched(Start(parent=parent.id, prefix=(other,), away=frozenset()), [])
    assert traj.status == "error" and "step 0" in traj.error and "observation" in traj.error


def test_the_archive_branches_first_where_a_failure_went_wrong_then_where_least_visited():
    loop = played(["up", "down", "up", "down", "up"])  # back and forth: stagnation
    archive = Archive.of([loop], max_steps=5)
    # 'value 0' and 'value 1' were each acted from several times; both have an untried action
    frontier = archive.frontier()
    assert frontier, "every state of the loop has an action it never took"
    best = frontier[0]
    assert best.marked  # the failure's own signals point at it
    start = archive.start(best)
    assert start.parent == loop.id and len(start.prefix) == best.position
    assert start.away == frozenset(best.taken)
    # the shortest way back is kept: 'value 1' is reached after one action, not three
    one = next(c for c in archive.cells.values() if c.state.startswith("value 1"))
    assert (one.position, one.cost) == (1, 1)
    # a state whose every offered action was taken is no frontier; nor one without room left
    assert all(c.untried() and c.cost + 2 <= 5 for c in frontier)
    both = played(["up", "down", "down", "up", "up"], rollout=1)
    full = Archive.of([loop, both], max_steps=5)
    zero = next(c for c in full.cells.values() if c.state.startswith("value 0 valid"))  # back at 0
    assert zero.taken == {"act: up", "act: down"} and not zero.untried() and zero not in full.frontier()


def test_the_archive_goes_to_the_most_progress_first_then_to_the_most_room_left():
    """A state reached after the suite's progress signal moved is another cell than the same
    state before it, and branches first; among equals, the cell reached at the least cost
    (deepest first sent most of a measured budget to branches with no room left)."""
    down = played(["down"] * 6, max_steps=6)
    frontier = Archive.of([down], max_steps=6).frontier()
    assert frontier[0].marked  # the repeated action's first step
    assert [c.cost for c in frontier[1:]] == [0, 2, 3, 4]  # equally visited: the most room left first
    # the same steps, where the third action earned a reward (say, the coin was taken)
    gained = down.model_copy(deep=True)
    gained.steps[2].reward = 0.5
    frontier = Archive.of([gained], max_steps=6).frontier()
    assert [(c.progress, c.cost) for c in frontier] == [(0.5, 3), (0.5, 4), (0.0, 1), (0.0, 0), (0.0, 2)]
    # back at 'value 0' after a reward is another cell than 'value 0' before it
    there_and_back = played(["down", "up", "up", "down", "down", "down"], max_steps=6)
    there_and_back.steps[2].reward = 0.5
    cells = Archive.of([there_and_back], max_steps=6).cells.values()
    zero = [c for c in cells if c.state.startswith("value 0 valid")]
    assert sorted((c.progress, c.visits) for c in zero) == [(0.0, 1), (0.5, 1)]


def test_a_branchs_way_back_is_no_visit_to_the_states_it_replays():
    parent = played(["down", "down", "up", "down", "down"])
    start = Start(parent=parent.id, prefix=tuple(parent.steps[:2]), away=frozenset({"act: down"}))
    child, _ = searched(start, [call("act", action="up")] * 3)
    cells = Archive.of([parent, child], max_steps=5).cells.values()
    first = next(c for c in cells if c.state == "value 0")
    assert first.visits == 1  # the parent's step; the child replayed it
    assert sum(c.visits for c in cells) == 5 + 3  # the parent's 5 steps, the child's branch and 2 more


def test_the_evolve_table_says_what_search_found_beside_the_sampled_success():
    from ratchet.cli.evolve import explored
    from ratchet.flows.journal import GenerationRow
    from ratchet.flows.loop import fill_explore

    row = GenerationRow(generation=1)
    fill_explore(row, {"success_rate": 0.0, "ci95": [0.0, 0.14]})  # a journal from before search
    assert row.explore_searched is None and explored(row.explore_success, row.explore_searched) == "0%"
    fill_explore(row, {"success_rate": 0.0, "ci95": [0.0, 0.14], "searched": [76, 1]})
    assert explored(row.explore_success, row.explore_searched) == "0% +1/76 searched"
    assert explored(None, None) == "—"


def test_after_the_branch_the_policy_is_offered_only_what_was_never_taken_at_a_known_state():
    from tests.test_actor import _offered

    parent = played(["down", "up", "down", "up", "down"])  # 0 -> -1 -> 0 -> -1 -> 0: a loop
    archive = Archive.of([parent], max_steps=5)
    first = next(c for c in archive.cells.values() if c.state == "value 0")
    start = archive.start(first)  # back to the start; the branch plays 'up', never taken there
    assert start.known[(0.0, "value 0 valid now: up, down (at 0)")] == {"act: down"}
    traj, llm = searched(
        start, [call("act", action="down"), call("act", action="up"), call("act", action="up")]
    )
    assert [s.tool_call.args["action"] for s in traj.steps] == ["up", "down", "up", "up"]
    assert _offered(llm, 0) == ["up", "down"]  # 'value 1': no stored trajectory was there
    assert _offered(llm, 1) == ["up"]  # back at 0 (with options): the parent took 'down' there
    assert "search-untried" in traj.steps[2].rules and "search-untried" not in traj.steps[1].rules
    # the rollout's own steps count too: back at 'value 1', where it went 'down' before
    assert _offered(llm, 2) == ["up"] and "search-untried" in traj.steps[3].rules
    # a sampled rollout is offered the whole menu at the same states
    again = played(["up", "down", "up"])
    assert all(not s.rules for s in again.steps)


def test_search_slots_stop_at_a_success_or_a_spent_budget_and_never_touch_dev_or_test():
    task = SUITE.make_task("c", "train", 0)
    fail = played(["down", "down", "up", "down", "down"])
    slots = search_slots("evo", 0, [task], {task.id: [fail]}, calls=4, round_=0, max_steps=lambda t: 5)
    assert [s.rollout for s in slots] == [SEARCH_ROLLOUT] and slots[0].start is not None
    assert slots[0].id != RolloutSlot("evo", 0, task, 0).id
    win = played(["up", "up"], rollout=1)
    assert search_slots("evo", 0, [task], {task.id: [fail, win]}, 4, 0, lambda t: 5) == []
    spent, _ = searched(slots[0].start, [call("act", action="down")] * 4)
    assert sum(s.source == "model" for s in spent.steps) >= 1
    assert search_slots("evo", 0, [task], {task.id: [fail, spent]}, 1, 1, lambda t: 5) == []
    with pytest.raises(ValueError, match="only train tasks"):
        search_slots("evo", 0, [SUITE.make_task("c", "dev", 0)], {}, 4, 0, lambda t: 5)


def test_search_is_refused_for_a_suite_that_does_not_declare_replay():
    assert not SUITE.replayable
    with pytest.raises(ConfigError) as exc:
        check_search(SUITE)
    assert (
        "replayable" in str(exc.value)
        and "explore.search = 0" in exc.value.fix
        and "\n" not in str(exc.value)
    )


def test_the_cli_says_where_a_searched_rollout_branched_and_what_a_candidates_evidence_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from typer.testing import CliRunner

    from ratchet.cli.library import evidence_kinds
    from ratchet.cli.main import app
    from ratchet.config import load_settings
    from ratchet.memory.trajectory_store import open_store

    settings = load_settings({"data_dir": tmp_path})
    parent = played(["down", "down", "up", "down", "down"])
    start = Start(parent=parent.id, prefix=tuple(parent.steps[:2]), away=frozenset({"act: down"}))
    child, _ = searched(start, [call("act", action="up")] * 3)
    expert = played(["up", "up"], rollout=-1).model_copy(update={"kind": "expert", "id": "x"})
    store = open_store(settings.trajectories_db)
    for t in (parent, child, expert):
        store.put(t)
    store.close()
    assert evidence_kinds(settings, [parent.id, child.id, "x", "gone"]) == "1 expert, 1 sampled, 1 searched"
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "trajectories", "show", child.id])
    assert out.exit_code == 0, out.output
    assert f"searched: replayed steps 0-1 of {parent.id} without the model, branched at step 2" in out.output
    assert "[replay]" in out.output and "[search]" in out.output and "[model]" in out.output
    # what the environment said is text, never markup: a result with brackets is shown as it is
    odd = child.model_copy(update={"id": "odd"})
    odd.steps[-1].tool_result = "[/bold] a sign reads [red]stop[/red]"
    store = open_store(settings.trajectories_db)
    store.put(odd)
    store.close()
    out = CliRunner().invoke(app, ["--data-dir", str(tmp_path), "trajectories", "show", "odd"])
    assert out.exit_code == 0 and "[/bold] a sign reads [red]stop[/red]" in out.output, out.output


@pytest.mark.integration  # the real model server, TextWorldExpress (Java), Prefect and MLflow
def test_the_explore_flow_searches_from_stored_states_on_the_real_game(embedded_server: str, tmp_path: Path):
    from mlflow.tracking import MlflowClient

    from ratchet.config import load_settings
    from ratchet.flows.explore import explore
    from ratchet.flows.launch import run_flow
    from ratchet.memory.trajectory_store import open_store

    settings = load_settings(
        {
            "data_dir": tmp_path,
            "suite": "textworld-express:coin",
            "splits.train": 1,  # train task 0: its coin is 3 actions away
            "explore.rollouts_per_task": 1,
            "explore.temperature": 0.01,  # the shipped model nearly greedy: it loops, never wins in 3
            "explore.epsilon": 0.0,
            "explore.experts": False,
            "explore.search": 4,
            "max_steps": 3,
        }
    )
    result = run_flow(explore, settings, generation=0, base_url=embedded_server)
    store = open_store(settings.trajectories_db)
    trajs = store.query(evolution="default", generation=0)
    by_id = {t.id: t for t in trajs}
    # the stage's record says what search found beside what sampling did
    searched = [t for t in trajs if t.branch is not None]
    assert result.searched == (len(searched), sum(t.success for t in searched)) and result.report.n == 1
    assert result.summary()["searched"] == list(result.searched)
    sampled = [t for t in trajs if t.branch is None]
    found = [t for t in trajs if t.branch is not None]
    assert len(sampled) == 1 and all(t.split == "train" for t in trajs)
    assert found and all(t.status == "finished" for t in found), [t.error for t in found]
    assert sorted(t.rollout for t in found) == list(range(SEARCH_ROLLOUT, SEARCH_ROLLOUT + len(found)))
    for t in found:  # each went back along a stored trajectory, then branched off it
        parent, at = by_id[t.branch.parent], t.branch.step
        assert [s.source for s in t.steps[:at]] == ["replay"] * at
        assert [s.tool_result for s in t.steps[:at]] == [s.tool_result for s in parent.steps[:at]]
        assert t.steps[at].source == "search"
        taken = {
            s.tool_call.args["action"]
            for p in trajs
            for s in p.steps
            if s.observation == t.steps[at].observation and p.created_at < t.created_at and s.tool_call
        }
        assert t.steps[at].tool_call.args["action"] not in taken or t.success
    assert any(t.branch.step > 0 for t in found)  # a real replay, not only branches at the start
    calls = sum(s.source == "model" for t in found for s in t.steps)
    assert calls <= 4 + 3  # the budget is checked before each round: one rollout may pass it
    run = MlflowClient(settings.mlflow_uri).search_runs(
        [MlflowClient(settings.mlflow_uri).get_experiment_by_name("ratchet-default").experiment_id]
    )[0]
    assert run.data.metrics["explore_searched_rollouts"] == len(found)
    assert run.data.params["explore_search_calls"] == "4"


@pytest.mark.integration  # the real model server, TextWorldExpress (Java), Prefect and MLflow
def test_a_searched_success_on_the_real_game_reaches_the_training_data(embedded_server: str, tmp_path: Path):
    """Coin train task 1 starts in the coin's room: `take coin` is one of the 5 first actions.
    With a budget of 2 actions the only branch point is the first state; search plays an
    untried first action each round and the policy, offered only actions not tried there, a
    second, so within the budget one takes the coin: a searched success, which the fine-tune
    stage's dataset takes as it takes a sampled one."""
    from ratchet.config import load_settings
    from ratchet.flows.explore import explore
    from ratchet.flows.finetune import train_successes, training_dataset
    from ratchet.flows.launch import run_flow
    from ratchet.memory.trajectory_store import open_store

    settings = load_settings(
        {
            "data_dir": tmp_path,
            "suite": "textworld-express:coin",
            "splits.train": 2,
            "explore.rollouts_per_task": 1,
            "explore.temperature": 0.01,
            "explore.epsilon": 0.0,
            "explore.experts": False,
            "explore.search": 8,  # a round costs one model call: 5 first actions fit
            "max_steps": 2,
        }
    )
    run_flow(explore, settings, generation=0, base_url=embedded_server)
    store = open_store(settings.trajectories_db)
    trajs = store.query(evolution="default", generation=0, task_id="textworld-express:coin:train:1")
    sampled = [t for t in trajs if t.branch is None]
    won = [t for t in trajs if t.branch is not None and t.success]
    # the premise: the nearly greedy shipped model does not take the coin by itself here
    assert len(sampled) == 1 and not sampled[0].success
    assert len(won) == 1, [(t.branch, [s.tool_call for s in t.steps]) for t in trajs]
    searched = won[0]
    assert searched.branch.step == 0 and searched.steps[0].source == "search"
    assert searched.steps[-1].tool_call.args == {"action": "take coin"}
    successes = train_successes(settings, store)
    data = training_dataset(settings, successes)
    store.close()
    assert searched.id in data.sources
    mine = [e for e in data.examples if e.trajectory_id == searched.id]
    targets = [json.loads(e.target["tool_calls"][0]["function"]["arguments"]) for e in mine]
    assert targets == [s.tool_call.args for s in searched.steps]  # the branch's action too
