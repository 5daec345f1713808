"""`ratchet deploy` against a real local Prefect server: the schedule is registered, a run executes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.conftest import stop_process_group

ROOT = Path(__file__).resolve().parents[1]
RATCHET = Path(sys.executable).parent / "ratchet"


@pytest.mark.integration
def test_deploy_registers_the_nightly_schedule_and_a_run_executes(
    prefect_server: dict[str, str], embedded_server: str, base_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "models").symlink_to(base_model_dir.parent)
    config = tmp_path / "ratchet.toml"
    config.write_text(
        'suite = "reasoning-gym:chain_sum"\nmax_steps = 2\n[splits]\ntest = 2\ndev = 5\n'
        f'[model]\nendpoint = "{embedded_server}"\n'
    )
    env = {**prefect_server, "PREFECT_LOGGING_LEVEL": "WARNING"}
    serving = subprocess.Popen(
        [str(RATCHET), "--config", str(config), "--data-dir", str(data), "deploy"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    api = prefect_server["PREFECT_API_URL"]
    try:
        # Prefect's own client, not bare HTTP: on a loaded machine the server's SQLite is often
        # locked for a moment and the API answers 503, which the client retries with backoff.
        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            # `serve` registers the two one after the other: wait for both
            found: dict[str, Any] = {}
            deadline = time.monotonic() + 120
            while len(found) < 2 and time.monotonic() < deadline:
                assert serving.poll() is None, serving.stdout.read() if serving.stdout else ""
                for name in {"evolve/nightly", "promote/promote"} - found.keys():
                    try:
                        found[name] = client.read_deployment_by_name(name)
                    except ObjectNotFound:
                        time.sleep(1)
            assert sorted(found) == ["evolve/nightly", "promote/promote"], f"registered only {sorted(found)}"
            deployment = found["evolve/nightly"]
            (schedule,) = deployment.schedules
            assert schedule.schedule.cron == "0 2 * * *" and schedule.active
            assert deployment.parameters["overrides"]["data_dir"] == str(data.resolve())
            assert deployment.parameters["extend"] is True
            assert not found["promote/promote"].schedules

            # run it once now (generation 0 only: the baseline evaluation), as the schedule would
            created = client.create_flow_run_from_deployment(deployment.id, parameters={"generations": 0})
            state = None
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                state = client.read_flow_run(created.id).state
                if state is not None and state.is_final():
                    break
                time.sleep(2)
            assert state is not None and state.is_completed(), state
            journal = json.loads((data / "evolutions" / "default.json").read_text())
            assert [(s["generation"], s["stage"]) for s in journal["stages"]] == [(0, "evaluate")]
            assert journal["stages"][0]["summary"]["n"] == 2
    finally:
        stop_process_group(serving)


def test_deploy_without_a_prefect_server_is_one_clear_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    out = subprocess.run(
        [str(RATCHET), "--data-dir", str(tmp_path), "deploy"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "PREFECT_API_URL is not set" in out.stderr and "prefect server start" in out.stderr
    assert len(out.stderr.strip().splitlines()) <= 2


@pytest.mark.integration
@pytest.mark.slow  # in CI: the file's content is checked against what `ratchet deploy` builds (below)
def test_prefect_yaml_deploys_to_a_work_pool(prefect_server: dict[str, str], tmp_path: Path) -> None:
    """The work-pool path: `prefect deploy` of deployments/prefect.yaml registers both, with the cron."""
    env = {**prefect_server, "RATCHET_HOME": str(ROOT), "RATCHET_CONFIG": str(tmp_path / "ratchet.toml")}
    prefect = str(Path(sys.executable).parent / "prefect")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [prefect, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )

    assert run("work-pool", "create", "ratchet", "--type", "process").returncode == 0
    out = run("--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--all")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    with temporary_settings(updates={PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as client:
            nightly = client.read_deployment_by_name("evolve/nightly")
            promote = client.read_deployment_by_name("promote/promote")
    assert nightly.work_pool_name == "ratchet" and nightly.entrypoint == "flows/evolve.py:evolve_flow"
    assert nightly.schedules[0].schedule.cron == "0 2 * * *"
    assert nightly.parameters == {"config": str(tmp_path / "ratchet.toml")}
    assert promote.entrypoint == "flows/promote.py:promote_flow" and not promote.schedules


def test_the_deployments_are_declared_once_in_prefect_yaml() -> None:
    """`ratchet deploy` builds what deployments/prefect.yaml declares: the same names,
    entrypoints and schedule; a --cron replaces only the schedule."""
    import yaml

    from ratchet.flows.schedule import build

    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())["deployments"]
    built = build(None, {})
    assert [d.name for d in built] == [d["name"] for d in spec] == ["nightly", "promote"]
    assert [d.entrypoint.split(":")[-1] for d in built] == [d["entrypoint"].split(":")[-1] for d in spec]
    nightly, promote = built
    assert nightly.schedules[0].schedule.cron == spec[0]["schedules"][0]["cron"]
    assert nightly.parameters["extend"] is True and "extend" not in promote.parameters  # each night goes on
    assert not promote.schedules and promote.flow_name == "promote"
    (other,) = build(None, {}, cron="5 4 * * *")[0].schedules
    assert other.schedule.cron == "5 4 * * *"


def test_each_scheduled_run_goes_further_and_a_killed_night_is_resumed_first(tmp_path: Path) -> None:
    """`extend`: the first night plays the baseline and N generations, each later night N more;
    a generation a kill cut short is finished within the next night's N, not skipped."""
    from ratchet.config import load_settings
    from ratchet.flows.evolve import last_generation
    from ratchet.flows.journal import Journal, StageRecord
    from ratchet.flows.loop import stages_of

    settings = load_settings({"data_dir": tmp_path, "evolve.generations": 2})
    journal = Journal(tmp_path / "j.json", "default")

    def play(generation: int, stages: tuple[str, ...] | None = None) -> None:
        for stage in stages if stages is not None else stages_of(generation, settings):
            journal.records.append(StageRecord(generation, stage, {}, 1.0, "now"))

    assert last_generation(journal, settings, None, extend=True) == 2  # a first night: 0, 1, 2
    play(0)
    assert last_generation(journal, settings, None, extend=True) == 2  # only the baseline was done
    play(1)
    play(2)
    assert journal.finished_through(settings) == 2
    assert last_generation(journal, settings, None, extend=True) == 4  # the next night: 3 and 4
    assert last_generation(journal, settings, None, extend=False) == 2  # `ratchet evolve`: 0..N, done
    play(3, ("explore", "diagnose"))  # a night killed in generation 3
    assert journal.finished_through(settings) == 2
    assert last_generation(journal, settings, 1, extend=True) == 3  # generation 3 is finished first
