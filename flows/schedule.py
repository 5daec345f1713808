"""ratchet's Prefect deployments: `evolve` on a nightly cron schedule, `promote` on demand.

`ratchet deploy` registers both with the Prefect server at PREFECT_API_URL and serves them
from this process (Prefect's `serve`: no work pool or worker needed); scheduled runs and
runs started from the Prefect UI execute here. Flows get the settings file's path, not the
settings: the server stores parameters as JSON, and API keys must stay in the environment.
The work-pool alternative is `deployments/prefect.yaml` (its header has the commands).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ratchet.flows.evolve import evolve_flow
from ratchet.flows.promote import promote_flow

NIGHTLY = "0 2 * * *"


def build(
    config: Path | None, overrides: dict[str, Any], cron: str = NIGHTLY, timezone: str = "UTC"
) -> list[Any]:
    """The two RunnerDeployments. Every run reads `config` (None: ./ratchet.toml) and applies
    `overrides` (dotted setting keys, e.g. the CLI's --data-dir; never secrets)."""
    from prefect.client.schemas.schedules import CronSchedule

    params: dict[str, Any] = {"config": str(config.resolve()) if config else None, "overrides": overrides}
    return [
        evolve_flow.to_deployment(
            name="nightly",
            schedule=CronSchedule(cron=cron, timezone=timezone),
            parameters=params,
            description="ratchet evolve: generation 0 baseline, then evolve.generations generations",
            tags=["ratchet"],
            enforce_parameter_schema=False,
        ),
        promote_flow.to_deployment(
            name="promote",
            parameters=params,
            description="Decide on verified candidates in the Prefect UI's form",
            tags=["ratchet"],
            enforce_parameter_schema=False,
        ),
    ]


def serve_deployments(
    config: Path | None, overrides: dict[str, Any], cron: str = NIGHTLY, timezone: str = "UTC"
) -> None:
    """Register the deployments and run their flow runs until stopped (Ctrl-C)."""
    from prefect import serve

    serve(*build(config, overrides, cron, timezone), print_starting_message=False)
