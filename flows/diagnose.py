"""Prefect flow `diagnose`: a Diagnosis for every failed train rollout of a generation, then clusters.

Each failure is diagnosed by the `diagnoser` graph against the successful trajectories
(agent and expert) of the same task; the judge's model calls run as Prefect tasks with
the rollouts' retry rule. The judge reads at most `diagnose.judge_max` failures per
family, one of each task in turn (`judged_first`); the others are diagnosed without it.
Diagnoses are stored beside their trajectories, so a rerun only diagnoses what is missing.
Then every diagnosis of the generation is keyed by what failed (`diagnosis/keys.py`: mode,
tool, argument problems, error class, never the task's own values), its key's text
embedded into the `failures` Chroma collection, and clustered; counts by mode, the judge
answers discarded, the clusters and a plot go to the generation's MLflow run.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

import mlflow
from prefect import flow, task
from prefect.futures import as_completed

from ratchet import faults
from ratchet.agents.diagnoser import build_diagnoser, judged
from ratchet.config import Settings
from ratchet.diagnosis.clusters import FailureCluster, cluster_diagnoses
from ratchet.diagnosis.keys import failure_keys
from ratchet.flows import display, tracking
from ratchet.flows.progress import report
from ratchet.flows.rollouts import MODEL_CALL
from ratchet.flows.runtime import LoopRuntime, open_runtime
from ratchet.memory.vector_index import VectorIndex
from ratchet.types import FAILURE_MODES, Diagnosis, Trajectory, family_of

if TYPE_CHECKING:
    from rich.console import Console


@dataclass
class DiagnoseResult:
    failures: int
    diagnosed: int  # newly diagnosed in this run (the rest were stored already)
    by_mode: dict[str, int]
    clusters: list[FailureCluster] = field(default_factory=list)
    # judge answers of this run given no cause, by reason ('says nothing', 'quotes the
    # evidence', 'no answer'): a judge that copies its prompt shows here, not as '...' causes
    discarded: dict[str, int] = field(default_factory=dict)
    judged: int = 0  # of `diagnosed`, those the judge read (`diagnose.judge_max`)

    @property
    def judge_discarded(self) -> int:
        return sum(self.discarded.values())

    def summary(self) -> dict[str, Any]:
        """The journal's record of the stage (`ratchet.flows.stage.StageOutcome`)."""
        return {
            "failures": self.failures,
            "diagnosed": self.diagnosed,
            "judged": self.judged,
            "by_mode": self.by_mode,
            "clusters": len(self.clusters),
            "judge_discarded": self.judge_discarded,
            "judge_discarded_by": self.discarded,
        }

    def render(self, console: Console, settings: Settings, run_id: str | None = None) -> None:
        display.diagnose(console, self)


@task(name="diagnose", task_run_name="diagnose {failure.task_id} #{failure.rollout}", **MODEL_CALL)
def diagnose_task(
    diagnoser: object, failure: Trajectory, successes: list[Trajectory]
) -> tuple[Diagnosis, str]:
    return judged(diagnoser, failure, successes)


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
    chosen = judged_first(failures, s.diagnose.judge_max) if judge is not None else set()
    unjudged = build_diagnoser(None)
    report("diagnose", len(failures) - len(todo), len(failures))
    done = len(failures) - len(todo)
    for t in todo:  # no model call: diagnosed here, in order
        if t.id not in chosen:
            rt.store.put_diagnoses([judged(unjudged, t, successes[t.task_id])[0]])
            faults.point("diagnosis.stored")
            done += 1
    report("diagnose", done, len(failures))
    to_judge = [t for t in todo if t.id in chosen]
    futures = [diagnose_task.submit(diagnoser, t, successes[t.task_id]) for t in to_judge]
    discarded: Counter[str] = Counter()
    for future in as_completed(futures) if futures else ():
        diagnosis, why = future.result()
        rt.store.put_diagnoses([diagnosis])
        discarded.update([why] if why else [])
        faults.point("diagnosis.stored")
        done += 1
        report("diagnose", done, len(failures))
    failed = {t.id for t in failures}
    diagnoses = [d for d in rt.store.diagnoses(s.evolution, generation) if d.trajectory_id in failed]
    clusters = cluster_failures(rt, diagnoses, generation, rows)
    by_mode = dict(Counter(d.mode for d in diagnoses))
    result = DiagnoseResult(
        len(failures), len(todo), by_mode, clusters, dict(sorted(discarded.items())), len(to_judge)
    )
    if mlflow.active_run() is not None:
        _log(result, diagnoses)
    return result


def judged_first(failures: Sequence[Trajectory], limit: int) -> set[str]:
    """Ids of the failures the judge reads: in each family, the first failure of every task
    (tasks and rollouts in order), then every task's second, and so on, until `limit` of
    the family's are taken (0: all). Spread over tasks, so a task that failed four times
    does not take the budget a guardrail needs from the others; the same ids on a rerun."""
    if limit <= 0:
        return {t.id for t in failures}
    by_family: dict[str, dict[str, list[Trajectory]]] = defaultdict(lambda: defaultdict(list))
    for t in sorted(failures, key=lambda t: (t.task_id, t.rollout, t.id)):
        by_family[family_of(t.task_id)][t.task_id].append(t)
    chosen: set[str] = set()
    for tasks in by_family.values():
        turns = zip_longest(*tasks.values())
        order = [t for turn in turns for t in turn if t is not None]
        chosen.update(t.id for t in order[:limit])
    return chosen


def cluster_failures(
    rt: LoopRuntime, diagnoses: list[Diagnosis], generation: int, trajectories: Sequence[Trajectory] = ()
) -> list[FailureCluster]:
    """Key diagnoses by what failed (against `trajectories`: the failures and the successes
    they are compared with), embed the keys' texts into the `failures` collection, cluster
    them, store cluster ids."""
    if not diagnoses:
        return []
    keys = failure_keys(diagnoses, trajectories)
    index = VectorIndex(rt.settings.index_dir, "failures")
    ids = [d.trajectory_id for d in diagnoses]
    index.upsert(
        ids,
        [k.text for k in keys],
        [
            {
                "evolution": d.evolution,
                "generation": d.generation,
                "mode": d.mode,
                "subset": d.subset,
                "tool": k.tool,
            }
            for d, k in zip(diagnoses, keys, strict=True)
        ],
    )
    clusters = cluster_diagnoses(
        diagnoses,
        index.embeddings(ids),
        rt.settings.diagnose.cluster_similarity,
        prefix=f"g{generation}-",
        keys=keys,
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
            "diagnose_judge_discarded": result.judge_discarded,
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
            "key": c.key.describe() if c.key else "",
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
