"""Rollouts on a Dask cluster (2 worker processes) give the same trajectories as the default threads."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from ratchet.config import load_settings
from ratchet.errors import ConfigError
from ratchet.flows.launch import run_flow, task_runner
from ratchet.flows.runtime import RuntimeRef
from ratchet.memory.trajectory_store import open_store


def _settings(data: Path, runner: str) -> Any:
    return load_settings(
        {
            "data_dir": data,
            "suite": "reasoning-gym:chain_sum,basic_arithmetic",
            "splits.train": 3,
            "explore.rollouts_per_task": 2,
            "max_steps": 3,
            "concurrency": 4,
            "evolve.task_runner": runner,
            "evolve.workers": 2,
        }
    )


def _played(data: Path) -> dict[str, Any]:
    store = open_store(data / "trajectories.db")
    try:
        return {
            t.id: (t.success, t.status, [(s.tool_call.name, s.tool_call.args) if s.tool_call else s.message
                                         for s in t.steps])
            for t in store.query(kind="agent")
        }  # fmt: skip
    finally:
        store.close()


@pytest.mark.integration
@pytest.mark.slow  # an optional task runner; a Dask cluster costs ~45 s to start and play on
def test_explore_on_dask_with_two_workers_matches_threads(
    embedded_server: str, prefect_server: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dask's worker processes reach the flow's Prefect server; both runs use the same one."""
    from ratchet.flows.explore import explore

    monkeypatch.setenv("PREFECT_API_URL", prefect_server["PREFECT_API_URL"])

    results = {}
    for runner in ("threads", "dask"):
        settings = _settings(tmp_path / runner, runner)
        result = run_flow(explore, settings, generation=0, base_url=embedded_server)
        assert result.report.n == 12 and result.report.errors == 0
        results[runner] = _played(tmp_path / runner)
    assert len(results["dask"]) == 12
    assert results["dask"] == results["threads"]


def test_only_rollout_flows_leave_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")

    settings = _settings(tmp_path, "dask")
    assert isinstance(task_runner(settings, "explore"), DaskTaskRunner)
    assert isinstance(task_runner(settings, "verify"), DaskTaskRunner)
    assert isinstance(task_runner(settings, "diagnose"), ThreadPoolTaskRunner)
    assert isinstance(task_runner(_settings(tmp_path, "threads"), "explore"), ThreadPoolTaskRunner)


def test_a_missing_extra_or_server_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with pytest.raises(ConfigError, match="needs a Prefect server its worker processes can reach"):
        task_runner(_settings(tmp_path, "dask"), "explore")

    monkeypatch.setitem(sys.modules, "prefect_ray", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r"needs the ray extra.*pip install -e '\.\[ray\]'"):
        task_runner(_settings(tmp_path, "ray"), "explore")


def test_a_runtime_ref_pickles_and_finds_its_runtime_in_process(tmp_path: Path) -> None:
    from ratchet.flows.runtime import LoopRuntime

    settings = _settings(tmp_path, "dask")
    rt = LoopRuntime(settings, suite=None, store=None, base_url="http://x", actor=None)  # type: ignore[arg-type]
    ref = rt.ref()
    assert ref.resolve() is rt
    again = pickle.loads(pickle.dumps(ref))
    assert isinstance(again, RuntimeRef) and again.settings == settings and again.resolve() is rt
