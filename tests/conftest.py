"""Shared fixtures. Unit tests may not reach a real model: only tests marked `integration` can."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The HF copy of the shipped model is converted once and reused across test sessions.
TEST_MODELS = Path(os.environ.get("RATCHET_TEST_MODELS_DIR", ROOT / ".ratchet" / "test-models"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# Prefect's ephemeral API keeps its database here; reusing it makes later sessions start faster.
os.environ.setdefault("PREFECT_HOME", str(ROOT / ".ratchet" / "test-prefect"))
Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)


@pytest.fixture(autouse=True)
def _no_real_model_in_unit_tests(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("integration"):
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("unit test reached the real model server: mark it @pytest.mark.integration")

    monkeypatch.setattr("server.launcher.EmbeddedServer.start", refuse)


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One real embedded server (SmolLM2-135M) for the whole test session; yields its base URL."""
    from server.launcher import EmbeddedServer

    server = EmbeddedServer(TEST_MODELS, tmp_path_factory.mktemp("server-logs"))
    url = server.start()
    yield url
    server.stop()


@pytest.fixture(scope="session")
def base_model_dir(embedded_server: str) -> Path:
    from server.weights import BASE_MODEL_NAME

    return TEST_MODELS / BASE_MODEL_NAME
