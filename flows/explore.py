"""Prefect flow `explore`: k rollouts per train task of the current policy."""

from __future__ import annotations

from prefect import flow

from ratchet.config import Settings
from ratchet.flows import tracking
from ratchet.flows.runtime import open_runtime
from ratchet.flows.stages import StageResult, explore_stage


@flow(name="explore", validate_parameters=False)
def explore(settings: Settings, generation: int = 0, base_url: str | None = None) -> StageResult:
    with open_runtime(settings, base_url) as rt, tracking.generation_run(settings, generation):
        return explore_stage(rt, generation, rt.live_policy())
