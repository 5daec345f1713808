"""`ratchet deploy` against a real local Prefect server: the schedule is registered, a run executes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

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
        deployment = None
        deadline = time.monotonic() + 120
        while deployment is None and time.monotonic() < deadline:
            assert serving.poll() is None, serving.stdout.read() if serving.stdout else ""
            r = httpx.get(f"{api}/deployments/name/evolve/nightly", timeout=5)
            deployment = r.json() if r.status_code == 200 else None
            time.sleep(1)
        assert deployment is not None, "evolve/nightly was never registered"
        (schedule,) = deployment["schedules"]
        assert schedule["schedule"]["cron"] == "0 2 * * *" and schedule["active"]
        assert deployment["parameters"]["overrides"]["data_dir"] == str(data.resolve())
        promote = httpx.get(f"{api}/deployments/name/promote/promote", timeout=5)
        assert promote.status_code == 200

        # run it once now (generation 0 only: the baseline evaluation), as the schedule would
        created = httpx.post(
            f"{api}/deployments/{deployment['id']}/create_flow_run",
            json={"parameters": {"generations": 0}},
            timeout=10,
        ).json()
        state = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            state = httpx.get(f"{api}/flow_runs/{created['id']}", timeout=5).json()["state"]["type"]
            if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            time.sleep(2)
        assert state == "COMPLETED", state
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
    api = prefect_server["PREFECT_API_URL"]
    nightly = httpx.get(f"{api}/deployments/name/evolve/nightly", timeout=5).json()
    assert nightly["work_pool_name"] == "ratchet" and nightly["entrypoint"] == "flows/evolve.py:evolve_flow"
    assert nightly["schedules"][0]["schedule"]["cron"] == "0 2 * * *"
    assert nightly["parameters"] == {"config": str(tmp_path / "ratchet.toml")}
    promote = httpx.get(f"{api}/deployments/name/promote/promote", timeout=5).json()
    assert promote["entrypoint"] == "flows/promote.py:promote_flow" and not promote["schedules"]


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
    assert not promote.schedules and promote.flow_name == "promote"
    (other,) = build(None, {}, cron="5 4 * * *")[0].schedules
    assert other.schedule.cron == "5 4 * * *"
