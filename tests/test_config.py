"""Settings precedence (file < env < flags) and one-line errors for invalid values."""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from ratchet.config import CONFIG_ENV, Settings, load_settings
from ratchet.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.upper().startswith("RATCHET_"):
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
    with pytest.raises(ConfigError, match="does not exist"):
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


# --- every numeric setting is finite and bounded -------------------------------------------


def numeric_fields(model: type[BaseModel] = Settings, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, int or float) for every numeric field of the settings tree."""
    found: list[tuple[str, type]] = []
    for name, field in model.model_fields.items():
        args = typing.get_args(field.annotation) or (field.annotation,)
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) == 1 and isinstance(kinds[0], type) and issubclass(kinds[0], BaseModel):
            found += numeric_fields(kinds[0], f"{prefix}{name}.")
        elif kinds and all(k in (int, float) for k in kinds) and bool not in kinds:
            found.append((f"{prefix}{name}", float if float in kinds else int))
    return found


FLOATS = [k for k, t in numeric_fields() if t is float]
INTS = [k for k, t in numeric_fields() if t is int]


def env_name(key: str) -> str:
    return "RATCHET_" + key.replace(".", "__").upper()


def test_the_walk_finds_every_numeric_setting():
    # a walk that silently found nothing would make the tests below vacuous
    assert {"model.timeout_s", "finetune.lora.lr", "verify.spending_rho", "distill.tool_timeout_s"} <= set(
        FLOATS
    )
    assert {"seed", "concurrency", "finetune.lora.seed", "distill.tool_memory_mb", "evolve.workers"} <= set(
        INTS
    )
    assert len(FLOATS) >= 15 and len(INTS) >= 39


def one_line_config_error(key: str, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_settings(**kwargs)
    msg = str(info.value)
    assert f"invalid setting {key}:" in msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("key", FLOATS)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_no_float_setting_takes_inf_or_nan_from_any_source(
    key: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    one_line_config_error(key, overrides={key: float(value)})
    *table, leaf = key.split(".")
    toml = (f"[{'.'.join(table)}]\n" if table else "") + f"{leaf} = {value}\n"
    (tmp_path / "ratchet.toml").write_text(toml)
    one_line_config_error(key)
    (tmp_path / "ratchet.toml").unlink()
    monkeypatch.setenv(env_name(key), value)
    one_line_config_error(key)


@pytest.mark.parametrize("key", INTS)
@pytest.mark.parametrize("value", [10**30, -(10**30)])
def test_every_int_setting_is_bounded_on_both_sides(key: str, value: int, monkeypatch: pytest.MonkeyPatch):
    one_line_config_error(key, overrides={key: value})
    monkeypatch.setenv(env_name(key), str(value))
    one_line_config_error(key)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("model.timeout_s", 0.0),
        ("model.timeout_s", 1e9),  # past what a socket timeout takes
        ("teacher.timeout_s", -1.0),
        ("distill.tool_timeout_s", 1e7),
        ("finetune.lora.lr", 2.0),
        ("finetune.lora.lr", 0.0),
        ("verify.spending_rho", 1e6),
        ("verify.alpha", 1.0),
        ("verify.max_regressions", 1.5),
        ("trace_sample_rate", -0.1),
        ("explore.epsilon", 1.01),
        ("distill.tool_memory_mb", 2**50),  # RLIMIT_AS in bytes must fit in 64 bits
        ("seed", 2**63),  # stored as an SQLite INTEGER
        ("model.max_tokens", 10**9),
        ("dashboard.port", 70000),
    ],
)
def test_numeric_settings_have_sensible_ranges(key: str, value: float):
    one_line_config_error(key, overrides={key: value})


def test_defaults_and_ordinary_values_stay_valid():
    s = load_settings(
        {
            "model.timeout_s": 600.0,
            "finetune.lora.lr": 1.0,
            "verify.spending_rho": 3.0,
            "seed": 2**31,
            "distill.tool_timeout_s": 60.0,
            "concurrency": 64,
        }
    )
    assert s.finetune.lora.lr == 1.0 and s.seed == 2**31


# --- config paths that are not a readable file ---------------------------------------------


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        ("default-is-a-directory", "ratchet.toml is a directory"),
        ("default-is-a-fifo", "ratchet.toml is not a regular file"),
        ("default-is-a-broken-link", "ratchet.toml does not exist"),
        ("env-missing", "/nonexistent/ratchet.toml does not exist"),
        ("env-directory", "is a directory"),
        ("flag-missing", "/nonexistent/ratchet.toml does not exist"),
        ("flag-directory", "is a directory"),
    ],
)
def test_a_config_path_that_is_not_a_file_is_one_line(
    setup: str, needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    kwargs: dict[str, Any] = {}
    if setup == "default-is-a-directory":
        (tmp_path / "ratchet.toml").mkdir()
    elif setup == "default-is-a-fifo":
        os.mkfifo(tmp_path / "ratchet.toml")  # reading it would block forever
    elif setup == "default-is-a-broken-link":
        (tmp_path / "ratchet.toml").symlink_to(tmp_path / "gone.toml")
    elif setup == "env-missing":
        monkeypatch.setenv(CONFIG_ENV, "/nonexistent/ratchet.toml")
    elif setup == "env-directory":
        monkeypatch.setenv(CONFIG_ENV, str(tmp_path))
    elif setup == "flag-missing":
        kwargs["config_file"] = Path("/nonexistent/ratchet.toml")
    elif setup == "flag-directory":
        kwargs["config_file"] = tmp_path
    with pytest.raises(ConfigError) as info:
        load_settings(**kwargs)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg, msg


def test_an_empty_config_variable_means_the_default_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "ratchet.toml").write_text("seed = 4\n")
    monkeypatch.setenv(CONFIG_ENV, "")
    assert load_settings().seed == 4


def test_a_config_file_that_is_not_text_names_the_file(tmp_path: Path):
    (tmp_path / "ratchet.toml").write_bytes(b"\xff\xfe\x00garbage\n\x80")
    with pytest.raises(ConfigError) as info:
        load_settings()
    msg = str(info.value)
    assert "ratchet.toml" in msg and "\n" not in msg, msg


# --- RATCHET_* variables that no setting reads ---------------------------------------------


@pytest.mark.parametrize(
    ("name", "nearest"),
    [
        ("RATCHET_CONCURENCY", "RATCHET_CONCURRENCY"),
        ("RATCHET_MODEL__ENDPONT", "RATCHET_MODEL__ENDPOINT"),
        ("RATCHET_MODEL_ENDPOINT", "RATCHET_MODEL__ENDPOINT"),  # one underscore instead of two
        ("RATCHET_FINETUNE__LORA__RNK", "RATCHET_FINETUNE__LORA__RANK"),
        ("ratchet_data_dri", "RATCHET_DATA_DIR"),  # pydantic reads names in any case
        ("RATCHET_MODEL__APIKEY", "RATCHET_MODEL__API_KEY"),
        ("ratchet_config", "RATCHET_CONFIG"),  # read as spelt: in lower case it would be ignored
    ],
)
def test_a_misspelt_variable_is_an_error_naming_the_nearest_one(
    name: str, nearest: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(name, "s3cret-value")
    with pytest.raises(ConfigError) as info:
        load_settings()
    msg = str(info.value)
    assert f"unknown environment variable {name}" in msg and nearest in msg, msg
    assert "s3cret-value" not in msg and "\n" not in msg  # values (API keys) are never echoed


def test_a_variable_near_nothing_is_still_an_error(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RATCHET_XYZZY_PLUGH", "1")
    with pytest.raises(ConfigError, match="unknown environment variable RATCHET_XYZZY_PLUGH"):
        load_settings()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("RATCHET_FAULT", "rollout.stored:5"),  # ratchet/faults.py
        ("RATCHET_HOME", "/srv/ratchet"),  # deployments/prefect.yaml
        ("RATCHET_SERVER_THREADS", "2"),  # the embedded model server
        ("RATCHET_CHROMIUM", "/usr/bin/chromium"),  # the dashboard's browser test
        ("RATCHET_TEST_MODELS_DIR", "/tmp/models"),  # the test suite's own
        ("RATCHET_TEST_SECRET", "s3cret"),
        ("RATCHET_MODEL", '{"name": "other"}'),  # a whole section as JSON
        ("ratchet_concurrency", "3"),
        ("RATCHET_FINETUNE__LORA__RANK", "8"),
    ],
)
def test_variables_ratchet_itself_reads_are_accepted(name: str, value: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(name, value)
    load_settings()


# --- the same, through the `ratchet` command -----------------------------------------------


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("--config-missing", "config file /nonexistent.toml does not exist"),
        ("--config-directory", "is a directory"),
        ("RATCHET_CONFIG-missing", "config file /nonexistent.toml does not exist"),
        ("ratchet.toml-directory", "config file ratchet.toml is a directory"),
        ("misspelt-variable", "did you mean RATCHET_CONCURRENCY?"),
        ("inf-in-the-environment", "invalid setting model.timeout_s: Input should be a finite number"),
        ("inf-in-the-file", "invalid setting finetune.lora.lr: Input should be a finite number"),
    ],
)
def test_config_errors_are_one_line_from_the_cli_and_write_nothing(
    case: str, needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from typer.testing import CliRunner

    from ratchet.cli.main import app

    args = ["--data-dir", str(tmp_path / "data")]
    if case == "--config-missing":
        args += ["--config", "/nonexistent.toml"]
    elif case == "--config-directory":
        (tmp_path / "conf").mkdir()
        args += ["--config", str(tmp_path / "conf")]
    elif case == "RATCHET_CONFIG-missing":
        monkeypatch.setenv(CONFIG_ENV, "/nonexistent.toml")
    elif case == "ratchet.toml-directory":
        (tmp_path / "ratchet.toml").mkdir()
    elif case == "misspelt-variable":
        monkeypatch.setenv("RATCHET_CONCURENCY", "2")
    elif case == "inf-in-the-environment":
        monkeypatch.setenv("RATCHET_MODEL__TIMEOUT_S", "inf")
    else:
        (tmp_path / "ratchet.toml").write_text("[finetune.lora]\nlr = inf\n")
    result = CliRunner().invoke(app, [*args, "adapters", "list"])
    monkeypatch.delenv(CONFIG_ENV, raising=False)  # --config sets it for the process
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], result.stderr
    assert not (tmp_path / "data").exists()
