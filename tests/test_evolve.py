"""`evolve`: the loop end to end on the real server, and resuming after a SIGKILL at each fault point.

Every run here shares the session's embedded server (`model.endpoint`), plays reasoning-gym
chain_sum (fast) and fine-tunes on the suite's expert answers (the 135M model solves none
of these itself), so each generation goes through all six stages in a few minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from ratchet import faults
from ratchet.config import load_settings
from ratchet.dashboard.app import create_dashboard
from ratchet.errors import ConfigError, StateFileError
from ratchet.flows.evolve import evolve_flow
from ratchet.flows.journal import Journal
from ratchet.flows.loop import stages_of
from ratchet.memory.trajectory_store import open_store
from ratchet.server.launcher import admin_headers
from ratchet.skills.library import SkillLibrary
from ratchet.training.registry import AdapterRegistry
from tests.factories import local_client

ROOT = Path(__file__).resolve().parents[1]
RATCHET = Path(sys.executable).parent / "ratchet"

CONFIG = """
suite = "reasoning-gym:chain_sum"
concurrency = 4
max_steps = 3
[splits]
train = 3
dev = 5
test = 3
[explore]
rollouts_per_task = 2
experts = true
[finetune]
mode = "lora"
experts = true
min_new_successes = 1
wait_for_champion = false  # the adapter's fault points need a training in generation 1 either way
[finetune.lora]
epochs = 1
max_tokens = 512
"""


@pytest.fixture
def data(tmp_path: Path, embedded_server: str, base_model_dir: Path) -> Any:
    """A data dir whose settings point at the shared server; unloads adapters the runs loaded."""
    (tmp_path / "ratchet.toml").write_text(CONFIG + f'[model]\nendpoint = "{embedded_server}"\n')
    (tmp_path / "models").symlink_to(base_model_dir.parent)  # the converted base model, shared
    before = {m["id"] for m in httpx.get(f"{embedded_server}/models").json()["data"]}
    yield tmp_path
    for m in httpx.get(f"{embedded_server}/models").json()["data"]:
        if m["id"] not in before:
            headers = admin_headers(embedded_server)  # the server's admin routes need its token
            httpx.post(f"{embedded_server}/unload_lora_adapter", json={"lora_name": m["id"]}, headers=headers)


def _settings(data: Path) -> Any:
    return load_settings({"data_dir": data}, config_file=data / "ratchet.toml")


def _evolve(data: Path, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    """`ratchet evolve -n 1` in a fresh process, as a person or a schedule runs it."""
    env = {k: v for k, v in os.environ.items() if k != faults.FAULT_ENV}
    if fault:
        env[faults.FAULT_ENV] = fault
    cmd = [str(RATCHET), "--config", str(data / "ratchet.toml"), "--data-dir", str(data), "evolve", "-n", "1"]
    # files, not pipes: a killed run's orphans (Prefect's ephemeral API server) would hold a pipe open
    with open(data / "out.txt", "w+") as out, open(data / "err.txt", "w+") as errs:
        proc = subprocess.Popen(cmd, env=env, cwd=data, stdout=out, stderr=errs, start_new_session=True)
        try:
            proc.wait(timeout=1800)
        finally:  # a SIGKILL leaves the process group's children behind: reap them
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0)
        errs.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), errs.read())


def _state(data: Path) -> dict[str, Any]:
    """Everything a resumed run must not lose or duplicate."""
    s = _settings(data)
    store = open_store(s.trajectories_db)
    try:
        trajs = store.summaries()
    finally:
        store.close()
    library = SkillLibrary(s.skills_dir, s.index_dir)
    registry = AdapterRegistry(s)
    versions = registry.list()
    return {
        "trajectories": Counter((t.generation, t.split, t.status) for t in trajs),
        "per_split": Counter((t.generation, t.split, t.kind) for t in trajs),
        "journal": [(r.generation, r.stage) for r in Journal.load(s).records],
        "skills": sorted((k.content_hash, k.status) for k in library.list()),
        "audit": Counter((r.name, r.to_status) for r in library.history()),
        "adapters": sorted((v.dataset, v.config) for v in versions),
        "champion": registry.champion(),
        "registry": registry,
    }


def _check_consistent(state: dict[str, Any]) -> None:
    assert all(status == "finished" for (_, _, status) in state["trajectories"])
    split = state["per_split"]  # every slot played exactly once (ids are slots: a repeat would overwrite)
    assert (split[0, "test", "agent"], split[1, "test", "agent"]) == (3, 3)
    assert (split[1, "train", "agent"], split[1, "train", "expert"]) == (6, 3)
    assert state["journal"] == [(g, st) for g in (0, 1) for st in stages_of(g)]  # each stage once, in order
    assert all(n == 1 for n in state["audit"].values()), state["audit"]  # no status change recorded twice
    assert len(state["skills"]) == len({h for h, _ in state["skills"]})  # no candidate filed twice
    assert len(state["adapters"]) == len(set(state["adapters"]))  # no adapter registered twice
    if state["champion"] is not None:  # the alias points at a complete, hash-checked version
        state["registry"].checked_path(state["champion"])


@pytest.mark.integration
def test_evolve_runs_every_stage_and_a_rerun_changes_nothing(data: Path, embedded_server: str) -> None:
    settings = _settings(data)
    journal = evolve_flow(settings=settings, generations=1, base_url=embedded_server)
    rows = journal.rows()
    assert [r.generation for r in rows] == [0, 1]
    assert rows[0].stages == ["evaluate"] and rows[1].stages == list(stages_of(1))
    assert rows[0].test_n == rows[1].test_n == 3 and rows[1].explore_success is not None
    assert rows[1].adapter  # the finetune stage trained (or skipped) and said so
    first = _state(data)
    _check_consistent(first)
    again = evolve_flow(settings=settings, generations=1, base_url=embedded_server)
    assert [(r.generation, r.stage) for r in again.records] == first["journal"]
    second = _state(data)
    for key in ("trajectories", "journal", "skills", "audit", "adapters"):
        assert second[key] == first[key], key
    # MLflow: one run per generation under the evolution's parent run
    import mlflow

    mlflow.set_tracking_uri(settings.mlflow_uri)
    runs = mlflow.search_runs(experiment_names=[f"ratchet-{settings.evolution}"], output_format="list")
    by_gen = {r.data.tags["ratchet.generation"]: r for r in runs if r.data.tags.get("ratchet.generation")}
    assert sorted(by_gen) == ["0", "1"]
    client = mlflow.MlflowClient()
    plots = {a.path for a in client.list_artifacts(by_gen["1"].info.run_id, "plots")}
    assert {"plots/success_curve.png", "plots/evaluate_success_by_task.png"} <= plots
    if rows[1].candidates:
        assert "plots/verify_gate_outcomes.png" in plots
    assert "plots/diagnose_failure_modes.png" in plots  # the 135M model fails some chain_sum tasks
    parent = next(r for r in runs if r.data.tags.get("ratchet.kind") == "evolution")
    assert "plots/success_curve.png" in {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    # the dashboard shows this evolution: a row per generation, linked to its MLflow run and flow runs
    flow_runs = [r.flow_run_id for r in journal.records]
    assert all(flow_runs) and len(set(flow_runs)) == len(flow_runs)
    html = local_client(create_dashboard(settings)).get("/").text
    for gen, run in by_gen.items():
        assert f'<tr data-generation="{gen}">' in html and f"/runs/{run.info.run_id}" in html
    assert all(f"/runs/flow-run/{f}" in html for f in flow_runs)


def test_a_bad_setting_fails_before_anything_is_written(tmp_path: Path) -> None:
    from ratchet.flows.evolve import check_settings

    settings = load_settings({"data_dir": tmp_path, "suite": "reasoning-gym:chain_sum", "splits.dev": 3})
    with pytest.raises(ConfigError, match="set splits.dev to at least 5"):
        check_settings(settings)
    assert not settings.evolve_journal.exists()


def test_an_unreadable_journal_is_one_clear_error(tmp_path: Path) -> None:
    settings = load_settings({"data_dir": tmp_path})
    settings.evolve_journal.parent.mkdir(parents=True)
    settings.evolve_journal.write_text('{"stages": [{"generation": 0}]}')
    with pytest.raises(StateFileError, match="unreadable"):
        Journal.load(settings)


def test_an_unknown_fault_point_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.FAULT_ENV, "nowhere")
    with pytest.raises(ValueError, match="unknown fault point"):
        faults.armed()
    with pytest.raises(ValueError, match="add it to ratchet.faults.POINTS"):
        faults.point("not-a-point")


def _kill_and_resume(data: Path, fault: str) -> None:
    killed = _evolve(data, fault)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    resumed = _evolve(data)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "gen" in resumed.stdout and "journal:" in resumed.stdout
    _check_consistent(_state(data))


@pytest.mark.integration
@pytest.mark.slow  # two `ratchet evolve` processes; CI resumes in process (test_flows, test_finetune)
def test_a_kill_mid_explore_resumes_without_losing_or_repeating_rollouts(data: Path) -> None:
    _kill_and_resume(data, "rollout.stored:8")  # generation 0's 3 test rollouts, then 5 of explore's 6


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(
    "fault",
    [
        "stage.started:2",  # generation 1's explore, nothing done yet
        "stage.finished:1",  # generation 0's evaluate done, not in the journal
        "diagnosis.stored:2",
        "skill.added:1",
        "skill.filing:1",  # a candidate's record written, its folder not in place
        "skill.recorded:1",  # a verdict's record written, its SKILL.md not rewritten
        "skill.transition:1",  # a candidate just verified or rejected
        "adapter.trained:1",
        "adapter.created:1",  # an MLflow model version created, not filed in the lifecycle
        "adapter.registered:1",
        "adapter.recorded:1",  # a verdict's record written, the MLflow tags and alias not
        "adapter.decided:1",
        "stage.finished:7",  # generation 1's evaluate done, not in the journal
    ],
)
def test_a_kill_at_any_fault_point_resumes_cleanly(data: Path, fault: str) -> None:
    _kill_and_resume(data, fault)


def test_fault_points_are_all_exercised_by_the_slow_test() -> None:
    """A new fault point must get a kill test too."""
    src = Path(__file__).read_text()
    assert all(f'"{name}:' in src for name in faults.POINTS)


def test_journal_file_is_never_torn(tmp_path: Path) -> None:
    settings = load_settings({"data_dir": tmp_path})
    journal = Journal.load(settings)
    journal.record(0, "evaluate", {"n": 1, "successes": 1, "ci95": [0.2, 1.0], "policy_version": "p"}, 1.0)
    raw = json.loads(settings.evolve_journal.read_text())
    assert raw["stages"][0]["stage"] == "evaluate"
    assert not list(settings.evolve_journal.parent.glob(".*.tmp"))
    assert Journal.load(settings).rows()[0].test_success == 1.0
