"""Explore and evaluate as plain functions over an open LoopRuntime.

The `explore`, `evaluate` and `generation` flows call these; keeping them flow-free lets
one runtime (one model server, one suite pool) serve several stages of a generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import mlflow

from ratchet.agents.actor import ActorSettings
from ratchet.agents.baselines import Baselines, VersusRandom, baselines, versus_random
from ratchet.agents.rollout import EXPERT_ROLLOUT, RolloutSlot, run_expert
from ratchet.config import Settings
from ratchet.flows import tracking
from ratchet.flows.rollouts import RolloutReport, run_slots
from ratchet.flows.runtime import LoopRuntime
from ratchet.hashing import content_hash
from ratchet.types import Policy, Split


@dataclass
class StageResult:
    stage: str
    report: RolloutReport
    wall_seconds: float
    policy_version: str
    baselines: Baselines | None = None  # evaluate: random and gold levels on the same tasks
    vs_random: VersusRandom | None = None  # evaluate: the policy against random, task by task


def derive_seed(*parts: object) -> int:
    return int(content_hash(list(parts), length=8), 16) % (2**31)


def explore_stage(rt: LoopRuntime, generation: int, policy: Policy) -> StageResult:
    """k sampled rollouts per train task, with epsilon-random exploration (never used to evaluate)."""
    s = rt.settings

    def settings_for(slot: RolloutSlot) -> ActorSettings:
        seed = derive_seed(s.seed, slot.id)
        return actor_settings(s, slot, s.explore.temperature, s.explore.epsilon, seed)

    result = _run(rt, "explore", "train", generation, policy, s.explore.rollouts_per_task, settings_for)
    if s.explore.experts:
        seed_experts(rt, generation)
    return result


def seed_experts(rt: LoopRuntime, generation: int) -> int:
    """Store one expert trajectory per train task the suite can solve; returns how many exist."""
    s = rt.settings
    slots = [
        RolloutSlot(s.evolution, generation, t, EXPERT_ROLLOUT)
        for t in rt.suite.tasks("train", s.splits.train)
    ]
    have = rt.store.finished_ids([sl.id for sl in slots])
    for slot in slots:
        if slot.id not in have and (traj := run_expert(rt.suite, slot, s.history_window)) is not None:
            rt.store.put(traj)
            have.add(slot.id)
    if mlflow.active_run() is not None:
        mlflow.log_metric("explore_expert_trajectories", len(have))
    return len(have)


def evaluate_stage(rt: LoopRuntime, generation: int, policy: Policy, split: Split = "test") -> StageResult:
    """The held-out split with fixed seeds: the same tasks and seeds every generation."""
    s = rt.settings

    def settings_for(slot: RolloutSlot) -> ActorSettings:
        seed = derive_seed("evaluate", slot.task.id, slot.rollout)  # independent of settings.seed
        return actor_settings(s, slot, s.evaluate.temperature, 0.0, seed)

    result = _run(rt, "evaluate", split, generation, policy, s.evaluate.rollouts_per_task, settings_for)
    if s.evaluate.baseline_seeds:
        tasks = rt.suite.tasks(split, getattr(s.splits, split))
        result.baselines = baselines(rt.suite, tasks, s.evaluate.baseline_seeds, s.max_steps)
        if result.baselines.random is not None:
            result.vs_random = versus_random(result.report.by_task, result.baselines.random.by_task)
        if mlflow.active_run() is not None:
            _log_baselines(result, split)
    return result


def _log_baselines(result: StageResult, split: str) -> None:
    """Random and gold levels beside the policy's success, and the paired test against random."""
    b = result.baselines
    assert b is not None
    metrics = {}
    for name, level in (("random", b.random), ("gold", b.gold)):
        if level is not None:
            metrics |= {f"{split}_{name}_success": level.rate, f"{split}_{name}_ci_low": level.ci95[0]}
            metrics[f"{split}_{name}_ci_high"] = level.ci95[1]
    if result.vs_random is not None:
        metrics[f"{split}_vs_random_p_value"] = result.vs_random.p_value
    mlflow.log_metrics(metrics)
    tracking.log_summary(b.summary(), "baselines")


def actor_settings(
    s: Settings, slot: RolloutSlot, temperature: float, epsilon: float, seed: int
) -> ActorSettings:
    """How one slot is played: the stage's sampling, the suite's (or the settings') step budget."""
    return ActorSettings(
        max_steps=s.max_steps or slot.task.max_steps,
        temperature=temperature,
        epsilon=epsilon,
        history_window=s.history_window,
        seed=seed,
    )


def _run(
    rt: LoopRuntime,
    stage: str,
    split: Split,
    generation: int,
    policy: Policy,
    rollouts_per_task: int,
    settings_for: Callable[[RolloutSlot], ActorSettings],
) -> StageResult:
    """`rollouts_per_task` rollouts of every task of `split`, then metrics to MLflow."""
    s = rt.settings
    tasks = rt.suite.tasks(split, getattr(s.splits, split))
    slots = [RolloutSlot(s.evolution, generation, t, r) for t in tasks for r in range(rollouts_per_task)]
    started = time.perf_counter()
    report = run_slots(rt, slots, policy, settings_for, stage)
    result = StageResult(stage, report, time.perf_counter() - started, policy.version)
    if mlflow.active_run() is not None:
        _log(rt, result, split, slots)
    return result


def _log(rt: LoopRuntime, result: StageResult, split: Split, slots: list[RolloutSlot]) -> None:
    s = rt.settings
    tracking.log_params(
        {
            "policy_version": result.policy_version,
            "model": s.model.name,
            "endpoint": s.model.endpoint or "embedded",
            "suite": s.suite,
            "experts_used": s.explore.experts,
            f"{result.stage}_tasks": len({sl.task.id for sl in slots}),
            f"{result.stage}_rollouts_per_task": (
                s.explore if result.stage == "explore" else s.evaluate
            ).rollouts_per_task,
            f"{result.stage}_temperature": (
                s.explore if result.stage == "explore" else s.evaluate
            ).temperature,
            **({"explore_epsilon": s.explore.epsilon} if result.stage == "explore" else {}),
        }
    )
    mlflow.log_metrics(result.report.metrics(split) | {f"{result.stage}_wall_seconds": result.wall_seconds})
    trajectories = [t for sl in slots if (t := rt.store.get(sl.id)) is not None]
    tracking.log_success_plot(
        result.report.by_task,
        result.stage,
        f"{result.stage}: success by task ({split}, policy {result.policy_version})",
    )
    tracking.log_trajectory_sample(trajectories, result.stage)
    tracking.log_summary(
        {"split": split, **result.report.__dict__, "wall_seconds": result.wall_seconds}, result.stage
    )
