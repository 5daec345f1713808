"""ratchet's Prefect deployments: `evolve` on a nightly cron schedule, `promote` on demand.

They are declared once, in `deployments/prefect.yaml` (names, entrypoints, descriptions, tags,
the schedule), and reach a Prefect server two ways from that one file:

* `ratchet deploy` (`serve_deployments`) reads it, registers both with the server at
  PREFECT_API_URL and serves them from this process (Prefect's `serve`: no work pool or
  worker needed); scheduled runs and runs started from the Prefect UI execute here.
* `prefect deploy --prefect-file deployments/prefect.yaml --all` registers the same two with
  a work pool (the file's header has the commands).

Flows get the settings file's path, not the settings: the server stores parameters as JSON,
and API keys must stay in the environment.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from ratchet.errors import ConfigError

PREFECT_YAML = Path(__file__).resolve().parents[1] / "deployments" / "prefect.yaml"


@dataclass(frozen=True)
class Declared:
    """One deployment as `deployments/prefect.yaml` declares it."""

    name: str
    entrypoint: str  # "flows/evolve.py:evolve_flow", relative to the project directory
    description: str
    tags: tuple[str, ...]
    cron: str | None  # None: runs only when started
    timezone: str = "UTC"
    parameters: tuple[tuple[str, Any], ...] = ()  # the file's own, beside the settings file's path

    def flow(self) -> Any:
        """The flow object the entrypoint names (the project's own module, already imported)."""
        path, attr = self.entrypoint.split(":")
        module = "ratchet." + path.removesuffix(".py").replace("/", ".")
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{PREFECT_YAML} names {self.entrypoint!r}, not a ratchet module")
        return getattr(importlib.import_module(module), attr)


@cache
def declared() -> tuple[Declared, ...]:
    """The deployments of `deployments/prefect.yaml`, in its order."""
    import yaml  # Prefect's own dependency

    try:
        spec = yaml.safe_load(PREFECT_YAML.read_text())
        out = []
        for d in spec["deployments"]:
            schedule = (d.get("schedules") or [{}])[0]
            out.append(
                Declared(
                    name=d["name"],
                    entrypoint=d["entrypoint"],
                    description=d.get("description", ""),
                    tags=tuple(d.get("tags") or ()),
                    cron=schedule.get("cron"),
                    timezone=schedule.get("timezone", "UTC"),
                    parameters=tuple((k, v) for k, v in (d.get("parameters") or {}).items() if k != "config"),
                )
            )
    except (OSError, yaml.YAMLError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(
            f"cannot read the deployments from {PREFECT_YAML} ({type(exc).__name__}: {exc})",
            "restore it from the repository (git checkout deployments/prefect.yaml)",
        ) from None
    return tuple(out)


def nightly() -> Declared:
    """The scheduled deployment (evolve's)."""
    return next(d for d in declared() if d.cron)


def build(
    config: Path | None, overrides: dict[str, Any], cron: str | None = None, timezone: str | None = None
) -> list[Any]:
    """The declared deployments as RunnerDeployments. Every run reads `config` (None:
    ./ratchet.toml) and applies `overrides` (dotted setting keys, e.g. the CLI's --data-dir;
    never secrets). `cron`/`timezone` replace the declared schedule."""
    from prefect.client.schemas.schedules import CronSchedule

    params: dict[str, Any] = {"config": str(config.resolve()) if config else None, "overrides": overrides}
    out = []
    for d in declared():
        schedule = None
        if d.cron:
            schedule = CronSchedule(cron=cron or d.cron, timezone=timezone or d.timezone)
        out.append(
            d.flow().to_deployment(
                name=d.name,
                schedule=schedule,
                parameters=dict(d.parameters) | params,
                description=d.description,
                tags=list(d.tags),
                enforce_parameter_schema=False,
            )
        )
    return out


def serve_deployments(
    config: Path | None, overrides: dict[str, Any], cron: str | None = None, timezone: str | None = None
) -> None:
    """Register the deployments and run their flow runs until stopped (Ctrl-C)."""
    from prefect import serve

    serve(*build(config, overrides, cron, timezone), print_starting_message=False)
