"""One rollout: a fresh episode, the actor graph, and the resulting Trajectory."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ratchet.agents.actor import (
    ActorSettings,
    RolloutContext,
    ToolRunner,
    initial_state,
    join_options,
    replay_steps,
)
from ratchet.agents.model import is_transient
from ratchet.agents.prompts import system_prompt, task_prompt
from ratchet.hashing import content_hash
from ratchet.suites.base import ActionError, Suite
from ratchet.types import Branch, Policy, PromptRecord, SkillText, Step, Task, Trajectory, trajectory_id


@dataclass(frozen=True)
class Start:
    """How a searched rollout begins (`agents/search.py`): replay `prefix`, the first steps of
    the stored trajectory `parent`, then play a valid action not in `away` (those taken from
    that state before), then let the policy go on, offered at a state of `known` only what
    was never taken there while anything is left (`RolloutContext.known`)."""

    parent: str
    prefix: tuple[Step, ...]
    away: frozenset[str]
    known: Mapping[tuple[float, str], frozenset[str]] = field(default_factory=dict, hash=False, compare=False)

    @property
    def branch(self) -> Branch:
        return Branch(parent=self.parent, step=len(self.prefix))


@dataclass(frozen=True)
class RolloutSlot:
    """Where a rollout belongs; its trajectory id is derived from these fields (not `start`)."""

    evolution: str
    generation: int
    task: Task
    rollout: int
    arm: str = ""  # the side of an A/B intervention ('' outside verify)
    start: Start | None = field(default=None, compare=False, repr=False)  # searched: where it begins

    @property
    def id(self) -> str:
        return trajectory_id(self.evolution, self.generation, self.task.id, self.rollout, self.arm)


def run_rollout(
    actor: Any,
    suite: Suite,
    slot: RolloutSlot,
    policy: Policy,
    settings: ActorSettings,
    tool_runner: ToolRunner | None = None,
    skills: tuple[SkillText, ...] | None = None,
    exemplars: tuple[SkillText, ...] | None = None,
) -> Trajectory:
    """Play `slot.task` once, showing `skills` and `exemplars` (default: all of the policy's);
    a searched slot (`slot.start`) first replays its parent's steps (a replay that does not
    reproduce them is an error trajectory naming the step).

    Transient model errors propagate (the caller retries the whole rollout); any other
    failure is kept in the trajectory as status 'error' with its steps."""
    task = slot.task
    started = time.perf_counter()
    error: str | None = None
    ctx: RolloutContext | None = None
    prompt: PromptRecord | None = None
    try:  # the suite contract: any exception but ActionError ends this rollout, never the run
        with suite.episode(task) as episode:
            first = episode.reset()
            ctx = RolloutContext(
                episode=episode,
                policy=policy,
                settings=settings,
                observation=first.observation,
                options=first.options,
                tool_runner=tool_runner,
                skills=skills,
                exemplars=exemplars,
            )
            state = initial_state(task.instruction, first.observation)
            prompt = ctx.prompt_record(state["task"], first.observation)
            if slot.start is not None:  # searched: back to the branch point without the model
                state["messages"] = replay_steps(ctx, list(slot.start.prefix))
                ctx.branch_away, ctx.known = slot.start.away, slot.start.known
            actor.invoke(
                state,
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
    outcome = ctx.outcome if ctx is not None else None
    return build_trajectory(
        slot,
        suite,
        seed=settings.seed,
        policy_version=policy.version,
        prompt=prompt,
        steps=ctx.steps if ctx is not None else [],
        status="error" if error else "finished",
        done=outcome is not None,
        max_steps=settings.max_steps,
        success=bool(outcome and outcome.success) and error is None,
        score=outcome.score if outcome else 0.0,
        error=error,
        seconds=time.perf_counter() - started,
        branch=slot.start.branch if slot.start is not None else None,
    )


EXPERT_ROLLOUT = -1  # the rollout index of a task's expert trajectory
EXPERT_POLICY = "expert"


def run_expert(
    suite: Suite, slot: RolloutSlot, window: int = 10, compact_repeats: bool = False
) -> Trajectory | None:
    """Play the suite's reference solution for `slot.task`; None if the suite knows none, or
    knows a stale one (a plan step the environment refuses).

    Expert trajectories are tagged `kind='expert'`: usable for distillation and training,
    never counted as the agent's success. An exception from the suite (other than the
    refusal) gives an expert trajectory with status 'error' and its message, not a crash.
    """
    task = slot.task
    started = time.perf_counter()
    steps: list[Step] = []
    prompt: PromptRecord | None = None
    try:
        with suite.episode(task) as episode:
            result = episode.reset()
            plan = episode.expert_actions()
            if not plan:
                return None
            observation, options = result.observation, result.options
            prompt = PromptRecord(  # what the actor would have been shown with no skills: trainable
                system=system_prompt(()),
                task=task_prompt(task.instruction, observation),
                first_observation=observation,
                tools=[t.to_openai() for t in episode.tools()],
                window=window,
                compact_repeats=compact_repeats,
            )
            for action in plan[: task.max_steps]:
                step = Step(
                    index=len(steps),
                    observation=join_options(observation, options),  # as the actor records it
                    tool_call=None if isinstance(action, str) else action,
                    message=action if isinstance(action, str) else "",
                    source="expert",
                )
                try:
                    result = episode.play(action)
                except ActionError:  # a stale reference path: not a usable expert
                    return None
                step.tool_result, step.reward = result.observation, result.reward
                steps.append(step)
                observation, options = result.observation, result.options
                if result.done:
                    break
    except Exception as exc:  # the suite's bug: stored with its message, the run goes on
        return _expert(
            slot, suite, prompt, steps, started, status="error", error=f"{type(exc).__name__}: {exc}"
        )
    if not result.success:
        return None
    return _expert(slot, suite, prompt, steps, started, done=True, success=True, score=result.score)


def _expert(
    slot: RolloutSlot,
    suite: Suite,
    prompt: PromptRecord | None,
    steps: list[Step],
    started: float,
    **fields: Any,
) -> Trajectory:
    return build_trajectory(
        slot,
        suite,
        seed=_seed_of(slot.task),
        policy_version=EXPERT_POLICY,
        kind="expert",
        prompt=prompt,
        steps=steps,
        max_steps=slot.task.max_steps,
        seconds=time.perf_counter() - started,
        **fields,
    )


def _seed_of(task: Task) -> int:
    """A sampling seed for a task: its own seed, or one derived from a string key."""
    return task.seed if isinstance(task.seed, int) else int(content_hash(task.seed, length=8), 16) % (2**31)


def build_trajectory(slot: RolloutSlot, suite: Suite, **fields: Any) -> Trajectory:
    """A Trajectory for `slot`: identity and task fields from the slot, the rest as given."""
    task = slot.task
    return Trajectory(
        id=slot.id,
        evolution=slot.evolution,
        generation=slot.generation,
        task_id=task.id,
        suite=task.suite,
        suite_version=suite.version,
        subset=task.subset,
        split=task.split,
        rollout=slot.rollout,
        arm=slot.arm,
        instruction=task.instruction,
        **fields,
    )
