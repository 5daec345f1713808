"""One rollout: a fresh episode, the actor graph, and the resulting Trajectory."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from agents.actor import ActorSettings, RolloutContext, ToolRunner, initial_state
from agents.model import is_transient
from ratchet.types import Policy, Task, Trajectory, trajectory_id
from suites.base import Suite


@dataclass(frozen=True)
class RolloutSlot:
    """Where a rollout belongs; its trajectory id is derived from these four fields."""

    evolution: str
    generation: int
    task: Task
    rollout: int

    @property
    def id(self) -> str:
        return trajectory_id(self.evolution, self.generation, self.task.id, self.rollout)


def run_rollout(
    actor: Any,
    suite: Suite,
    slot: RolloutSlot,
    policy: Policy,
    settings: ActorSettings,
    tool_runner: ToolRunner | None = None,
) -> Trajectory:
    """Play `slot.task` once. Transient model errors propagate (the caller retries the whole
    rollout); any other failure is kept in the trajectory as status 'error' with its steps."""
    task = slot.task
    started = time.perf_counter()
    error: str | None = None
    with suite.episode(task) as episode:
        first = episode.reset()
        ctx = RolloutContext(
            episode=episode,
            policy=policy,
            settings=settings,
            observation=first.observation,
            options=first.options,
            tool_runner=tool_runner,
        )
        try:
            actor.invoke(
                initial_state(task.instruction, first.observation),
                context=ctx,
                config={
                    "recursion_limit": 4 * settings.max_steps + 8,
                    "run_name": f"rollout {task.id} #{slot.rollout}",
                },
            )
        except Exception as exc:
            if is_transient(exc):
                raise
            error = f"{type(exc).__name__}: {exc}"
    outcome = ctx.outcome
    return Trajectory(
        id=slot.id,
        evolution=slot.evolution,
        generation=slot.generation,
        task_id=task.id,
        suite=task.suite,
        subset=task.subset,
        split=task.split,
        rollout=slot.rollout,
        seed=settings.seed,
        policy_version=policy.version,
        instruction=task.instruction,
        steps=ctx.steps,
        status="error" if error else "finished",
        success=bool(outcome and outcome.success) and error is None,
        score=outcome.score if outcome else 0.0,
        error=error,
        seconds=time.perf_counter() - started,
    )
