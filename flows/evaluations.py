"""Evaluations: the held-out test of every generation, and the gate of every candidate, as
MLflow GenAI evaluation runs (`mlflow.genai.evaluate`), so MLflow's evaluation views compare
generation with generation and candidate with champion.

* **Held-out** (`heldout`): a nested run `evaluate generation G` under the generation run,
  against the agent version evaluate played (`model_id`, `flows/agent_versions.py`). One row
  per test rollout, keyed by task id and rollout index: the same rows every generation (the
  test split and its seeds are fixed), so the compare view lines them up. The scorer
  `verifier` gives the suite's verdict on the episode (what the suite's verifier decided when
  the episode ended: ratchet's success), `score` the suite's score.
* **Gate** (`gate`): a nested run `gate NAME` per gated candidate (skills, tools, rules,
  exemplars; adapters as `adapter-vN`). One row per dev task of its paired test, with the
  champion's and the candidate's verdicts and the pair's outcome (+1 repair, -1 regression,
  0 unchanged: `paired_outcome/mean` is the net gain per task); params carry the gate's
  decision. A candidate that went live on its own attaches to that agent version.

The outcomes are ratchet's, from its trajectory store and audit log; MLflow gets a copy.
The rows are finished outcomes (no `predict_fn`), so `evaluate` is run without the
autologging it would configure for one (`_finished_rows`): configuring it is what deadlocked
the loop against MLflow's trace exporter.
Each evaluation is written once per content: a rerun of the stage finds it by tags and
leaves it, and one whose rows changed (a resumed generation played another policy) replaces
it. Nothing here raises: a failure is a warning.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator
from typing import Any

import mlflow

# isort: off
# first: the registry's hook imports scikit-learn under MLflow's lock (flows/mlflow_imports.py)
from ratchet.flows import mlflow_imports  # noqa: F401
import mlflow.models.evaluation.evaluator_registry  # noqa: F401 - see _finished_rows

# isort: on
from mlflow.entities import Feedback
from mlflow.genai.evaluation import base as genai_evaluation
from mlflow.genai.scorers import scorer
from mlflow.tracking import MlflowClient

from ratchet.config import Settings
from ratchet.flows.agent_versions import find_model
from ratchet.flows.traces import dashboard_url
from ratchet.flows.tracking import EVOLUTION, KIND, _find_run
from ratchet.hashing import content_hash
from ratchet.types import Trajectory

log = logging.getLogger(__name__)

EVALUATION, CANDIDATE, DIGEST = "ratchet.evaluation", "ratchet.candidate", "ratchet.evaluation_digest"
# not `ratchet.generation`: that tag marks the generation runs themselves
OF_GENERATION = "ratchet.evaluated_generation"
PAIR = {(False, True): 1, (True, False): -1}  # (champion, candidate) -> repair / regression
PAIR_NAMES = {1: "repair", -1: "regression", 0: "unchanged"}


@scorer(name="verifier")
def verifier(outputs: dict[str, Any]) -> Feedback:
    """The suite's verdict on the episode (success), as the rollout recorded it."""
    return Feedback(value=bool(outputs["success"]), rationale=outputs.get("verdict", ""))


@scorer(name="score")
def score(outputs: dict[str, Any]) -> float:
    return float(outputs.get("score", 0.0))


@scorer(name="candidate_verifier")
def candidate_verifier(outputs: dict[str, Any]) -> Feedback:
    return Feedback(value=bool(outputs["candidate"]), rationale="the suite's verdict on the candidate's arm")


@scorer(name="baseline_verifier")
def baseline_verifier(outputs: dict[str, Any]) -> Feedback:
    return Feedback(value=bool(outputs["baseline"]), rationale="the suite's verdict on the champion's arm")


@scorer(name="paired_outcome")
def paired_outcome(outputs: dict[str, Any]) -> Feedback:
    value = PAIR.get((bool(outputs["baseline"]), bool(outputs["candidate"])), 0)
    return Feedback(value=value, rationale=PAIR_NAMES[value])


def heldout(
    settings: Settings,
    generation: int,
    trajectories: list[Trajectory],
    policy_version: str,
    model_id: str,
    split: str = "test",
) -> str:
    """The generation's held-out evaluation run (its id; '' when not written)."""
    board = dashboard_url(settings)
    rows = []
    for t in trajectories:
        verdict = f"{t.suite}: {'solved' if t.success else 'not solved'} in {t.n_steps} step(s)"
        if t.status == "error":
            verdict += f"; the rollout ended in an error: {t.error}"
        rows.append(
            {
                "inputs": {"task_id": t.task_id, "rollout": t.rollout, "instruction": t.instruction[:2000]},
                "outputs": {
                    "success": bool(t.success and t.status == "finished"),
                    "score": t.score,
                    "steps": t.n_steps,
                    "status": t.status,
                    "verdict": verdict,
                    "trajectory_id": t.id,
                    "trajectory_url": f"{board}/trajectories/{t.id}",
                },
            }
        )
    tags = {
        KIND: "evaluation",
        EVOLUTION: settings.evolution,
        OF_GENERATION: str(generation),
        EVALUATION: split,
    }
    params = {
        "policy_version": policy_version,
        "split": split,
        "suite": settings.suite,
        "rollouts": len(rows),
    }
    return _evaluation(
        settings, f"evaluate generation {generation}", tags, rows, [verifier, score], model_id, params
    )


