"""Prefect flow `generation`: one pass of the loop, logged as one MLflow child run.

Today a generation explores, diagnoses, distills and evaluates; verify → promote →
fine-tune slot in between as they land (issues 4–5), each a stage over the same runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow

from ratchet.config import Settings
from ratchet.flows import tracking
from ratchet.flows.diagnose import DiagnoseResult, diagnose_stage
from ratchet.flows.distill import DistillResult, distill_stage
from ratchet.flows.runtime import open_runtime
from ratchet.flows.stages import StageResult, evaluate_stage, explore_stage


@dataclass
class GenerationResult:
    generation: int
    run_id: str
    explore: StageResult
    diagnose: DiagnoseResult
    distill: DistillResult
    evaluate: StageResult


@flow(name="generation", validate_parameters=False)
def generation_flow(settings: Settings, generation: int = 0, base_url: str | None = None) -> GenerationResult:
    with open_runtime(settings, base_url) as rt, tracking.generation_run(settings, generation) as run_id:
        policy = rt.live_policy()
        explored = explore_stage(rt, generation, policy)
        diagnosed = diagnose_stage(rt, generation)
        distilled = distill_stage(rt, generation)
        evaluated = evaluate_stage(rt, generation, policy)
        return GenerationResult(generation, run_id, explored, diagnosed, distilled, evaluated)
