"""Prefect flow `evolve`: generations of the loop, each stage a subflow, resumable after a kill.

    generation 0    evaluate                      the starting champion: the baseline
    generation g    explore → diagnose → distill → verify → finetune → evaluate

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
from collections.abc import Callable
from typing import Any

from prefect import flow

from ratchet import faults
from ratchet.config import Settings, settings_from
from ratchet.flows import tracking
from ratchet.flows.diagnose import diagnose_flow
from ratchet.flows.distill import distill_flow
from ratchet.flows.evaluate import evaluate
from ratchet.flows.explore import explore
from ratchet.flows.finetune import finetune_flow
from ratchet.flows.journal import Journal, stage_summary
from ratchet.flows.launch import task_runner
from ratchet.flows.runtime import model_endpoint, preflight
from ratchet.flows.verify import verify_flow

STAGES: dict[str, Callable[..., Any]] = {
    "explore": explore,
    "diagnose": diagnose_flow,
    "distill": distill_flow,
    "verify": verify_flow,
    "finetune": finetune_flow,
    "evaluate": evaluate,
}
BASELINE_STAGES = ("evaluate",)


def stages_of(generation: int) -> tuple[str, ...]:
    return BASELINE_STAGES if generation == 0 else tuple(STAGES)


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
) -> Journal:
    """Generations 0..N of the evolution (N = `evolve.generations`; 0 = the baseline alone).

    A deployment passes `config` (a ratchet.toml path) and `overrides` (dotted keys, no
    secrets) instead of `settings`: the Prefect server stores parameters as JSON."""
    settings = settings or settings_from(config, overrides)
    last = generations if generations is not None else settings.evolve.generations
    check_settings(settings)
    journal = Journal.load(settings)
    with model_endpoint(settings, base_url) as url:
        for generation in range(last + 1):
            for name in stages_of(generation):
                if journal.done(generation, name):
                    continue
                faults.point("stage.started")
                started = time.perf_counter()
                flow_obj = STAGES[name]
                stage = flow_obj.with_options(task_runner=task_runner(settings, flow_obj.name))
                state = stage(settings=settings, generation=generation, base_url=url, return_state=True)
                out = state.result()  # a failed stage raises here, as a plain call would
                faults.point("stage.finished")
                run_id = str(state.state_details.flow_run_id or "")
                journal.record(generation, name, stage_summary(out), time.perf_counter() - started, run_id)
                if name == "evaluate":
                    points = [
                        (r.generation, r.test_success, *r.test_ci95) for r in journal.rows() if r.test_n
                    ]
                    tracking.log_success_curve(settings, points)
    return journal