def gate(
    settings: Settings,
    generation: int,
    name: str,
    kind: str,
    family: str,
    status: str,
    evidence: dict[str, Any],
) -> str:
    """The gate of candidate `name` as an evaluation run of its paired outcomes (its id, or "")."""
    pairs = evidence.get("pairs") or []
    arm, champion = str(evidence.get("arm", "")), str(evidence.get("champion", ""))
    rows = [
        {
            "inputs": {"task_id": task_id},
            "outputs": {"baseline": bool(base), "candidate": bool(cand), "champion": champion, "arm": arm},
        }
        for task_id, base, cand in pairs
    ]
    if not rows:
        return ""
    tags = {
        KIND: "evaluation",
        EVOLUTION: settings.evolution,
        OF_GENERATION: str(generation),
        EVALUATION: "gate",
        CANDIDATE: name,
        "ratchet.decision": str(evidence.get("decision", "")),
        "ratchet.status": status,
    }
    keys = (
        "decision",
        "repairs",
        "regressions",
        "unchanged",
        "p_value",
        "looks",
        "tasks",
        "rollouts",
        "replayed",
    )
    params = {k: evidence[k] for k in keys if k in evidence} | {
        "candidate": name,
        "kind": kind,
        "family": family,
        "champion_version": champion,
        "arm_version": arm,
        "reason": str(evidence.get("reason", ""))[:500],
    }
    client = MlflowClient(settings.mlflow_uri)
    run = mlflow.active_run()
    live = find_model(client, run.info.experiment_id, arm) if run is not None and arm else None
    scorers = [candidate_verifier, baseline_verifier, paired_outcome]
    return _evaluation(settings, f"gate {name}", tags, rows, scorers, live.model_id if live else "", params)


def _evaluation(
    settings: Settings,
    run_name: str,
    tags: dict[str, str],
    rows: list[dict[str, Any]],
    scorers: list[Any],
    model_id: str,
    params: dict[str, Any],
) -> str:
    """One evaluation run nested under the active generation run (found again by `tags`)."""
    parent = mlflow.active_run()
    if parent is None or not rows:
        return ""
    # static rows and scorers that only read them: threads gain nothing, and many of them
    # wait on the sqlite store's connection pool for its 30 s timeout
    os.environ.setdefault("MLFLOW_GENAI_EVAL_MAX_WORKERS", "2")
    try:
        client = MlflowClient(settings.mlflow_uri)
        exp_id = parent.info.experiment_id
        digest = content_hash([rows, model_id, params])
        old = _find_run(client, exp_id, tags)
        if old is not None:
            if client.get_run(old).data.tags.get(DIGEST) == digest:
                return old
            _discard(client, exp_id, old)
        with (
            mlflow.start_run(nested=True, run_name=run_name, tags=tags) as run,
            mlflow.tracing.context(enabled=True),  # evaluate keeps its rows as traces
            _finished_rows(),
            _quiet(),
        ):
            mlflow.log_params({k: str(v) for k, v in params.items()})
            mlflow.genai.evaluate(data=rows, scorers=scorers, model_id=model_id or None)
            mlflow.set_tag(DIGEST, digest)  # complete: a rerun leaves it
        return run.info.run_id
    except Exception as exc:  # noqa: BLE001 - an evaluation run is a mirror of ratchet's outcomes
        log.warning("MLflow evaluation %r was not written (ratchet's own outcomes stand): %s", run_name, exc)
        return ""


def _discard(client: MlflowClient, exp_id: str, run_id: str) -> None:
    """An evaluation run that no longer matches its rows, and the traces it kept them in."""
    found = client.search_traces(locations=[exp_id], run_id=run_id, include_spans=False, max_results=1000)
    if found:
        client.delete_traces(exp_id, trace_ids=[t.info.trace_id for t in found])
    client.delete_run(run_id)


@contextlib.contextmanager
def _finished_rows() -> Iterator[None]:
    """`mlflow.genai.evaluate` without the autologging it turns on for a `predict_fn`'s calls.

    Ours are finished rows: there is no call to trace. And turning it on deadlocked the loop:
    MLflow registers a post-import hook per library, and for one already imported (openai) the
    hook runs at once, holding MLflow's hook lock, and imports (`agents.run`, missing, so
    every time), which needs Python's import lock. The trace exporter's thread, importing
    lazily (IPython, also missing), holds Python's import lock while MLflow's import finder
    waits for the hook lock. Each waited for the other, forever (tests/test_hang.py forces that
    order). MLflow 3.17.2 still fires hooks under its lock. Only the loop's own thread calls
    `evaluate`, one at a time, so swapping the module's name for the duration is safe; the
    module that registers a hook when first imported is imported with this one, before any
    exporter thread exists."""
    original = genai_evaluation.configure_autologging_for_evaluation
    genai_evaluation.configure_autologging_for_evaluation = _no_autologging
    try:
        yield
    finally:
        genai_evaluation.configure_autologging_for_evaluation = original


@contextlib.contextmanager
def _no_autologging(enable_tracing: bool = True) -> Iterator[None]:
    yield


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """`mlflow.genai.evaluate` prints a progress bar and a summary: keep them off the terminal."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield
