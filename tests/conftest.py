"""Shared fixtures. Unit tests may not reach a real model: only tests marked `integration` can."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ratchet.runtime_env import PREFECT_STARTUP_TIMEOUT_S, offline_environment

ROOT = Path(__file__).resolve().parents[1]
# The HF copy of the shipped model is converted once and reused across test sessions.
PREFECT = Path(sys.executable).parent / "prefect"
TEST_MODELS = Path(os.environ.get("RATCHET_TEST_MODELS_DIR", ROOT / ".ratchet" / "test-models"))

offline_environment()  # the product's own list: no telemetry, no hub, no catalog download
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# Prefect's ephemeral API keeps its database here; reusing it makes later sessions start faster.
# One per xdist worker, so two ephemeral servers never migrate and write one SQLite file at once.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ.setdefault("PREFECT_HOME", str(ROOT / ".ratchet" / "test-prefect" / WORKER))
Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
# On n workers, each worker's torch (its in-process training, its embedded server, the servers
# its CLI tests start) gets cores // n threads. Left at one thread per core, two OpenMP pools
# spin on the same two cores: tests/test_finetune.py takes 71 s serially, and one of its tests
# took 170 s beside the other worker.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    for var in ("OMP_NUM_THREADS", "RATCHET_SERVER_THREADS"):
        os.environ.setdefault(var, str(max(1, (os.cpu_count() or 1) // WORKERS)))
# Flows the tests call directly start Prefect's ephemeral API with Prefect's own 20 s limit to
# answer, which a busy machine misses (seen beside a LoRA training on 2 cores); the product
# sets its own (ratchet.runtime_env), and so do the tests.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(PREFECT_STARTUP_TIMEOUT_S))


@pytest.fixture(autouse=True)
def _config_file_does_not_leak(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`load_settings(config_file=...)` points the process at that file (an env var): undo it
    before and after each test, or later tests would read another test's ratchet.toml. After
    too: the next module's module-scoped fixtures are set up before this fixture runs again."""
    from ratchet.config import CONFIG_ENV

    monkeypatch.delenv(CONFIG_ENV, raising=False)
    yield
    os.environ.pop(CONFIG_ENV, None)


@pytest.fixture(autouse=True)
def _chroma_indexes_are_released() -> Any:
    """Chroma keeps every opened index's system (sqlite and HNSW files) for the process's
    life. A run opens a few; a test session opens hundreds of temporary ones, and past 1,023
    open descriptors `select()` (py4j's, for TextWorldExpress) fails. Stop the systems a
    test opened when it ends; those of longer-lived fixtures were opened before it began."""
    from chromadb.api.shared_system_client import SharedSystemClient

    before = set(SharedSystemClient._identifier_to_system)
    yield
    for key in set(SharedSystemClient._identifier_to_system) - before:
        system = SharedSystemClient._identifier_to_system.pop(key)
        SharedSystemClient._identifier_to_refcount.pop(key, None)
        try:
            system.stop()
        except Exception:  # noqa: BLE001 - a system that failed to start (a corrupt index) holds nothing
            pass


@pytest.fixture(autouse=True)
def _autolog_is_turned_off_again() -> Any:
    """A stage turns LangGraph autolog on for the process (`trace_sample_rate` > 0); turn it
    off after the test, or graphs later tests run outside any stage would be traced into the
    last test's MLflow store."""
    yield
    traces = sys.modules.get("ratchet.flows.traces")
    if traces is not None and traces.autolog_on():
        traces.disable_autolog()


@pytest.fixture(autouse=True)
def _no_real_model_in_unit_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("integration") or request.node.get_closest_marker("slow"):
        return  # a slow test is an end-to-end run on the real services

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("unit test reached the real model server: mark it @pytest.mark.integration")

    monkeypatch.setattr("ratchet.server.launcher.EmbeddedServer.start", refuse)


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One real embedded server (SmolLM2-135M) for the whole test session; yields its base URL."""
    from ratchet.server.launcher import EmbeddedServer

    server = EmbeddedServer(TEST_MODELS, tmp_path_factory.mktemp("server-logs"))
    url = server.start()
    yield url
    server.stop()


@pytest.fixture(scope="session")
def base_model_dir(embedded_server: str) -> Path:
    from ratchet.server.weights import BASE_MODEL_NAME

    return TEST_MODELS / BASE_MODEL_NAME


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def prefect_server(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A real `prefect server start` on a free port with its own database; yields the env to use it."""
    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-server"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
    }
    proc = subprocess.Popen(
        [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "prefect server exited"
            time.sleep(1)
        else:
            pytest.fail("prefect server did not answer /api/health within 120 s")
        yield env
    finally:
        stop_process_group(proc)
