"""Call a flow with the settings' concurrency as its task runner's worker limit."""

from __future__ import annotations

from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner

from ratchet.config import Settings


def run_flow(flow_obj: Any, settings: Settings, **kwargs: Any) -> Any:
    runner = ThreadPoolTaskRunner(max_workers=settings.concurrency)
    return flow_obj.with_options(task_runner=runner)(settings=settings, **kwargs)
