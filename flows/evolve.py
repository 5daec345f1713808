"""Running the loop (`ratchet.flows.loop` lists its stages): `evolve` runs generations, each
stage a subflow; `generation` runs a subset of one generation's stages (`ratchet run`:
explore, diagnose, distill and evaluate, without the gates), the same subflows in order.

`verify` gates every candidate and promotes the winners itself when `verify.promotion` is
"auto" (with "manual" they wait for a person: CLI, dashboard or the `promote` flow);
`finetune` trains an adapter on the clean successes so far and gates it the same way.
One model endpoint serves every stage of every generation.

Resume: every stage is idempotent (rollouts, diagnoses, candidates and adapter versions are
keyed by content and found again), and the evolution's journal (`evolve_journal`, rewritten
atomically after each stage) records which stages finished. Running the same evolution
again skips those and reruns only the stage a kill interrupted.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prefect import flow

from ratchet import faults
from ratchet.config import Settings, settings_from
from ratchet.flows import loop, tracking
from ratchet.flows.journal import Journal
from ratchet.flows.launch import task_runner
from ratchet.flows.progress import StageEvent, report_stage
from ratchet.flows.runtime import model_endpoint, preflight
from ratchet.flows.service_logs import keep_service_logs


def run_stage(settings: Settings, name: str, generation: int, url: str) -> tuple[Any, dict[str, Any], str]:
    """One stage as a subflow on the task runner the settings choose: its result (a failed
    stage raises, as a plain call would), its journal summary and its Prefect flow run id.
    Whoever listens (`ratchet.flows.progress`) hears it start and finish."""
    flow_obj = loop.stage_flow(name)
    stage = flow_obj.with_options(task_runner=task_runner(settings, flow_obj.name))
    report_stage(StageEvent(generation, name, "started"))
    started = time.perf_counter()
    state = stage(settings=settings, generation=generation, base_url=url, return_state=True)
    out = state.result()
    summary = out.summary()
    report_stage(StageEvent(generation, name, "finished", summary, time.perf_counter() - started))
    return out, summary, str(state.state_details.flow_run_id or "")


def check_settings(settings: Settings) -> None:
    """Everything bad input can break, before anything runs: suite, Java, endpoint, dev split."""
    preflight(settings, gate=True)  # the dev split now, not at generation 1's verify


@flow(name="evolve", validate_parameters=False)
def evolve_flow(
    settings: Settings | None = None,
    generations: int | None = None,
    base_url: str | None = None,
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    extend: bool = False,
) -> Journal:
    """Generations 0..N of the evolution (N = `evolve.generations`, at least 1). With `extend`
    (the nightly schedule), N more after the last finished generation once one has finished:
    each scheduled run goes further, and plays what was learned from use since the last.

    A deployment passes `config` (a ratchet.toml path) and `overrides` (dotted keys, no
    secrets) instead of `settings`: the Prefect server stores parameters as JSON."""
    settings = settings or settings_from(config, overrides)
    keep_service_logs(settings.logs_dir)  # a deployment's run, too
    check_settings(settings)
    journal = Journal.load(settings)
    last = last_generation(journal, settings, generations, extend)
    with model_endpoint(settings, base_url) as url:
        for generation in range(last + 1):
            for name in loop.stages_of(generation, settings):
                if journal.done(generation, name):
                    continue
                faults.point("stage.started")
                started = time.perf_counter()
                _, summary, run_id = run_stage(settings, name, generation, url)
                faults.point("stage.finished")
                journal.record(generation, name, summary, time.perf_counter() - started, run_id)
                if name == "evaluate":
                    points = [
                        (r.generation, r.test_success, *r.test_ci95) for r in journal.rows() if r.test_n
                    ]
                    tracking.log_success_curve(settings, points)
    return journal


def last_generation(journal: Journal, settings: Settings, generations: int | None, extend: bool) -> int:
    """The last generation this run plays: N (`generations`, else `evolve.generations`), or with
    `extend` N after the last finished one (a killed generation is resumed within those N)."""
    n = generations if generations is not None else settings.evolve.generations
    finished = journal.finished_through(settings) if extend else 0
    return n if finished < 1 else finished + n


@dataclass
class GenerationResult:
    generation: int
    run_id: str  # the generation's MLflow run
    stages: dict[str, Any] = field(default_factory=dict)  # stage name -> its result


@flow(name="generation", validate_parameters=False)
def generation_flow(
    settings: Settings,
    generation: int = 0,
    base_url: str | None = None,
    stages: Sequence[str] | None = None,
) -> GenerationResult:
    """`stages` of one generation (default: the loop's `in_run` stages), in the loop's order,
    without the journal (`ratchet run`): every stage resumes from the stores on its own, so a
    rerun redoes only what is missing."""
    stages = loop.run_stages(settings) if stages is None else tuple(stages)
    names = loop.stage_names()
    unknown = sorted(set(stages) - set(names))
    if unknown:
        raise ValueError(f"unknown stages {unknown}; the loop's stages are {list(names)}")
    preflight(settings, gate=loop.gated(stages), splits=loop.splits(stages))
    results = {}
    with model_endpoint(settings, base_url) as url:
        for name in names:
            if name in stages:
                results[name], _, _ = run_stage(settings, name, generation, url)
    return GenerationResult(generation, tracking.generation_run_id(settings, generation), results)
