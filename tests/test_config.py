"""Settings precedence (file < env < flags) and one-line errors for invalid values."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratchet.config import load_settings
from ratchet.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    for key in list(__import__("os").environ):
        if key.startswith("RATCHET_"):
            monkeypatch.delenv(key)


def test_defaults_use_the_embedded_server_and_keep_state_under_data_dir():
    s = load_settings()
    assert s.model.endpoint == "" and s.suite == "textworld-express:coin"
    assert s.explore.rollouts_per_task >= 2 and s.explore.temperature > 0
    assert s.evaluate.temperature == 0
    for path in (s.trajectories_db, s.models_dir, s.prefect_home, s.mlflow_artifacts):
        assert Path(path).resolve().is_relative_to(s.data_dir.resolve())
    assert s.mlflow_uri.startswith("sqlite:///") and s.mlflow_uri.endswith("mlflow.db")


def test_file_then_environment_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = tmp_path / "ratchet.toml"
    cfg.write_text(
        'suite = "reasoning-gym"\nconcurrency = 3\n[model]\nmax_tokens = 50\n[explore]\nepsilon = 0.3\n'
    )
    s = load_settings()
    assert (s.suite, s.concurrency, s.model.max_tokens, s.explore.epsilon) == ("reasoning-gym", 3, 50, 0.3)
    monkeypatch.setenv("RATCHET_CONCURRENCY", "2")
    monkeypatch.setenv("RATCHET_MODEL__ENDPOINT", "http://127.0.0.1:9/v1/")
    s = load_settings()
    assert s.concurrency == 2 and s.model.endpoint == "http://127.0.0.1:9/v1"
    assert s.model.max_tokens == 50  # nested file values survive a nested env override
    s = load_settings({"concurrency": 1, "explore.epsilon": None, "splits.train": 7})
    assert s.concurrency == 1 and s.explore.epsilon == 0.3 and s.splits.train == 7


def test_explicit_config_file_and_missing_file(tmp_path: Path):
    other = tmp_path / "other.toml"
    other.write_text("seed = 9\n")
    assert load_settings(config_file=other).seed == 9
    with pytest.raises(ConfigError, match="not found"):
        load_settings(config_file=tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ({"concurrency": 0}, "concurrency"),
        ({"model.endpoint": "localhost:8000"}, "model.endpoint"),
        ({"explore.temperature": 0}, "explore.temperature"),
        ({"evolution": "has space"}, "evolution"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_invalid_values_are_one_clear_line(overrides, where):
    with pytest.raises(ConfigError) as info:
        load_settings(overrides)
    msg = str(info.value)
    assert f"invalid setting {where}" in msg and "\n" not in msg


def test_malformed_toml_is_a_config_error(tmp_path: Path):
    (tmp_path / "ratchet.toml").write_text("suite = \n")
    with pytest.raises(ConfigError, match="cannot read settings"):
        load_settings()
