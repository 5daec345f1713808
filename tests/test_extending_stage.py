"""The worked example of docs/extending.md, "Adding a stage": a toy stage `count` (how many
trajectories its generation has stored), added to the loop by one line, run by the loop's
runners (`generation_flow`, `evolve_flow`, `ratchet run --stage count`) with no other change.

It needs no model: the runners' model endpoint is replaced by a URL nothing reads."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from prefect import flow

from ratchet.config import Settings, load_settings
from ratchet.flows import evolve, loop
from ratchet.flows.journal import Journal
from ratchet.flows.stage import Stage
from ratchet.memory.trajectory_store import open_store
from ratchet.types import Trajectory

if TYPE_CHECKING:
    from rich.console import Console


# ---- the stage: one module (here, this test module) --------------------------------------
@dataclass
class CountResult:
    generation: int
    trajectories: int
    successes: int

    def summary(self) -> dict[str, Any]:  # what the journal records
        return {"trajectories": self.trajectories, "successes": self.successes}

    def render(self, console: Console, settings: Settings, run_id: str | None = None) -> None:
        console.print(f"generation {self.generation}: {self.trajectories} trajectories, {self.successes} won")


@flow(name="count", validate_parameters=False)
def count_flow(settings: Settings, generation: int = 0, base_url: str | None = None) -> CountResult:
    store = open_store(settings.trajectories_db)
    try:
        where = {"evolution": settings.evolution, "generation": generation}
        return CountResult(generation, store.count(**where), store.count(**where, success=True))
    finally:
        store.close()


# ---- ... and one line in the loop's list (`ratchet.flows.loop.LOOP`) ------------------------
COUNT = Stage("count", f"{__name__}:count_flow", in_run=True, baseline=True)


@contextlib.contextmanager
def _no_model(settings: Settings, base_url: str | None = None) -> Iterator[str]:
    yield "http://127.0.0.1:9/v1"  # the count stage never calls it


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    s = load_settings({"data_dir": tmp_path / "data", "suite": "reasoning-gym:chain_sum", "evolution": "e"})
    s.data_dir.mkdir()
    store = open_store(s.trajectories_db)
    for i, won in enumerate([True, False, True]):  # three rollouts of generation 0
        task = f"reasoning-gym:chain_sum:train:{i}"
        store.put(
            Trajectory(
                id=f"t{i}",
                evolution="e",
                generation=0,
                task_id=task,
                suite="reasoning-gym",
                subset="chain_sum",
                split="train",
                rollout=0,
                seed=0,
                policy_version="p",
                success=won,
            )
        )
    store.close()
    monkeypatch.setattr(evolve, "model_endpoint", _no_model)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", s.mlflow_uri)  # the CLI's defaults stay in this test
    return s


def test_generation_flow_runs_the_new_stage(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "LOOP", (*loop.LOOP, COUNT))
    assert loop.stage_names()[-1] == "count" and "count" in loop.run_stages()
    assert not loop.traced("count") and not loop.gated(["count"])
    result = evolve.generation_flow(settings, generation=0, stages=["count"])
    assert list(result.stages) == ["count"]
    assert result.stages["count"] == CountResult(0, 3, 2)


def test_the_journal_records_its_summary(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop, "LOOP", (COUNT,))  # a loop of this stage alone: no model anywhere
    journal = evolve.evolve_flow(settings=settings, generations=1)
    assert [(r.generation, r.stage, r.summary) for r in journal.records] == [
        (0, "count", {"trajectories": 3, "successes": 2}),
        (1, "count", {"trajectories": 0, "successes": 0}),
    ]
    rows = Journal.load(settings).rows()  # read back as the table and the pre-flight read it
    assert [r.stages for r in rows] == [["count"], ["count"]] and rows[0].flow_runs["count"]
    again = evolve.evolve_flow(settings=settings, generations=1)  # resumed: nothing left to run
    assert again.records == journal.records


def test_ratchet_run_selects_it_by_name(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from ratchet.cli.main import app

    monkeypatch.setattr(loop, "LOOP", (*loop.LOOP, COUNT))
    args = ["--data-dir", str(settings.data_dir), "--suite", settings.suite, "--evolution", "e", "run"]
    result = CliRunner().invoke(app, [*args, "--stage", "count"])
    assert result.exit_code == 0, result.output
    assert "generation 0: 3 trajectories, 2 won" in result.stdout
    refused = CliRunner().invoke(app, [*args, "--stage", "nope"])
    assert refused.exit_code == 2 and "count" in refused.stderr  # the choices name it
