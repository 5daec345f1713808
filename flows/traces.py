"""MLflow traces of a sample of the rollouts of the `traced` stages, explore and evaluate
(`ratchet.flows.loop.LOOP`; LangGraph autolog).

Which rollouts are traced is decided per rollout, reproducibly: a rollout is traced when a
hash of its task id and rollout index falls below `trace_sample_rate` (`sampled`). A rerun
traces the same ones, and so does every generation (the hash leaves the generation out): a
sampled test task is traced in each generation, and its session shows them side by side. Verify arms, expert
replays and the teacher's graphs (diagnose, distill) are never traced: `tracking.generation_run`
turns tracing off for everything a stage does, and `rollout_trace` turns it on again for
the sampled rollouts only (`mlflow.tracing.context`, a context variable: each rollout's
thread decides for itself).

A traced rollout is one trace: a root AGENT span, under it the actor graph as autolog
records it (a span per node, per model call, per tool call), written to the evolution's
experiment and linked to the generation run and to the agent version that played it
(`flows/agent_versions.py`). Its session (MLflow's `mlflow.trace.session` metadata) is the
task id, so the Sessions view groups every traced rollout of one task across generations;
its tags carry the trajectory id, task, stage, generation, outcome and the link to the
dashboard's trajectory page.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlflow
from mlflow.entities import SpanType
from mlflow.entities.trace_location import MlflowExperimentLocation
from mlflow.tracing.constant import TraceMetadataKey

from ratchet.agents.rollout import RolloutSlot
from ratchet.config import Settings
from ratchet.flows import loop
from ratchet.hashing import content_hash
from ratchet.types import Trajectory

log = logging.getLogger(__name__)

SESSION = TraceMetadataKey.TRACE_SESSION  # "mlflow.trace.session": the task id
TRAJECTORY, TASK, STAGE, GENERATION = (
    "ratchet.trajectory_id",
    "ratchet.task_id",
    "ratchet.stage",
    "ratchet.generation",
)
OUTCOME, URL, POLICY = "ratchet.outcome", "ratchet.trajectory_url", "ratchet.policy_version"

_autolog = threading.Lock()
_autolog_on: set[str] = set()  # tracking URIs this process turned autolog on for


def sampled(task_id: str, rollout: int, rate: float) -> bool:
    """Whether rollout `rollout` of task `task_id` is traced at `rate`, in any generation:
    the same answer every time, and a higher rate only adds rollouts."""
    if rate <= 0:
        return False
    return rate >= 1 or int(content_hash(["trace", task_id, rollout], length=8), 16) < rate * 16**8


def dashboard_url(settings: Settings) -> str:
    """Where `ratchet dashboard` serves this data dir."""
    return f"http://127.0.0.1:{settings.dashboard.port}"


@dataclass(frozen=True)
class TraceTarget:
    """Where a sampled rollout's trace goes; picklable, so a Dask or Ray worker traces too."""

    tracking_uri: str
    experiment_id: str
    run_id: str  # the generation run (the trace's source run)
    model_id: str  # the agent version playing ('' if it could not be recorded)
    stage: str
    generation: int
    policy_version: str
    dashboard: str  # base URL of the dashboard, for the trajectory link
    rate: float

    def wants(self, slot: RolloutSlot) -> bool:
        return sampled(slot.task.id, slot.rollout, self.rate)


def target(
    settings: Settings, stage: str, generation: int, policy_version: str, run_id: str, model_id: str
) -> TraceTarget | None:
    """The trace target of a stage's rollouts (None: the stage is not `traced` in the loop's
    list, `ratchet.flows.loop.LOOP`, or the rate is 0)."""
    if not loop.traced(stage) or settings.trace_sample_rate <= 0:
        return None
    from ratchet.flows.tracking import setup_experiment

    return TraceTarget(
        settings.mlflow_uri,
        setup_experiment(settings),
        run_id,
        model_id,
        stage,
        generation,
        policy_version,
        dashboard_url(settings),
        settings.trace_sample_rate,
    )


def enable_autolog(tracking_uri: str) -> None:
    """LangGraph autolog on in this process, once (a worker process turns it on at its first
    sampled rollout). It records nothing outside a `rollout_trace` scope of a sampled rollout."""
    with _autolog:
        if tracking_uri in _autolog_on:
            return
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.langchain.autolog(log_traces=True, silent=True)
        _autolog_on.add(tracking_uri)


def autolog_on() -> bool:
    return bool(_autolog_on)


def disable_autolog() -> None:
    with _autolog:
        mlflow.langchain.autolog(disable=True, silent=True)
        _autolog_on.clear()


@contextmanager
def rollout_trace(trace: TraceTarget | None, slot: RolloutSlot) -> Iterator[Callable[[Trajectory], None]]:
    """Around one rollout: a trace of it if `trace` is given, else tracing off inside. Yields
    `finish(trajectory)`, which records the outcome on the trace. Tracing never fails a rollout:
    MLflow's own spans swallow their errors, and so does `finish`."""
    if trace is None:
        with mlflow.tracing.context(enabled=False):
            yield lambda _: None
        return
    enable_autolog(trace.tracking_uri)
    task = slot.task
    tags = {
        TRAJECTORY: slot.id,
        TASK: task.id,
        STAGE: trace.stage,
        GENERATION: str(trace.generation),
        POLICY: trace.policy_version,
        URL: f"{trace.dashboard}/trajectories/{slot.id}",
    }
    with (
        mlflow.tracing.context(enabled=True, session_id=task.id, tags=tags),
        mlflow.start_span(
            name=f"{trace.stage} {task.id} #{slot.rollout}",
            span_type=SpanType.AGENT,
            trace_destination=MlflowExperimentLocation(trace.experiment_id),
            run_id=trace.run_id or None,
        ) as span,
    ):
        span.set_inputs({"task_id": task.id, "instruction": task.instruction, "rollout": slot.rollout})

        def finish(traj: Trajectory) -> None:
            try:
                outcome = "error" if traj.status == "error" else "success" if traj.success else "failure"
                span.set_outputs(
                    {"outcome": outcome, "score": traj.score, "steps": traj.n_steps, "error": traj.error}
                )
                mlflow.update_current_trace(
                    tags={OUTCOME: outcome},
                    model_id=trace.model_id or None,
                    state="ERROR" if traj.status == "error" else "OK",
                )
            except Exception as exc:  # noqa: BLE001 - a trace is a mirror, never the rollout's result
                log.warning("could not record the outcome on the trace of %s: %s", slot.id, exc)

        yield finish


def flush() -> None:
    """Wait for traces written in the background (before a stage reports itself finished)."""
    try:
        mlflow.flush_trace_async_logging()
    except Exception as exc:  # noqa: BLE001 - traces are a mirror
        log.warning("could not flush MLflow traces: %s", exc)
