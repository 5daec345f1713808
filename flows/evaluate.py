"""Prefect flow `evaluate`: the held-out test split, fixed seeds, greedy by default."""

from __future__ import annotations

from prefect import flow

from ratchet.config import Settings
from ratchet.flows import tracking
from ratchet.flows.runtime import open_runtime
from ratchet.flows.stages import StageResult, evaluate_stage


@flow(name="evaluate", validate_parameters=False)
def evaluate(settings: Settings, generation: int = 0, base_url: str | None = None) -> StageResult:
    with open_runtime(settings, base_url) as rt, tracking.generation_run(settings, generation):
        return evaluate_stage(rt, generation, rt.live_policy())
