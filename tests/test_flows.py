"""The generation flow end to end: real Prefect (ephemeral), MLflow (sqlite), embedded server, suites."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from mlflow.tracking import MlflowClient

from ratchet.config import load_settings
from ratchet.flows.evolve import generation_flow
from ratchet.flows.launch import run_flow
from ratchet.flows.rollouts import summarize, wilson_interval
from ratchet.memory.trajectory_store import open_store


def test_wilson_interval_is_sane_at_the_edges():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and 0.2 < hi < 0.35
    lo, hi = wilson_interval(10, 10)
    assert hi == pytest.approx(1.0) and 0.65 < lo < 0.8
    lo, hi = wilson_interval(5, 10)
    assert lo < 0.5 < hi and abs((0.5 - lo) - (hi - 0.5)) < 1e-9


def test_summary_counts_agent_rollouts_and_errors_as_failures():
    from ratchet.types import Trajectory

    def t(i, **kw):
        base = dict(
            id=str(i),
            evolution="e",
            generation=0,
            task_id=f"s:x:test:{i % 2}",
            suite="s",
            subset="x",
            split="test",
            rollout=i,
            seed=0,
            policy_version="p",
        )
        return Trajectory(**(base | kw))

    rep = summarize(
        [t(0, success=True), t(1), t(2, status="error"), t(3, kind="expert", success=True)], "test"
    )
    assert (rep.n, rep.successes, rep.errors) == (3, 1, 1)  # an error counts as a failed rollout
    assert rep.by_task == {"s:x:test:0": 0.5, "s:x:test:1": 0.0}


@pytest.mark.integration
@pytest.mark.parametrize(
    "suite",
    # CI plays the default suite; chain_sum's generation runs end to end in test_evolve
    ["textworld-express:coin", pytest.param("reasoning-gym:chain_sum", marks=pytest.mark.slow)],
)
def test_generation_flow_stores_tracks_and_resumes(embedded_server: str, tmp_path: Path, suite: str):
    traced = suite.startswith("reasoning-gym")  # trace every rollout of one suite (the cheap one)
    settings = load_settings(
        {
            "data_dir": tmp_path,
            "suite": suite,
            "splits.train": 1,
            "splits.test": 1,
            "explore.rollouts_per_task": 2,
            "max_steps": 3,
            "concurrency": 2,
            "trace_sample_rate": 1.0 if traced else 0.0,
            "diagnose.min_cluster": 1,  # every failure cluster yields a guardrail candidate,
            "distill.min_tasks": 1,  # though all its failures are of the one train task
        }
    )
    result = run_flow(generation_flow, settings, generation=0, base_url=embedded_server)

    store = open_store(settings.trajectories_db)
    everything = store.query(evolution="default", generation=0)
    trajs = [t for t in everything if t.kind == "agent"]
    assert sorted(t.split for t in trajs) == ["test", "train", "train"]
    experts = [t for t in everything if t.kind == "expert"]
    assert len(experts) == 1 and experts[0].success and experts[0].split == "train"  # both suites know one
    assert all(t.status == "finished" and 1 <= t.n_steps <= 3 for t in trajs), [t.error for t in trajs]
    assert all(s.tool_call is not None for t in trajs for s in t.steps if s.source == "model" and not s.error)
    assert all(t.policy_version == result.stages["explore"].policy_version for t in trajs)
    train = [t for t in trajs if t.split == "train"]
    assert train[0].seed != train[1].seed  # two different samples of the same task
    assert result.stages["explore"].report.n == 2 and result.stages["evaluate"].report.n == 1

    client = MlflowClient(settings.mlflow_uri)
    run = client.get_run(result.run_id)
    for key in (
        "train_success",
        "test_success",
        "test_success_ci_high",
        "train_mean_steps",
        "test_prompt_tokens",
        "explore_wall_seconds",
        "evaluate_wall_seconds",
    ):
        assert key in run.data.metrics, key
    assert run.data.metrics["test_success"] == float(result.stages["evaluate"].report.success_rate)
    assert run.data.params["policy_version"] == result.stages["explore"].policy_version
    assert run.data.params["suite"] == suite and run.data.params["experts_used"] == "True"
    # the number format the embedded server says it runs in (`model.dtype`)
    served = httpx.get(embedded_server.removesuffix("/v1") + "/health").json()["dtype"]
    assert run.data.params["model_dtype"] == served
    # diagnose: one diagnosis per failed train rollout; distill: its summary, candidates with provenance
    failed = {t.id for t in train if not t.success}
    assert {d.trajectory_id for d in store.diagnoses("default", 0)} == failed
    assert run.data.metrics["diagnose_failures"] == len(failed) == result.stages["diagnose"].failures
    assert "distill_procedure_candidates" in run.data.metrics
    for c in result.stages["distill"].candidates:
        assert c.skill.provenance and set(c.skill.provenance) <= {t.id for t in everything}
    if failed:  # the real teacher judged them and the distiller wrote (or drafted) a guardrail
        assert any(c.skill.kind == "guardrail" for c in result.stages["distill"].candidates), result.stages[
            "distill"
        ].dropped
        skills_dir = settings.skills_dir
        assert any(skills_dir.glob("*/SKILL.md"))
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["ratchet.kind"] == "evolution"
    folders = ("plots", "samples", "distill")
    artifacts = {f.path for d in folders for f in client.list_artifacts(result.run_id, d)}
    assert {
        "plots/explore_success_by_task.png",
        "plots/evaluate_success_by_task.png",
        "samples/explore_trajectories.jsonl",
        "distill/summary.json",
    } <= artifacts

    if traced:  # LangGraph spans reach MLflow through autolog
        import mlflow

        mlflow.flush_trace_async_logging()
        traces = client.search_traces(locations=[run.info.experiment_id], max_results=10)
        assert traces and any("model" in {s.name for s in t.data.spans} for t in traces)

    # Rerun: every rollout is already stored, so nothing is played again; same MLflow run.
    before = {t.id: t.created_at for t in everything}
    again = run_flow(generation_flow, settings, generation=0, base_url=embedded_server)
    assert again.run_id == result.run_id
    assert again.stages["explore"].report.skipped == 2 and again.stages["evaluate"].report.skipped == 1
    assert {t.id: t.created_at for t in store.query(evolution="default")} == before
    store.close()
