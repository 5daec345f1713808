"""Prefect flow `explore`: k sampled rollouts per train task of the current policy.

Exploration (temperature, epsilon-random valid actions, expert trajectories) is a setting
of this stage only, never of `evaluate`.
"""

from __future__ import annotations

from collections.abc import Callable

import mlflow
from prefect import flow

from ratchet.agents.actor import ActorSettings
from ratchet.agents.rollout import EXPERT_ROLLOUT, RolloutSlot, run_expert
from ratchet.agents.search import search_slots
from ratchet.config import Settings
from ratchet.flows import tracking
from ratchet.flows.rollouts import StageResult, actor_settings, derive_seed, play, run_split
from ratchet.flows.runtime import LoopRuntime, check_search, open_runtime
from ratchet.types import Policy


@flow(name="explore", validate_parameters=False)
def explore(settings: Settings, generation: int = 0, base_url: str | None = None) -> StageResult:
    with open_runtime(settings, base_url) as rt, tracking.generation_run(settings, generation):
        return explore_stage(rt, generation, rt.live_policy())


def explore_stage(rt: LoopRuntime, generation: int, policy: Policy) -> StageResult:
    """k sampled rollouts per train task, with epsilon-random exploration (never used to evaluate)."""
    s = rt.settings

    def settings_for(slot: RolloutSlot) -> ActorSettings:
        seed = derive_seed(s.seed, slot.id)
        return actor_settings(s, slot, s.explore.temperature, s.explore.epsilon, seed)

    e = s.explore
    params = {
        "explore_rollouts_per_task": e.rollouts_per_task,
        "explore_temperature": e.temperature,
        "explore_epsilon": e.epsilon,
    }
    if e.search:
        check_search(rt.suite)
        params["explore_search_calls"] = e.search
    result = run_split(rt, "explore", "train", generation, policy, e.rollouts_per_task, settings_for, params)
    if s.explore.experts:
        seed_experts(rt, generation)
    if e.search:
        result.searched = search_stage(rt, generation, policy, settings_for)
    return result


def search_stage(
    rt: LoopRuntime, generation: int, policy: Policy, settings_for: Callable[[RolloutSlot], ActorSettings]
) -> tuple[int, int]:
    """Rounds of searched rollouts (`agents/search.py`), one per still-searched train task a
    round, each round's slots played in parallel; returns the generation's searched rollouts
    (played now or found stored) and how many of them succeeded."""
    s = rt.settings
    tasks = rt.suite.tasks("train", s.splits.train)
    for round_ in range(s.explore.search):  # a searched rollout makes at least one call, or ends its task
        stored = {
            t.id: rt.store.query(evolution=s.evolution, generation=generation, task_id=t.id) for t in tasks
        }
        slots = search_slots(
            s.evolution,
            generation,
            tasks,
            stored,
            s.explore.search,
            round_,
            lambda t: s.max_steps or t.max_steps,
        )
        if not slots:
            break
        play(rt, [(sl, policy) for sl in slots], settings_for, "search")
    searched = [
        t
        for task in tasks
        for t in rt.store.query(evolution=s.evolution, generation=generation, task_id=task.id)
        if t.branch is not None
    ]
    if mlflow.active_run() is not None:
        mlflow.log_metrics(
            {
                "explore_searched_rollouts": len(searched),
                "explore_searched_successes": sum(t.success for t in searched),
                "explore_searched_calls": sum(st.source == "model" for t in searched for st in t.steps),
            }
        )
    return len(searched), sum(t.success for t in searched)


def seed_experts(rt: LoopRuntime, generation: int) -> int:
    """Store one expert trajectory per train task the suite can solve; returns how many exist."""
    s = rt.settings
    slots = [
        RolloutSlot(s.evolution, generation, t, EXPERT_ROLLOUT)
        for t in rt.suite.tasks("train", s.splits.train)
    ]
    have = rt.store.finished_ids([sl.id for sl in slots], suite_version=rt.suite.version)
    for slot in slots:
        if slot.id in have:
            continue
        if (traj := run_expert(rt.suite, slot, s.history_window, s.compact_repeats)) is not None:
            rt.store.put(traj)  # an errored one too: its message is the plug-in author's clue
            if traj.status == "finished":
                have.add(slot.id)
    if mlflow.active_run() is not None:
        mlflow.log_metric("explore_expert_trajectories", len(have))
    return len(have)
