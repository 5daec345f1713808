"""Prefect flow `diagnose`: a Diagnosis for every failed train rollout of a generation, then clusters.

Each failure is diagnosed by the `diagnoser` graph against the successful trajectories
(agent and expert) of the same task; the judge's model calls run as Prefect tasks with
the rollouts' retry rule. Diagnoses are stored beside their trajectories, so a rerun only
diagnoses what is missing. Then every diagnosis of the generation is embedded into the
`failures` Chroma collection and clustered; counts by mode, the clusters and a plot go to
the generation's MLflow run.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import mlflow
from prefect import flow, task
from prefect.futures import as_completed

from ratchet import faults
from ratchet.agents.diagnoser import build_diagnoser, diagnose
from ratchet.config import Settings
from ratchet.diagnosis.clusters import FailureCluster, cluster_diagnoses
from ratchet.flows import tracking
from ratchet.flows.progress import report
from ratchet.flows.rollouts import MODEL_CALL
from ratchet.flows.runtime import LoopRuntime, open_runtime
from ratchet.memory.vector_index import VectorIndex
from ratchet.types import FAILURE_MODES, Diagnosis, Trajectory


@dataclass
class DiagnoseResult:
    failures: int
    diagnosed: int  # newly diagnosed in this run (the rest were stored already)
    by_mode: dict[str, int]
    clusters: list[FailureCluster] = field(default_factory=list)


@task(name="diagnose", task_run_name="diagnose {failure.task_id} #{failure.rollout}", **MODEL_CALL)
def diagnose_task(diagnoser: object, failure: Trajectory, successes: list[Trajectory]) -> Diagnosis:
    return diagnose(diagnoser, failure, successes)


def diagnose_stage(rt: LoopRuntime, generation: int) -> DiagnoseResult:
    s = rt.settings
    rows = rt.store.query(evolution=s.evolution, generation=generation, split="train")
    failures = [t for t in rows if t.kind == "agent" and not t.success]
    successes: dict[str, list[Trajectory]] = defaultdict(list)
    for t in rows:
        if t.success and t.status == "finished":
            successes[t.task_id].append(t)
    stored = {d.trajectory_id for d in rt.store.diagnoses(s.evolution, generation)}
    todo = [t for t in failures if t.id not in stored]
    judge = rt.teacher if s.diagnose.judge else None
    diagnoser = build_diagnoser(judge, s.teacher.name or s.model.name)
    report("diagnose", len(failures) - len(todo), len(failures))
    futures = [diagnose_task.submit(diagnoser, t, successes[t.task_id]) for t in todo]
    done = len(failures) - len(todo)
    for future in as_completed(futures) if futures else ():
        rt.store.put_diagnoses([future.result()])
        faults.point("diagnosis.stored")
        done += 1
        report("diagnose", done, len(failures))
    failed = {t.id for t in failures}
    diagnoses = [d for d in rt.store.diagnoses(s.evolution, generation) if d.trajectory_id in failed]
    clusters = cluster_failures(rt, diagnoses, generation)
    result = DiagnoseResult(len(failures), len(todo), dict(Counter(d.mode for d in diagnoses)), clusters)
    if mlflow.active_run() is not None:
        _log(result, diagnoses)
    return result


def cluster_failures(rt: LoopRuntime, diagnoses: list[Diagnosis], generation: int) -> list[FailureCluster]:
    """Embed diagnoses into the `failures` collection, cluster them, store cluster ids."""
    if not diagnoses:
        return []
    index = VectorIndex(rt.settings.index_dir, "failures")
    ids = [d.trajectory_id for d in diagnoses]
    index.upsert(
        ids,
        [d.summary() for d in diagnoses],
        [
            {"evolution": d.evolution, "generation": d.generation, "mode": d.mode, "subset": d.subset}
            for d in diagnoses
        ],
    )
    clusters = cluster_diagnoses(
        diagnoses, index.embeddings(ids), rt.settings.diagnose.cluster_similarity, prefix=f"g{generation}-"
    )
    labelled = [d.model_copy(update={"cluster": c.id}) for c in clusters for d in c.members]
    rt.store.put_diagnoses(labelled)
    by_id = {d.trajectory_id: d for d in labelled}
    for c in clusters:
        c.members = [by_id[d.trajectory_id] for d in c.members]
    return clusters


def _log(result: DiagnoseResult, diagnoses: list[Diagnosis]) -> None:
    mlflow.log_metrics(
        {
            "diagnose_failures": result.failures,
            "diagnose_clusters": len(result.clusters),
            "diagnose_attributed": sum(d.attribution is not None for d in diagnoses),
            "diagnose_judged": sum(bool(d.cause) for d in diagnoses),
            **{f"diagnose_mode_{m}": result.by_mode.get(m, 0) for m in FAILURE_MODES},
        }
    )
    mlflow.log_text("".join(d.model_dump_json() + "\n" for d in diagnoses), "diagnose/diagnoses.jsonl")
    clusters = [
        {
            "id": c.id,
            "family": c.family,
            "mode": c.mode,
            "size": c.size,
            "example": c.members[0].summary(),
            "members": [d.trajectory_id for d in c.members],
        }
        for c in result.clusters
    ]
    mlflow.log_text(json.dumps(clusters, indent=2), "diagnose/clusters.json")
    tracking.log_bar_plot(
        {m.replace("_", " "): n for m, n in sorted(result.by_mode.items(), key=lambda kv: -kv[1])},
        "plots/diagnose_failure_modes.png",
        "failures by mode",
        "failures",
    )


@flow(name="diagnose", validate_parameters=False)
def diagnose_flow(settings: Settings, generation: int = 0, base_url: str | None = None) -> DiagnoseResult:
    with open_runtime(settings, base_url) as rt, tracking.generation_run(settings, generation):
        return diagnose_stage(rt, generation)
