"""Prefect flow `evaluate`: the held-out test split, fixed seeds, greedy by default, with the
random valid-action policy's and the gold path's levels on the same tasks beside it."""

from __future__ import annotations

import mlflow
from prefect import flow

from ratchet.agents.actor import ActorSettings
from ratchet.agents.baselines import baselines, versus_random
from ratchet.agents.rollout import RolloutSlot
from ratchet.config import Settings
from ratchet.flows import evaluations, tracking
from ratchet.flows.rollouts import StageResult, actor_settings, derive_seed, run_split
from ratchet.flows.runtime import LoopRuntime, open_runtime
from ratchet.types import Policy, Split


@flow(name="evaluate", validate_parameters=False)
def evaluate(settings: Settings, generation: int = 0, base_url: str | None = None) -> StageResult:
    with open_runtime(settings, base_url) as rt, tracking.generation_run(settings, generation):
        return evaluate_stage(rt, generation, rt.live_policy())


def evaluate_stage(rt: LoopRuntime, generation: int, policy: Policy, split: Split = "test") -> StageResult:
    """The held-out split with fixed seeds: the same tasks and seeds every generation."""
    s = rt.settings

    def settings_for(slot: RolloutSlot) -> ActorSettings:
        seed = derive_seed("evaluate", slot.task.id, slot.rollout)  # independent of settings.seed
        return actor_settings(s, slot, s.evaluate.temperature, 0.0, seed)

    e = s.evaluate
    params = {"evaluate_rollouts_per_task": e.rollouts_per_task, "evaluate_temperature": e.temperature}
    result = run_split(rt, "evaluate", split, generation, policy, e.rollouts_per_task, settings_for, params)
    if mlflow.active_run() is not None:  # the same rows as an MLflow evaluation of the agent version
        played = [t for i in result.slot_ids if (t := rt.store.get(i)) is not None]
        evaluations.heldout(s, generation, played, policy.version, result.model_id, split)
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
