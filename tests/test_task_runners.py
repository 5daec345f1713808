"""Rollouts on a Dask or Ray cluster (2 worker processes) give the same trajectories as the
default threads; on Ray, a worker process killed mid-rollout loses and duplicates nothing.

The Ray tests need the ray extra (`pip install -e '.[ray]'`) and skip without it (before
their fixtures start servers)."""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ratchet.config import load_settings
from ratchet.errors import ConfigError
from ratchet.flows.launch import ray_temp_dir, run_flow, task_runner
from ratchet.flows.runtime import RuntimeRef
from ratchet.memory.trajectory_store import open_store


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


needs_ray = pytest.mark.skipif(_missing("prefect_ray"), reason="the ray extra is not installed")


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


@pytest.fixture(scope="module")
def float32_server(base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The embedded server in float32, for comparing runners trajectory for trajectory. The
    session's server runs bf16 where the CPU multiplies it natively, and there a sample can
    depend on which other requests share its batch (server/engine.py says so): threads and
    worker processes never batch alike, and on such a CPU 1-2 of these 12 trajectories
    differed between threads and Dask or Ray, and between two runs on threads."""
    from ratchet.server.launcher import EmbeddedServer

    with EmbeddedServer(base_model_dir.parent, tmp_path_factory.mktemp("f32"), dtype="float32") as url:
        yield url


@pytest.fixture
def prefect_api(prefect_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The test's Prefect server, for this process's flows and client and for worker
    processes. Prefect read PREFECT_API_URL when it was imported: set now, the variable only
    reaches processes started later, and the flows here would run on the ephemeral API."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = prefect_server["PREFECT_API_URL"]
    monkeypatch.setenv("PREFECT_API_URL", url)
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield url
        # Logs and events still queued for this server go before it stops (Prefect's own test
        # harness does the same): left queued, they hold the process at exit, for good.
        APILogWorker.drain_all(timeout=60)
        EventsWorker.drain_all(timeout=60)


@pytest.fixture
def ray_env() -> Iterator[None]:
    """No Ray variables of the caller's, and this process's environment put back after the
    test: the Ray runner sets Ray's variables in it (launch.py:ray_environment), and the
    settings' defaults."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("RAY_")]:
        del os.environ[key]
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


def _ray_processes(temp: Path) -> list[Any]:
    """This process's children that belong to a Ray cluster (its servers name the temp dir
    in their command lines; its workers are `ray::...`)."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if str(temp) in cmd or cmd.startswith("ray::") or "/site-packages/ray/" in cmd:
            found.append(p)
    return found


def _ray_is_gone(temp: Path) -> None:
    """The flow's cluster was shut down with it (its processes gone within seconds) and kept
    its sessions in `temp`."""
    import ray

    assert not ray.is_initialized()
    deadline = time.monotonic() + 30
    while _ray_processes(temp) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ray_processes(temp)
    assert (temp / "session_latest" / "logs").is_dir()


@pytest.mark.integration
@pytest.mark.slow  # an optional task runner; a Dask cluster costs ~45 s to start and play on
def test_explore_on_dask_with_two_workers_matches_threads(
    float32_server: str, prefect_api: str, tmp_path: Path
) -> None:
    """Dask's worker processes reach the flow's Prefect server; both runs use the same one."""
    from ratchet.flows.explore import explore

    results = {}
    for runner in ("threads", "dask"):
        settings = _settings(tmp_path / runner, runner)
        result = run_flow(explore, settings, generation=0, base_url=float32_server)
        assert result.report.n == 12 and result.report.errors == 0
        results[runner] = _played(tmp_path / runner)
    assert len(results["dask"]) == 12
    assert results["dask"] == results["threads"]


@needs_ray
@pytest.mark.integration
@pytest.mark.slow  # an optional task runner, not installed by install.sh; Ray costs ~1 min here
def test_explore_on_ray_with_two_workers_matches_threads(
    float32_server: str, prefect_api: str, tmp_path: Path, ray_env: None
) -> None:
    """Ray's worker processes reach the flow's Prefect server and the same trajectory store;
    the cluster lives as long as the flow and keeps its files where the runner said."""
    from ratchet.flows.explore import explore

    results = {}
    temp = ray_temp_dir(_settings(tmp_path / "ray", "ray"))
    try:
        for runner in ("threads", "ray"):
            settings = _settings(tmp_path / runner, runner)
            result = run_flow(explore, settings, generation=0, base_url=float32_server)
            assert result.report.n == 12 and result.report.errors == 0
            results[runner] = _played(tmp_path / runner)
        _ray_is_gone(temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert len(results["ray"]) == 12
    assert results["ray"] == results["threads"]


def _rollout_killing_its_worker(markers: Path) -> Any:
    """A rollout task like `rollouts.rollout_task`, except that in the first process to claim
    marker `mid-play` the process dies (SIGKILL) while its first model request is in flight,
    and in the first to claim `stored` it dies after the trajectory was stored, before Prefect
    hears of it. A closure: Ray ships it by value to worker processes that cannot import
    this module. It writes the dead process's pid and slot to the marker."""
    from prefect import task

    from ratchet.flows import rollouts

    def play(ref: Any, slot: Any, policy: Any, settings: Any, trace: Any = None) -> str:
        import os
        import signal
        import threading

        import httpx

        from ratchet.flows import rollouts

        def claim(name: str) -> bool:
            try:
                fd = os.open(markers / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return False
            os.write(fd, f"{os.getpid()} {slot.id}".encode())
            os.close(fd)
            return True

        def die() -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        if claim("mid-play"):
            send = httpx.Client.send

            def send_then_die(self: Any, request: Any, **kwargs: Any) -> Any:
                if request.url.path.endswith("/chat/completions"):
                    threading.Timer(0.1, die).start()
                return send(self, request, **kwargs)

            httpx.Client.send = send_then_die  # this process dies: nothing to restore
        elif claim("stored"):
            rollouts.rollout_task.fn(ref, slot, policy, settings, trace)
            die()
        return rollouts.rollout_task.fn(ref, slot, policy, settings, trace)

    return task(
        name="rollout", task_run_name="rollout {slot.task.id} #{slot.rollout}", **rollouts.MODEL_CALL
    )(play)


@needs_ray
@pytest.mark.integration
@pytest.mark.slow  # as above, and threads, Ray and a rerun
def test_a_ray_worker_killed_mid_rollout_loses_and_duplicates_nothing(
    float32_server: str,
    prefect_api: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    ray_env: None,
) -> None:
    """Two of Ray's worker processes die (SIGKILL, as the OOM killer does): one mid-rollout,
    one after storing its trajectory. Ray runs both rollouts again in a new worker under the
    same Prefect task run (`RAY_TASK_RETRIES`); the store ends with each slot's trajectory
    once, the same as on threads, and a rerun of the flow finds nothing left to play."""
    import psutil
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect_ray import RayTaskRunner
    from prefect_ray.context import RemoteOptionsContext

    from ratchet.flows import rollouts
    from ratchet.flows.explore import explore

    threads = _settings(tmp_path / "threads", "threads")
    assert run_flow(explore, threads, generation=0, base_url=float32_server).report.errors == 0
    expected = _played(tmp_path / "threads")

    markers = tmp_path / "markers"
    markers.mkdir()
    original = rollouts.rollout_task
    monkeypatch.setattr(rollouts, "rollout_task", _rollout_killing_its_worker(markers))
    options = []  # what Ray is told for each rollout task, as the runner submits it
    submit = RayTaskRunner.submit

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        options.append(RemoteOptionsContext.get().current_remote_options)
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(RayTaskRunner, "submit", spy)
    settings = _settings(tmp_path / "ray", "ray")
    temp = ray_temp_dir(settings)
    try:
        state = run_flow(explore, settings, generation=0, base_url=float32_server, return_state=True)
        _ray_is_gone(temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    result = state.result()
    assert options and all(o.get("max_retries", 0) >= 1 for o in options)

    killed = {}
    for name in ("mid-play", "stored"):
        pid, slot_id = (markers / name).read_text().split()
        killed[name] = slot_id
        assert not psutil.pid_exists(int(pid)), f"the {name} worker was not killed"
    assert killed["mid-play"] != killed["stored"]

    assert result.report.n == 12 and result.report.errors == 0
    played = _played(tmp_path / "ray")
    assert sorted(played) == sorted(result.slot_ids) == sorted(expected)  # no slot lost, none added
    assert played == expected  # the replayed slots as well
    store = open_store(tmp_path / "ray" / "trajectories.db")
    try:
        assert store.count(kind="agent") == 12  # each once
    finally:
        store.close()

    # Prefect saw each rollout as one task run, completed: a replay reused the dead one's run.
    # Task runs reach the server as events, recorded a moment later.
    flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=flow_run)
            seen = sorted((r.name, r.state.type.value if r.state else "") for r in runs)
            rollout_runs = [(n, st) for n, st in seen if n.startswith("rollout ")]
            if len(rollout_runs) >= 12 and {st for _, st in rollout_runs} == {"COMPLETED"}:
                break
            if time.monotonic() > deadline:
                everything = [(r.name, str(r.flow_run_id)) for r in client.read_task_runs(limit=50)]
                pytest.fail(f"flow run {flow_run.id}: {seen}; all task runs: {everything}")
            time.sleep(1)
    assert len(rollout_runs) == 12 and len({n for n, _ in rollout_runs}) == 12

    # a rerun of the same flow on the same store (a new cluster in this process) has nothing left to play
    monkeypatch.setattr(rollouts, "rollout_task", original)
    try:
        rerun = run_flow(explore, settings, generation=0, base_url=float32_server)
        _ray_is_gone(temp)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert rerun.report.skipped == 12 and rerun.report.n == 12 and _played(tmp_path / "ray") == expected


def test_only_rollout_flows_leave_threads(tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    settings = _settings(tmp_path, "dask")
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        assert isinstance(task_runner(settings, "explore"), DaskTaskRunner)
        assert isinstance(task_runner(settings, "verify"), DaskTaskRunner)
        assert isinstance(task_runner(settings, "diagnose"), ThreadPoolTaskRunner)
        assert isinstance(task_runner(_settings(tmp_path, "threads"), "explore"), ThreadPoolTaskRunner)


def test_a_missing_extra_or_server_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        monkeypatch.delenv("PREFECT_API_URL", raising=False)
        with pytest.raises(ConfigError, match="needs a Prefect server its worker processes can reach"):
            task_runner(_settings(tmp_path, "dask"), "explore")
        # set after Prefect was imported: worker processes would see it, this process's flows not
        monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
        with pytest.raises(ConfigError, match="needs a Prefect server its worker processes can reach"):
            task_runner(_settings(tmp_path, "dask"), "explore")

    monkeypatch.setitem(sys.modules, "prefect_ray", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r"needs the ray extra.*pip install -e '\.\[ray\]'"):
        task_runner(_settings(tmp_path, "ray"), "explore")


@needs_ray
def test_ray_runs_on_this_machine_only_and_keeps_its_files_in_the_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_env: None
) -> None:
    """What `ray.init` is given, without starting a cluster."""
    import tempfile

    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_ray import RayTaskRunner

    from ratchet.flows.launch import RAY_TEMP_DIR_MAX

    monkeypatch.setenv("PREFECT_API_KEY", "not-for-ray")
    short = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    try:
        with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4321/api"}):
            runner = task_runner(_settings(short, "ray"), "evaluate")
            deep = task_runner(_settings(tmp_path / ("deep" * 20), "ray"), "explore").init_kwargs
    finally:
        shutil.rmtree(short)
    assert isinstance(runner, RayTaskRunner)
    init = runner.init_kwargs
    assert init["num_cpus"] == 2 and init["include_dashboard"] is False
    assert init["_temp_dir"] == str(short.resolve() / "ray")  # under the data dir where it fits
    # the sockets' paths would not fit under a deep data dir: a short folder of the temp dir
    assert len(deep["_temp_dir"]) <= RAY_TEMP_DIR_MAX and deep["_temp_dir"].startswith(tempfile.gettempdir())
    env = init["runtime_env"]["env_vars"]
    assert env["PREFECT_API_URL"] == "http://127.0.0.1:4321/api"  # the flow's server, for the workers
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert "PREFECT_API_KEY" not in env and not any(k.startswith("RAY_") for k in env)
    # loopback only, no usage stats, a token of this process (nothing written to ~/.ray)
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) == 64


def test_a_runtime_ref_pickles_and_finds_its_runtime_in_process(tmp_path: Path) -> None:
    from ratchet.flows.runtime import LoopRuntime

    settings = _settings(tmp_path, "dask")
    rt = LoopRuntime(settings, suite=None, store=None, base_url="http://x", actor=None)  # type: ignore[arg-type]
    ref = rt.ref()
    assert ref.resolve() is rt
    again = pickle.loads(pickle.dumps(ref))
    assert isinstance(again, RuntimeRef) and again.settings == settings and again.resolve() is rt
